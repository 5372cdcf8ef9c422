"""MultiExecutor: one run's replicas spread over several executors.

DiLoCo replicas share nothing but the object store, so nothing stops rank 0-1 from running as
local processes while ranks 2-3 run on Ray or a cloud service. MultiExecutor hands each
sub-executor a contiguous block of global ranks (`launch_ranks(ranks, world_size, ...)`), so
every replica sees the same WORLD_SIZE and a unique REPLICA_RANK, and routes poll / collect /
cancel / logs for each handle to the executor that launched it.

    executor = MultiExecutor({LocalProcessExecutor(): 2, RayExecutor(address="auto"): 2})
    handles = executor.launch_replicas(n_replicas=4, entrypoint=..., entrypoint_args=...)
    result = executor.collect(handles, timeout=3600)      # ranks 0,1 local; 2,3 on Ray
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from composer_replication.executors.executor import (
    EntrypointArgs,
    RankLauncher,
    Releasable,
    ReplicaHandle,
    Resources,
    SecretsByRank,
    ServerlessExecutor,
    SupervisorBase,
    check_secrets,
)

__all__ = ["MultiExecutor"]


class MultiExecutor(SupervisorBase):
    """Spread replicas over executors: {executor: count} or [(executor, count), ...].

    Ranks are assigned in the given order: the first executor gets ranks 0..c0-1, the next
    c0..c0+c1-1, and so on. launch_replicas' n_replicas must equal the sum of the counts. A
    launch that fails on one executor cancels what the earlier ones started.
    """

    backend = "multi"

    def __init__(
        self,
        placement: Mapping[RankLauncher, int] | Sequence[tuple[RankLauncher, int]],
        *,
        poll_interval: float = 0.2,
    ) -> None:
        items = list(placement.items() if isinstance(placement, Mapping) else placement)
        if not items:
            raise ValueError("MultiExecutor needs at least one (executor, count) pair")
        for pair in items:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"placement entries must be (executor, count) pairs, got {pair!r}")
            executor, count = pair
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(
                    f"replica count for {executor!r} must be an int >= 1, got {count!r}"
                )
            if not isinstance(executor, ServerlessExecutor):
                raise ValueError(f"{executor!r} is not a ServerlessExecutor")
            if not isinstance(executor, RankLauncher):
                raise ValueError(
                    f"{type(executor).__name__} cannot launch a subset of a run's ranks (it "
                    "has no check_launch(n_replicas, entrypoint) and launch_ranks(ranks, "
                    "world_size, ...)); derive it from executors.executor.ExecutorBase"
                )
        if len({id(e) for e, _ in items}) != len(items):
            raise ValueError("each executor may appear only once in a placement")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        self.placement: list[tuple[RankLauncher, int]] = items
        self.poll_interval = float(poll_interval)
        # id(handle) -> the executor that launched it; handles are the driver's own objects.
        self._owner: dict[int, RankLauncher] = {}
        self._handles: dict[int, ReplicaHandle] = {}  # keeps ids from being reused

    @property
    def world_size(self) -> int:
        return sum(count for _, count in self.placement)

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str,
        entrypoint_args: EntrypointArgs | None = None,
        *,
        env: dict[str, str] | None = None,
        resources: Resources | None = None,
        secrets: SecretsByRank | None = None,
    ) -> list[ReplicaHandle]:
        """Launch ranks 0..n_replicas-1 over the sub-executors (resources go to every one,
        ``secrets[rank]`` only to the sub-executor that starts that rank)."""
        if isinstance(n_replicas, bool) or not isinstance(n_replicas, int) or n_replicas < 1:
            raise ValueError(f"n_replicas must be an integer >= 1, got {n_replicas!r}")
        if n_replicas != self.world_size:
            raise ValueError(
                f"n_replicas={n_replicas} but the placement adds up to {self.world_size} "
                f"({', '.join(f'{type(e).__name__}: {c}' for e, c in self.placement)})"
            )
        own = check_secrets(secrets, range(n_replicas))
        launched: list[ReplicaHandle] = []
        try:
            # Validate everywhere first, so a bad entrypoint starts nothing on any backend.
            for executor, _ in self.placement:
                executor.check_launch(n_replicas, entrypoint)
            start = 0
            for executor, count in self.placement:
                ranks = list(range(start, start + count))
                start += count
                mine = {r: own[r] for r in ranks if r in own}
                handles = executor.launch_ranks(
                    ranks,
                    n_replicas,
                    entrypoint,
                    entrypoint_args,
                    env=env,
                    resources=resources,
                    secrets=mine or None,
                )
                for handle in handles:
                    self._owner[id(handle)] = executor
                    self._handles[id(handle)] = handle
                launched += handles
        except BaseException:
            self._cancel_quietly(launched)
            raise
        return launched

    def executor_of(self, handle: ReplicaHandle) -> RankLauncher:
        """The sub-executor that launched handle."""
        try:
            return self._owner[id(handle)]
        except KeyError:
            raise ValueError(
                f"handle {handle.job_id!r} (rank {handle.replica_id}) was not launched by this "
                "MultiExecutor"
            ) from None

    def _groups(
        self, handles: list[ReplicaHandle]
    ) -> list[tuple[RankLauncher, list[ReplicaHandle]]]:
        groups: dict[int, tuple[RankLauncher, list[ReplicaHandle]]] = {}
        for handle in handles:
            executor = self.executor_of(handle)
            groups.setdefault(id(executor), (executor, []))[1].append(handle)
        return list(groups.values())

    def poll(self, handles: list[ReplicaHandle]) -> list[ReplicaHandle]:
        for executor, group in self._groups([h for h in handles if not h.status.done]):
            executor.poll(group)
        return handles

    def _refresh(self, handle: ReplicaHandle) -> None:
        self.executor_of(handle).poll([handle])

    def _terminate(self, handle: ReplicaHandle) -> None:
        self._terminate_all([handle])

    def _terminate_all(self, handles: list[ReplicaHandle]) -> None:
        # Each backend stops its own group at once (one grace period per backend, not per rank).
        for executor, group in self._groups(handles):
            executor.cancel(group)

    def logs(self, handle: ReplicaHandle, tail: int | None = None) -> str:
        return self.executor_of(handle).logs(handle, tail=tail)

    def shutdown(self) -> None:
        """Shut down every sub-executor that holds something (`Releasable`)."""
        for executor, _ in self.placement:
            if isinstance(executor, Releasable):
                executor.shutdown()
