"""The real torchft path: a lighthouse + `torchft.Manager` over gloo, for clusters.

Where replicas can reach each other (local processes, a Ray cluster, Kubernetes) the outer loop
runs unchanged over torchft's own fault-tolerant Manager instead of the object store::

    lighthouse = start_lighthouse(min_replicas=2)              # once, somewhere reachable
    manager = build_torchft_manager(
        replica_id="replica_0", lighthouse_addr=lighthouse_address(lighthouse),
        min_replicas=2, timeouts=TorchFTTimeouts())
    outer = make_diloco_outer_loop(opt, manager, sync_every_h=500, model=model)
    ...
    manager.close()

`composer-replication train` takes this path with ``[diloco] manager = "torchft"``.

`TorchFTManager` adapts a torchft Manager to the outer loop's `Manager` protocol
(``diloco/manager.py``): it forwards DiLoCo's calls, runs the heal hooks in the round in which
torchft healed this replica from a peer (see `TorchFTManager.start_quorum`), keeps a
`RoundRecord` per round, and, given a ``states`` handle on the
run's object store, publishes the outer state after committed rounds (participating rank 0
only) and loads the newest one in `initial_sync`, so a restarted run resumes from the store as
it does with the object-store exchange. A raw ``torchft.Manager`` passed to
`make_diloco_outer_loop` is wrapped by `as_manager`.

What each replica needs (torchft 0.2.0): a `ProcessGroupGloo` (reconfigured at every quorum), a
TCPStore for its replica group (one process per group here, so it hosts its own), and the
lighthouse's address. The Manager opens inbound connections (gRPC manager server, HTTP checkpoint
transport, gloo, TCPStore), which is why serverless replicas use `ObjectStoreManager` instead.

Timeouts (torchft leaves their relation undocumented; torchtitan #2899) must be ordered

    process_group_s  <=  operation_s  <  join_s  <  quorum_s,     heartbeat_s < join_s

- ``process_group_s``: gloo's own collective timeout; detects a peer that died mid-allreduce.
  Not longer than ``operation_s``, or the Manager gives up on a collective gloo still waits on.
- ``operation_s`` (``Manager(timeout=)``): allreduce waits, the should_commit RPC, and healing
  (checkpoint transfer to a recovering replica).
- ``join_s`` (lighthouse ``join_timeout_ms``): how long the lighthouse waits for heartbeating
  replicas that have not asked for the quorum yet (still in their inner steps, or recovering).
  It must exceed the recovery time (``operation_s``), or a recovering replica never gets back in
  (torchft PR #75).
- ``quorum_s`` (``Manager(quorum_timeout=)``): how long ``start_quorum`` waits for the lighthouse.
  It must exceed ``join_s`` (the lighthouse may legitimately wait that long for stragglers), and
  for DiLoCo a whole round of H inner steps, since a replica that arrives after a quorum formed
  waits for the next one.
- ``heartbeat_s`` (lighthouse ``heartbeat_timeout_ms``): silence after which a replica counts as
  dead, so the others stop waiting for it; shorter than ``join_s``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from composer_replication.diloco.manager import DiLoCoSurface, Manager
from composer_replication.exchange.document_format import model_fingerprint
from composer_replication.exchange.outer_state import (
    LoadStateFn,
    OuterState,
    SaveStateFn,
    StateDict,
    StateFns,
    fetch_outer_state,
    publish_outer_state,
)
from composer_replication.exchange.run_documents import RunDocuments
from composer_replication.exchange.store_manager import RoundRecord, round_record
from composer_replication.fields import require, setting

__all__ = [
    "TorchFTEndpoint",
    "TorchFTManager",
    "TorchftConfig",
    "TorchFTTimeouts",
    "as_manager",
    "build_torchft_manager",
    "lighthouse_address",
    "start_lighthouse",
]

logger = logging.getLogger(__name__)


def _require_torchft() -> Any:
    try:
        import torchft
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the torchft path needs torchft: pip install composer-replication[diloco]"
        ) from exc
    return torchft


@dataclass(frozen=True, kw_only=True)
class TorchftConfig:
    """The torchft path's settings (`[diloco] lighthouse`)."""

    lighthouse: str = setting(
        "",
        "torchft lighthouse 'http://HOST:PORT' (manager = 'torchft'); empty = the driver runs "
        "one on 127.0.0.1 (local backend only)",
    )

    def __post_init__(self) -> None:
        if not self.lighthouse:
            return
        url = urlparse(self.lighthouse)
        try:
            port = url.port
        except ValueError:
            port = None
        require(
            url.scheme in ("http", "https") and bool(url.hostname) and port is not None,
            "lighthouse",
            f"{self.lighthouse!r} is not an address like 'http://10.0.0.5:29510'",
        )


@dataclass(frozen=True)
class TorchFTTimeouts:
    """Seconds for each torchft timeout; validated to the order in the module docstring."""

    process_group_s: float = 60.0
    operation_s: float = 120.0
    join_s: float = 300.0
    quorum_s: float = 3600.0
    heartbeat_s: float = 10.0
    connect_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("process_group_s", "operation_s", "join_s", "quorum_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TorchFTTimeouts.{name} must be > 0, got {getattr(self, name)}")
        if not self.connect_s > 0:
            raise ValueError(f"TorchFTTimeouts.connect_s must be > 0, got {self.connect_s}")
        if not self.process_group_s <= self.operation_s < self.join_s < self.quorum_s:
            raise ValueError(
                "torchft timeouts must be ordered process_group_s <= operation_s < join_s < "
                f"quorum_s; got {self.process_group_s} / {self.operation_s} / {self.join_s} / "
                f"{self.quorum_s}. A quorum timeout shorter than the lighthouse's join wait "
                "aborts quorums that are still forming; a join wait shorter than recovery "
                "(operation_s) locks healing replicas out."
            )
        if not self.heartbeat_s < self.join_s:
            raise ValueError(
                f"heartbeat_s={self.heartbeat_s} must be < join_s={self.join_s} so a dead "
                "replica is noticed before the lighthouse stops waiting for stragglers"
            )


@dataclass(frozen=True)
class TorchFTEndpoint:
    """Where a replica group's torchft Manager listens: ``hostname`` is also what it advertises
    to its peers (an address they can reach); ``store_port`` (its TCPStore) and
    ``manager_port``: 0 = a free port."""

    hostname: str = "127.0.0.1"
    store_port: int = 0
    manager_port: int = 0


def start_lighthouse(
    min_replicas: int,
    *,
    bind: str = "127.0.0.1:0",
    timeouts: TorchFTTimeouts | None = None,
    quorum_tick_ms: int = 100,
) -> Any:
    """Start an in-process `torchft.coordination.LighthouseServer`; call ``.shutdown()`` to stop.

    The CLI equivalent (for a separate host):
    ``torchft_lighthouse --bind 0.0.0.0:29510 --min_replicas N --join_timeout_ms J
    --heartbeat_timeout_ms B``. Use `lighthouse_address` for the address replicas dial.
    """
    if min_replicas < 1:
        raise ValueError(f"min_replicas must be >= 1, got {min_replicas}")
    _require_torchft()
    from torchft.coordination import LighthouseServer

    t = timeouts or TorchFTTimeouts()
    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=int(t.join_s * 1000),
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=int(t.heartbeat_s * 1000),
    )


def lighthouse_address(lighthouse: Any, host: str = "127.0.0.1") -> str:
    """``http://host:port`` of a lighthouse (its own ``address()`` names the machine's hostname,
    which may not resolve inside containers; pass the host replicas should dial)."""
    port = urlparse(lighthouse.address()).port
    return f"http://{host}:{port}"


class TorchftManagerSurface(DiLoCoSurface, Protocol):
    """What `TorchFTManager` uses of a ``torchft.manager.Manager`` (torchft ships no types)."""

    def batches_committed(self) -> int: ...

    def num_participants(self) -> int: ...

    def participating_rank(self) -> int | None: ...

    def errored(self) -> Exception | None: ...

    def load_state_dict(self, state_dict: dict[str, int]) -> None: ...

    def shutdown(self, wait: bool = ...) -> None: ...


class TorchFTManager:
    """A torchft Manager seen through the outer loop's `Manager` protocol (see the module).

    Args:
        manager: the ``torchft.manager.Manager`` (built with ``use_async_quorum=False``).
        states: the run's documents in an object store (e.g.
            ``RunDocuments(ObjectStore(uri), world_size=N, codec="fp32", keep_steps=4,
            poll_interval_s=0.5)``); None = no publishing and no resume from a store.
        checkpoint_every: publish the outer state every this many committed rounds.
        on_close: called by `close` after the manager shut down (e.g. to release its TCPStore).

    ``history`` records, per round: committed, ``participants`` (torchft's num_participants),
    the tokens / inner steps this replica reported, ``bytes_uploaded`` / ``bytes_downloaded``
    as the payload this replica handed to ``allreduce`` (gloo's ring moves about
    2 (n-1)/n of it each way) and the seconds from ``start_quorum`` to ``should_commit``.
    torchft does not name the participating replicas, so ``included_ranks`` stays [].
    """

    # torchft's name for the quorum mode, read by DiLoCo
    _use_async_quorum: bool = False

    def __init__(
        self,
        manager: TorchftManagerSurface,
        *,
        states: RunDocuments | None = None,
        checkpoint_every: int = 1,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        if manager._use_async_quorum:
            raise ValueError(
                "DiLoCo needs a synchronous quorum: build the torchft Manager with "
                "use_async_quorum=False (build_torchft_manager does)"
            )
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self.manager = manager
        self.states = states
        self.checkpoint_every = checkpoint_every
        self._on_close = on_close
        self._state = StateFns()
        self._heal_hooks: list[Callable[[], None]] = []
        self._healed = False
        self._heal_pending = False
        self._publish_due = False
        self._tokens: int | None = None
        self._inner_steps = 0
        self._payload_bytes = 0
        self._quorum_started: float | None = None
        self.history: list[RoundRecord] = []

    # ------------------------------------------------------------------ torchft Manager surface
    def register_state_dict_fn(
        self, key: str, load_state_dict: LoadStateFn, state_dict: SaveStateFn
    ) -> None:
        """Register with torchft (which calls ``load_state_dict`` only when this replica heals
        from a peer: that is how a heal is noticed) and with the store archive."""
        self._state.register(key, load_state_dict, state_dict)

        def load_from_peer(sd: StateDict) -> None:
            self._healed = True
            load_state_dict(sd)

        self.manager.register_state_dict_fn(key, load_from_peer, state_dict)

    def allow_state_dict_read(self) -> None:
        self.manager.allow_state_dict_read()

    def disallow_state_dict_read(self) -> None:
        self.manager.disallow_state_dict_read()

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """torchft's quorum (synchronous: a heal from a peer is applied before this returns).

        The heal hooks do not run here: torchft takes a healed replica's pseudo-gradient against
        the healed global weights (its local work still counts), so copying the global weights
        into the model now would zero its contribution. They run in `should_commit`, after
        DiLoCo restored the synced fragment and before the outer step, where they bring the
        other fragments onto the healed global weights too.
        """
        self._healed = False
        self._quorum_started = time.monotonic()
        self.manager.start_quorum(allow_heal=allow_heal, shrink_only=shrink_only, timeout=timeout)
        if self._healed:
            logger.info("healed from a peer at step %s", self.manager.current_step())
            self._heal_pending = True
            self.history.append(
                round_record(self.manager.current_step(), committed=True, healed=True)
            )

    def current_step(self) -> int:
        return self.manager.current_step()

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> dist.Work:
        self._payload_bytes += tensor.numel() * tensor.element_size()
        return self.manager.allreduce(tensor, should_quantize=should_quantize)

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        committed = self.manager.should_commit(timeout=timeout)
        if self._heal_pending:
            self._heal_pending = False
            for fn in self._heal_hooks:
                fn()
        step = self.manager.current_step()
        record = round_record(step if committed else step + 1, committed=committed)
        record["participants"] = self.manager.num_participants()
        record["tokens"], record["inner_steps"] = self._tokens, self._inner_steps
        record["bytes_uploaded"] = record["bytes_downloaded"] = self._payload_bytes
        if self._quorum_started is not None:
            record["seconds"] = time.monotonic() - self._quorum_started
        if not committed:
            err = self.manager.errored()
            record["error"] = (
                f"{type(err).__name__}: {err}".splitlines()[0]
                if err is not None
                else "should_commit was False (fewer than min_replicas, or a peer failed)"
            )
        self.history.append(record)
        self._tokens, self._inner_steps, self._payload_bytes = None, 0, 0
        if committed and step % self.checkpoint_every == 0:
            self._publish_due = True
        return committed

    # ------------------------------------------------------------------ outer-loop hooks
    def add_heal_hook(self, fn: Callable[[], None]) -> None:
        self._heal_hooks.append(fn)

    def initial_sync(self, named_parameters: Mapping[str, torch.Tensor]) -> int:
        """Resume from the newest outer state in ``states`` if there is one (all replicas then
        agree on it); otherwise torchft synchronises the replicas at the first quorum
        (``init_sync``). Returns the round this replica starts at."""
        if self.states is not None:
            self.states.ensure_manifest(model_fingerprint(dict(named_parameters)))
            state = fetch_outer_state(self.states)
            if state is not None:
                self._state.load(state)
                self.manager.load_state_dict(
                    {"step": state.round, "batches_committed": state.batches_committed}
                )
        return self.manager.current_step()

    def record_inner_step(self) -> None:
        self._inner_steps += 1

    def record_tokens(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"token count must be >= 0, got {n}")
        self._tokens = (self._tokens or 0) + int(n)

    def publish_if_due(self) -> bool:
        """Publish the outer state to ``states`` after a committed round (participating rank 0
        only, so one replica uploads). True if this call wrote it."""
        if not self._publish_due or self.states is None:
            return False
        self._publish_due = False
        if self.manager.participating_rank() != 0:
            return False
        state = OuterState(
            round=self.manager.current_step(),
            user=self._state.collect(),
            batches_committed=self.manager.batches_committed(),
        )
        return publish_outer_state(self.states, state)

    def drain(self) -> None:
        """End of training: publish a due state (torchft has no exchange in flight here)."""
        self.publish_if_due()

    def close(self) -> None:
        """Shut the torchft manager down (and whatever ``on_close`` releases)."""
        self.manager.shutdown(wait=False)
        if self._on_close is not None:
            self._on_close()


if TYPE_CHECKING:  # mypy proves that TorchFTManager satisfies the outer loop's protocol

    def _implementation(m: TorchFTManager) -> Manager:
        return m


def as_manager(manager: Manager) -> Manager:
    """``manager`` as the outer loop's `Manager`: a raw ``torchft.manager.Manager`` (the seed
    recipes pass one) is wrapped in `TorchFTManager`; anything else is returned as it is."""
    torchft_manager = sys.modules.get("torchft.manager")  # not imported: cannot be one
    # another thread may be importing torchft right now: a module without its Manager class
    # yet cannot have produced an instance of it
    manager_class = getattr(torchft_manager, "Manager", None)
    if manager_class is not None and isinstance(manager, manager_class):
        return TorchFTManager(manager)
    return manager


def build_torchft_manager(
    *,
    replica_id: str,
    lighthouse_addr: str | None = None,
    min_replicas: int,
    timeouts: TorchFTTimeouts | None = None,
    endpoint: TorchFTEndpoint | None = None,
    load_state_dict: Callable[[Any], None] | None = None,
    state_dict: Callable[[], object] | None = None,
    init_sync: bool = True,
    states: RunDocuments | None = None,
) -> TorchFTManager:
    """A `TorchFTManager` over a new ``torchft.Manager`` for one single-process replica group.

    Hosts the replica group's TCPStore on ``endpoint`` (`TorchFTEndpoint`; None: loopback, free
    ports), builds a `ProcessGroupGloo` with ``timeouts.process_group_s`` and a Manager with a
    synchronous quorum (DiLoCo requires ``use_async_quorum=False``). ``load_state_dict`` /
    ``state_dict`` register extra user state for healing (DiLoCo registers its global weights and
    outer optimizer itself). With ``init_sync`` (default) torchft copies the weights of one
    replica to the others at the first quorum; replicas built from the same seed may pass False.
    ``states``: see `TorchFTManager`.

    ``lighthouse_addr`` points at a running lighthouse (``http://host:port``); None reads
    ``$TORCHFT_LIGHTHOUSE`` (torchft's own variable). ``close()`` on the result shuts the
    manager and its store down.
    """
    lighthouse_addr = lighthouse_addr or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse_addr:
        raise ValueError(
            "no lighthouse: pass lighthouse_addr='http://host:port' (start one with "
            "start_lighthouse() or the torchft_lighthouse CLI) or set $TORCHFT_LIGHTHOUSE"
        )
    if min_replicas < 1:
        raise ValueError(f"min_replicas must be >= 1, got {min_replicas}")
    if not replica_id:
        raise ValueError("replica_id must be a non-empty string, unique per replica group")
    _require_torchft()
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    t = timeouts or TorchFTTimeouts()
    where = endpoint or TorchFTEndpoint()
    hostname = where.hostname
    store = TCPStore(
        host_name=hostname,
        port=where.store_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=t.connect_s),
    )
    pg = ProcessGroupGloo(timeout=timedelta(seconds=t.process_group_s))
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=timedelta(seconds=t.operation_s),
        quorum_timeout=timedelta(seconds=t.quorum_s),
        connect_timeout=timedelta(seconds=t.connect_s),
        rank=0,
        world_size=1,
        store_addr=hostname,
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=replica_id,
        port=where.manager_port,
        hostname=hostname,
        init_sync=init_sync,
    )
    store_ref = [store]  # keep the TCPStore alive as long as the manager
    return TorchFTManager(manager, states=states, on_close=store_ref.clear)
