"""What the driver watches while the replicas run: fencing an earlier launch, relaunching
failed replicas, declaring departed ones, the run's health.

- `fence_previous_launch`: ``--resume`` waits until the replicas of the earlier launch that
  still send heartbeats stop (they check the run generation at their next write);
- `Restarter`: relaunch a failed replica (same rank) up to ``backend.max_restarts`` times;
- `Departures`: when the outer-loop mode's peers wait for each other in the store, declare a
  replica departed the moment its process fails, or when it sent no heartbeat for
  `SILENT_AFTER_S` (and take it back when it beats again);
- `HealthLog`: a "health" metric record whenever the run state changes (run/status.py);
- `RefusalLog`: every refusal record the mode keeps in the store (`refusal_sources`;
  decoupled: a push the synchronizer refused, a forged or replayed record, state or document a
  participant refused) becomes one "rejected" event in metrics.jsonl, as sync mode's
  rejections do;
- `final_status`: "finished" or "failed" once every replica has ended;
- `no_quorum`: a replica stopped because a round can never commit (`EXIT_NO_QUORUM`): the run
  stops (exit `EXIT_RUN_NO_QUORUM`), naming the round and its refusals, instead of restarting it
  or training on without that round.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from composer_replication.config import ConfigError, RunConfig
from composer_replication.diloco.mode_protocol import OuterLoopMode, RefusalSource
from composer_replication.exchange.liveness import (
    HEARTBEAT_EVERY_S,
    LEARNER_ROLE,
    REPLICA_ROLE,
    STALE_AFTER_S,
    MemberLiveness,
    clear_departure,
    read_liveness,
    write_departure,
)
from composer_replication.exchange.push_store import Refusal
from composer_replication.exchange.store import ObjectStore
from composer_replication.executors.executor import RankLauncher, ReplicaHandle, ServerlessExecutor
from composer_replication.json_types import JSONDict, as_int
from composer_replication.run.metrics import MetricsSink, read_metrics
from composer_replication.run.processes import pid_alive
from composer_replication.run.replica_env import EXIT_NO_QUORUM
from composer_replication.run.status import health_now

__all__ = [
    "EXIT_RUN_NO_QUORUM",
    "FENCE_WAIT_S",
    "SILENT_AFTER_S",
    "Departures",
    "HealthLog",
    "RefusalLog",
    "Restarter",
    "failure_reason",
    "no_quorum",
    "fence_previous_launch",
    "final_status",
]


FENCE_WAIT_S = 4 * HEARTBEAT_EVERY_S  # how long --resume waits for fenced replicas to stop
EXIT_RUN_NO_QUORUM = 3  # `train`'s exit code when a round can never commit (docs/cli.md)


def live_replicas(store: ObjectStore) -> dict[str, MemberLiveness]:
    """The run's replicas/learners whose heartbeats are fresh and whose process may still run
    (a heartbeat from this machine whose pid is gone is not alive), keyed role/id."""
    here = socket.gethostname()
    out = {}
    for key, member in read_liveness(store, roles=[REPLICA_ROLE, LEARNER_ROLE]).items():
        hb = member.heartbeat
        if member.status != "alive" or hb is None:
            continue
        if hb.host == here and hb.pid is not None and not pid_alive(hb.pid):
            continue
        out[key] = member
    return out


def _where(member: MemberLiveness) -> str:
    """ "pid P on HOST" of a live member (`live_replicas` keeps only those with a heartbeat)."""
    hb = member.heartbeat
    return "no heartbeat" if hb is None else f"pid {hb.pid} on {hb.host}"


def fence_previous_launch(
    store: ObjectStore, generation: int, say: Callable[[str], None], wait_s: float | None = None
) -> None:
    """--resume, after writing ``generation``: wait until the replicas of the earlier launch
    that still send heartbeats stop (they check the generation at their next heartbeat and
    write); ConfigError naming them when they do not within ``wait_s``."""
    wait_s = FENCE_WAIT_S if wait_s is None else wait_s
    live = live_replicas(store)
    if not live:
        return
    names = ", ".join(f"{k} ({_where(m)})" for k, m in live.items())
    say(
        f"--resume: replicas of the earlier launch still run: {names}; fenced them "
        f"(run generation {generation}), waiting up to {wait_s:g} s for them to stop"
    )
    fenced_at = time.time()
    deadline = time.monotonic() + wait_s
    while True:
        # alive = a heartbeat written well after the fence (a fenced replica writes none), or
        # a process of this machine that still runs
        here = socket.gethostname()
        still = {
            k: m
            for k, m in live_replicas(store).items()
            if (hb := m.heartbeat) is not None and (hb.host == here or hb.time > fenced_at - 1.0)
        }
        if not still or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if still:
        names = ", ".join(
            f"{k} ({_where(m)}, heartbeat {m.age_s:.0f} s ago)" for k, m in still.items()
        )
        raise ConfigError(
            f"--resume: replicas of this run are still alive after being fenced: {names}. Stop "
            "them first (kill the pid, or cancel the job on its backend), then resume again"
        )


def failure_reason(handle: ReplicaHandle) -> str:
    """The one-line reason a replica failed, without the log tail that follows it in `error`
    (shown by `status` and kept in driver.json)."""
    why = str(handle.error or f"exit code {handle.exit_code}").splitlines()[0]
    return why.split("; last log lines")[0][:200]


class Restarter:
    """Relaunch a failed replica (same rank) up to `backend.max_restarts` times: it reads the
    run config from the store and rejoins from the newest global state, as at a resume. The new
    handle takes the old one's place in the driver's list (the chaos harness sees it too)."""

    def __init__(
        self,
        config: RunConfig,
        executor: ServerlessExecutor,
        entrypoint: str,
        env: dict[str, str],
        secrets: dict[int, dict[str, str]] | None,
    ) -> None:
        self.config, self.executor, self.env, self.secrets = config, executor, env, secrets
        self.entrypoint = entrypoint
        self.used = [0] * config.backend.n_replicas
        self._refused = False

    def will_restart(self, rank: int) -> bool:
        limit = self.config.backend.max_restarts
        return isinstance(self.executor, RankLauncher) and self.used[rank] < limit

    def restart_failed(self, handles: list[ReplicaHandle]) -> list[str]:
        messages = []
        limit = self.config.backend.max_restarts
        for i, handle in enumerate(handles):
            rank = handle.replica_id
            if handle.status.value != "failed" or self.used[rank] >= limit:
                continue
            if handle.exit_code == EXIT_NO_QUORUM:  # the same round would stop it again
                continue
            if not isinstance(self.executor, RankLauncher):
                if not self._refused:
                    self._refused = True
                    messages.append(
                        f"the {type(self.executor).__name__} executor cannot "
                        "relaunch one rank: failed replicas stay failed"
                    )
                continue
            self.used[rank] += 1
            why = failure_reason(handle)
            try:
                (new,) = self.executor.launch_ranks(
                    [rank],
                    self.config.backend.n_replicas,
                    self.entrypoint,
                    {"rendezvous": self.config.store.uri},
                    env=self.env,
                    resources=dict(self.config.backend.resources) or None,
                    secrets={rank: self.secrets[rank]} if self.secrets else None,
                )
            except Exception as exc:  # the old handle stays failed; the run decides as before
                messages.append(
                    f"replica {rank} failed ({why}); relaunching it failed: "
                    f"{type(exc).__name__}: {exc}"
                )
                continue
            new.restarts = handle.restarts + 1
            handles[i] = new
            messages.append(
                f"replica {rank} failed ({why}); restarted "
                f"({self.used[rank]} of {limit}), it rejoins from the store"
            )
        return messages


SILENT_AFTER_S = STALE_AFTER_S  # a running replica without a heartbeat this long is departed


class Departures:
    """For each role whose departures the store records (`OuterLoopMode.departure_roles`: the
    peers wait for each other there, sync DiLoCo over the object store, or decoupled mode's
    synchronizer for its quorum): declare a replica departed the moment its process is seen to
    have failed (before a relaunch, or for good), or when a replica the executor still reports
    running has sent no heartbeat for SILENT_AFTER_S (stopped, hung, partitioned), so that its
    peers stop waiting for it; a silent one that beats again is taken back. What the others
    then do is the mode's to say (`OuterLoopMode.departure_effect`)."""

    def __init__(
        self,
        config: RunConfig,
        mode: OuterLoopMode,
        store: ObjectStore,
        every_s: float = 2.0,
        secret: bytes | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.secret = secret  # the run's slot secret: departure records carry its MAC
        self.mode = mode
        self.roles = mode.departure_roles
        self.every_s = every_s
        self._noted: set[str] = set()  # job ids already declared
        self._silent: set[int] = set()  # ranks declared for want of heartbeats
        self._lost: set[int] = set()  # ranks that failed with no restart left
        self._last = 0.0

    def _without_it(self, gone: int) -> str:
        return self.mode.departure_effect(gone, self.config.backend.n_replicas)

    def note_silent(self, handles: list[ReplicaHandle]) -> list[str]:
        """Every few seconds: departures for running replicas whose heartbeats stopped, and
        their withdrawal when the heartbeats come back."""
        messages: list[str] = []
        now_m = time.monotonic()
        if now_m - self._last < self.every_s:
            return messages
        self._last = now_m
        for role in self.roles:
            messages += self._note_silent(handles, role)
        return messages

    def _note_silent(self, handles: list[ReplicaHandle], role: str) -> list[str]:
        try:
            members = read_liveness(self.store, roles=[role])
        except (OSError, ValueError):  # the store is unreachable for a moment: next time
            return []
        messages, now = [], time.time()
        for h in handles:
            if h.status.value != "running":
                continue
            rank = h.replica_id
            member = members.get(f"{role}/{rank}")
            hb = member.heartbeat if member is not None else None
            # silence counts from this incarnation's first heartbeat (start-up may be long; a
            # crash before it is a process exit, which `note` sees)
            if hb is None or hb.state != "running" or hb.time < (h.start_time or 0.0):
                continue
            silent = now - hb.time
            try:
                if silent > SILENT_AFTER_S and rank not in self._silent:
                    write_departure(
                        self.store,
                        role,
                        rank,
                        reason=f"no heartbeat for {silent:.0f} s",
                        secret=self.secret,
                    )
                    self._silent.add(rank)
                    gone = len(self._silent | self._lost)
                    messages.append(
                        f"replica {rank} sent no heartbeat for {silent:.0f} s: "
                        f"{self._without_it(gone)}"
                    )
                elif silent <= SILENT_AFTER_S and rank in self._silent:
                    clear_departure(self.store, role, rank)
                    self._silent.discard(rank)
                    messages.append(f"replica {rank} sends heartbeats again: it is waited for")
            except OSError as exc:  # the next poll tries again
                messages.append(f"could not update replica {rank}'s departure: {exc!r}")
        return messages

    def note(self, handles: list[ReplicaHandle], restarter: Restarter) -> list[str]:
        messages: list[str] = []
        for role in self.roles:
            messages += self._note(handles, restarter, role)
        return messages

    def _note(self, handles: list[ReplicaHandle], restarter: Restarter, role: str) -> list[str]:
        messages = []
        for h in handles:
            if h.status.value != "failed" or h.job_id in self._noted:
                continue
            self._noted.add(h.job_id)
            self._silent.discard(h.replica_id)  # its process is gone: no longer just silent
            why = failure_reason(h)
            again = restarter.will_restart(h.replica_id)
            reason = f"{why}; {'being restarted' if again else 'no restarts left'}"
            try:
                write_departure(self.store, role, h.replica_id, reason=reason, secret=self.secret)
            except OSError as exc:  # the peers then wait for it as before (timeout_s)
                messages.append(f"could not declare replica {h.replica_id} departed: {exc!r}")
                continue
            if not again:
                self._lost.add(h.replica_id)
                gone = len(self._silent | self._lost)
                messages.append(f"replica {h.replica_id} is lost ({why}); {self._without_it(gone)}")
        return messages


class HealthLog:
    """Every few seconds: the run state from the store's heartbeats (run/status.py); a
    "health" metric record whenever it changes (and every minute)."""

    def __init__(
        self,
        mode: OuterLoopMode,
        n_replicas: int,
        store: ObjectStore,
        sink: MetricsSink,
        every_s: float = 5.0,
    ) -> None:
        self.store, self.sink, self.every_s = store, sink, every_s
        self.mode, self.n = mode, n_replicas
        self.started = time.time()  # built as the replicas are launched: the start-up window
        self._last = 0.0
        self._last_written = 0.0
        self._state: str | None = None
        self._stuck: str | None = None

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        try:
            h = health_now(self.store, mode=self.mode, n_replicas=self.n, started=self.started)
        except Exception:  # the store is unreachable for a moment: the next poll retries
            return
        if self._stuck is not None:  # the run stopped on a round that cannot commit
            h = {**h, "state": "critical", "level": 2, "reasons": [self._stuck, *h["reasons"]]}
        if h["state"] != self._state or force or now - self._last_written > 60:
            self._state = h["state"]
            self._last_written = now
            sync = h.get("synchronizer") or {}
            versions = sync.get("versions")
            self.sink.write(
                [
                    {
                        "time": time.time(),
                        "replica": -1,
                        "kind": "health",
                        "step": 0,
                        "round": 0,
                        "health/state": h["state"],
                        "health/level": h["level"],
                        "health/reasons": "; ".join(h["reasons"]),
                        "health/alive": h["alive_workers"],
                        "health/merges": sync.get("merges"),
                        "health/versions": (
                            sum(as_int(v) for v in versions) if isinstance(versions, list) else None
                        ),
                    }
                ]
            )

    def critical(self, reason: str) -> None:
        """From now on the run is ``critical`` for ``reason`` (a round that cannot commit),
        whatever the heartbeats say; written at once."""
        self._stuck = reason
        self.poll(force=True)


def no_quorum(
    handles: list[ReplicaHandle], statuses: Callable[[], dict[int, JSONDict]]
) -> JSONDict | None:
    """When a replica stopped because a round can never commit (exit `EXIT_NO_QUORUM`): the
    round, the refusals (rank -> reason, from its status document, read only then) and one
    line saying so."""
    stuck = [h for h in handles if h.status.value == "failed" and h.exit_code == EXIT_NO_QUORUM]
    if not stuck:
        return None
    doc = statuses().get(stuck[0].replica_id, {})
    rnd = doc.get("stopped_round")
    refusals = doc.get("stopped_refusals")
    refused: JSONDict = {
        str(k): str(v) for k, v in (refusals if isinstance(refusals, dict) else {}).items()
    }
    listed = "; ".join(f"rank {k}: {v}" for k, v in sorted(refused.items(), key=lambda kv: kv[0]))
    error = str(doc.get("error") or "")
    what = "is not applied" if error.startswith("UpdateRefusedError") else "cannot commit"
    reason = (
        f"round {rnd} {what} (replica {stuck[0].replica_id}: "
        f"{str(doc.get('error') or failure_reason(stuck[0]))[:300]})"
        + (f"; refused: {listed}" if listed else "")
    )
    return {"round": rnd, "rejected": refused, "reason": reason}


class RefusalLog:
    """Each refusal record of the mode's ``sources`` (`OuterLoopMode.refusal_sources`;
    decoupled: the records under ``decoupled/refused/``, in a signed run only those signed by
    the synchronizer or a learner) becomes one "rejected" event in metrics.jsonl (``event``,
    ``rank``: the learner of a refused push or -1 for any other object, ``object``: its key,
    ``reason``, ``by``: who refused it, ``record``), once per run folder (the events a resumed
    run's earlier launch wrote are not repeated)."""

    def __init__(
        self,
        sources: tuple[RefusalSource, ...],
        sink: MetricsSink,
        metrics_path: Path,
        every_s: float = 5.0,
    ) -> None:
        self.sources = sources
        self.sink, self.every_s = sink, every_s
        self._last = 0.0
        self.seen: set[str] = set()
        if sources and metrics_path.is_file():
            self.seen = {
                str(r["record"])
                for r in read_metrics(metrics_path)
                if r.get("event") == "rejected" and r.get("record")
            }

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        rows: list[JSONDict] = []
        for source in self.sources:
            try:
                records = source.read_rejections(skip=self.seen)
            except (OSError, ValueError):  # the store is unreachable for a moment: retried
                return
            rows += self._rows(records)
        if rows:
            self.sink.write(rows)

    def _rows(self, records: Mapping[str, Refusal]) -> list[JSONDict]:
        rows: list[JSONDict] = []
        for name, r in sorted(records.items()):
            if name in self.seen:
                continue
            self.seen.add(name)
            rows.append(
                {
                    "time": time.time(),
                    "replica": -1,
                    "kind": "event",
                    "step": 0,
                    "round": 0,
                    "event": "rejected",
                    "rank": -1 if r["learner"] is None else int(r["learner"]),
                    "object": r["object"],
                    "reason": r["reason"],
                    "by": r["by"],
                    "record": name,
                }
            )
        return rows


def final_status(mode: OuterLoopMode, handles: list[ReplicaHandle], n_replicas: int) -> str:
    """Every replica has ended: "finished" when all succeeded, or when the ones that failed for
    good leave enough that completed training for the mode to count the run finished (sync:
    at least diloco.min_replicas)."""
    failed = [h for h in handles if h.status.value != "succeeded"]
    if not failed:
        return "finished"
    survivors = len(handles) - len(failed)
    lost_only = all(h.status.value == "failed" for h in failed)
    if lost_only and mode.may_finish_without(survivors, n_replicas):
        return "finished"
    return "failed"
