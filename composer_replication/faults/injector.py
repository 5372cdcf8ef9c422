"""The chaos injector: real faults, on a schedule, into a running run.

    kill               SIGKILL a replica's process group; ``during="upload"`` freezes the replica
                       (SIGSTOP) at random moments until it is caught writing a contribution or
                       push (file://: an open temporary file whose safetensors header says
                       "contribution", which only a push of a few MB leaves open long enough
                       to be caught; S3: a PUT of its key half-way through the throttling proxy,
                       slowed to 1 MB/s while probing), then kills it frozen there, so the
                       upload is cut in the middle
    stop               SIGSTOP for ``duration_s``, then SIGCONT
    slow               SIGSTOP/SIGCONT duty cycle for ``duration_s``: runs 1/``factor`` of the time
    corrupt            flip bytes in the middle of an object: the newest push ("push",
                       "push:<rank>"; the synchronizer is frozen meanwhile and a push it has not
                       yet seen is chosen), the newest merged global fragment ("global": version
                       >= 1, after the first merge), or the newest
                       sync-mode contribution ("contribution", "contribution:<rank>")
    kill_synchronizer  SIGKILL the decoupled run's synchronizer; it is started again after
                       ``restart_after_s`` (and must wait for its lease to expire)
    throttle           limit the bytes per second through the S3 endpoint (`ThrottleProxy`
                       between the replicas and the server); file:// has no connection to throttle
    read_only          the S3 endpoint refuses every write (PUT, POST, DELETE) with 403
                       AccessDenied for ``duration_s``, as a bucket whose write permission was
                       revoked (through the same proxy); reads go through

`ChaosInjector` runs a schedule of `ChaosEventConfig` against `Targets` (pids of replicas, the
synchronizer) and logs what it did; the throttling proxy is `proxy.ThrottleProxy`. What a run
must look like afterwards is checked by `run.chaos.check_decoupled_run`.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import signal
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from composer_replication.exchange.push_store import DecoupledStore
from composer_replication.exchange.store import ObjectStore
from composer_replication.faults.events import PROXY_ACTIONS, ChaosEventConfig
from composer_replication.faults.proxy import ThrottleProxy
from composer_replication.json_types import JSONDict, JSONValue

__all__ = [
    "ChaosInjector",
    "ProcessTargets",
    "Targets",
    "corrupt_object",
    "uploading_file",
]

log = logging.getLogger(__name__)

UPLOAD_PROBE_RATE = 1e6  # bytes/s through the S3 proxy while a kill waits for an upload


class Targets(Protocol):
    """What the harness acts on."""

    def pid(self, rank: int) -> int | None:
        """The process (group leader) of replica ``rank`` now, or None if it is not running."""
        ...

    def kill_synchronizer(self, restart_after_s: float) -> int | None:
        """SIGKILL the synchronizer and start it again after the delay; the killed pid."""
        ...


class _Lifecycle(Protocol):
    @property
    def done(self) -> bool: ...


class ReplicaRef(Protocol):
    """A replica's handle as the harness reads it (`executors.ReplicaHandle` is one)."""

    @property
    def status(self) -> _Lifecycle: ...


class Restartable(Protocol):
    """The driver's synchronizer process as the harness kills it."""

    def kill(self, restart_after_s: float = ...) -> int | None: ...


class ProcessTargets:
    """`Targets` over a `LocalProcessExecutor`'s replicas and the driver's synchronizer.

    ``executor`` is duck-typed: it needs ``pid(handle) -> int`` (`LocalProcessExecutor` has it;
    the run hands over its executor as a `ServerlessExecutor`, whose protocol has no ``pid``).
    """

    def __init__(
        self,
        executor: Any,
        handles: Sequence[ReplicaRef],
        synchronizer: Restartable | None = None,
    ) -> None:
        self.executor = executor
        self.handles = handles  # the driver's live list: a restarted replica replaces its handle
        self.synchronizer = synchronizer

    def pid(self, rank: int) -> int | None:
        handle = self.handles[rank]
        if handle.status.done:
            return None
        try:
            return int(self.executor.pid(handle))
        except (ValueError, KeyError):
            return None

    def kill_synchronizer(self, restart_after_s: float) -> int | None:
        if self.synchronizer is None:
            return None
        pid: int | None = self.synchronizer.kill(restart_after_s)
        return pid


def _signal(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        os.kill(pid, sig)
        return True


# ----------------------------------------------------------------------------- uploads


def uploading_file(pid: int, store_root: str) -> str | None:
    """The temporary file (file:// store) that process ``pid`` is writing a contribution or
    push into, or None. Judged by its content: a safetensors header that names a contribution
    (JSON documents, states and metric chunks do not count)."""
    tmp = os.path.join(store_root, ".tmp") + os.sep
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if not target.startswith(tmp):
            continue
        try:
            with open(target, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    continue
                (n,) = struct.unpack("<Q", head)
                header = f.read(min(n, 1 << 20))
        except OSError:
            continue
        if (
            b'\\"kind\\": \\"contribution\\"' in header
            or b'\\"kind\\":\\"contribution\\"' in header
        ):
            return target
    return None


# ----------------------------------------------------------------------------- corruption


def corrupt_object(store: ObjectStore, key: str, *, seed: int = 0) -> bool:
    """Overwrite ``key`` with a copy whose middle bytes are flipped (False if it is absent)."""
    raw = store.get(key)
    if raw is None:
        return False
    data = bytearray(bytes(raw))
    rng = random.Random(seed)
    lo, hi = len(data) // 3, max(len(data) // 3 + 1, 2 * len(data) // 3)
    for _ in range(8):
        i = rng.randrange(lo, hi)
        data[i] ^= 0xFF
    store.put(key, bytes(data))
    return True


def _newest_contribution(store: ObjectStore, rank: int | None) -> str | None:
    from composer_replication.exchange.protocol import (
        parse_contrib_name,
        parse_step_dir,
        step_prefix,
    )

    steps = sorted(
        (s for s in map(parse_step_dir, store.list("steps/")) if s is not None), reverse=True
    )
    for s in steps:
        prefix = step_prefix(s) + "contrib/"
        names = sorted(  # by rank: the key of the highest rank asked for (its slot's name)
            (r, name)
            for name in store.list(prefix)
            if (r := parse_contrib_name(name)) is not None and (rank is None or r == rank)
        )
        if names:
            return prefix + names[-1][1]
    return None


# ----------------------------------------------------------------------------- the injector


@dataclass
class ChaosInjector:
    """Run ``events`` (times relative to `start`) against ``targets``; `log` records each one.

    ``synchronizer_pid`` (optional) lets "corrupt push" freeze the synchronizer while it picks a
    push the synchronizer has not seen. ``proxy`` is required for "throttle", "read_only" and for
    ``kill during="upload"`` on S3.
    """

    events: Sequence[ChaosEventConfig]
    targets: Targets
    store: ObjectStore
    proxy: ThrottleProxy | None = None
    synchronizer_pid: Callable[[], int | None] | None = None
    upload_wait_s: float = 60.0
    seed: int = 0
    log: list[JSONDict] = field(default_factory=list)

    def __post_init__(self) -> None:
        for ev in self.events:
            if ev.action in PROXY_ACTIONS and self.proxy is None:
                raise ValueError(
                    f"chaos: {ev.action!r} needs the store behind a ThrottleProxy (S3)"
                )
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.t0 = time.monotonic()
        self.started = False

    def start(self) -> ChaosInjector:
        """Schedule every event, ``at_s`` seconds from now."""
        self.t0 = time.monotonic()
        self.started = True
        for i, ev in enumerate(sorted(self.events, key=lambda e: e.at_s)):
            t = threading.Thread(
                target=self._run_event, args=(i, ev), name=f"chaos-{i}", daemon=True
            )
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Cancel what has not happened yet and undo what is in progress (SIGCONT, full speed)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def done(self) -> bool:
        return all(not t.is_alive() for t in self._threads)

    def _record(self, **entry: JSONValue) -> None:
        entry["t"] = round(time.monotonic() - self.t0, 3)
        with self._lock:
            self.log.append(entry)
        log.info("chaos: %s", entry)

    def _run_event(self, i: int, ev: ChaosEventConfig) -> None:
        if self._stop.wait(max(0.0, self.t0 + ev.at_s - time.monotonic())):
            return
        try:
            getattr(self, f"_do_{ev.action}")(i, ev)
        except Exception as exc:  # a harness failure is a finding, not a crash of the run
            self._record(
                event=i,
                action=ev.action,
                target=ev.target,
                outcome="error",
                error=f"{type(exc).__name__}: {exc}",
            )

    def _pid(self, ev: ChaosEventConfig) -> int | None:
        return self.targets.pid(int(ev.target))

    def _heads(self) -> list[int] | None:
        manifest = DecoupledStore(self.store).read_manifest() if self._decoupled() else None
        if manifest is None:
            return None
        return DecoupledStore(self.store).read_heads(len(manifest["fragments"]))

    def _decoupled(self) -> bool:
        return self.store.exists("decoupled/manifest.json")

    # -- actions
    def _do_kill(self, i: int, ev: ChaosEventConfig) -> None:
        pid = self._pid(ev)
        if pid is None:
            self._record(event=i, action="kill", target=ev.target, outcome="not running")
            return
        if ev.during == "upload":
            caught = self._freeze_during_upload(pid, int(ev.target))
            heads = self._heads()
            _signal(pid, signal.SIGKILL)
            _signal(pid, signal.SIGCONT)
            self._record(
                event=i,
                action="kill",
                target=ev.target,
                pid=pid,
                during="upload",
                outcome="killed mid-upload" if caught else "killed (no upload caught)",
                upload=caught,
                heads=heads,
            )
            return
        heads = self._heads()
        _signal(pid, signal.SIGKILL)
        self._record(
            event=i,
            action="kill",
            target=ev.target,
            pid=pid,
            during="any",
            outcome="killed",
            heads=heads,
        )

    def _freeze_during_upload(self, pid: int, rank: int) -> str | None:
        """SIGSTOP ``pid`` at random moments until it is frozen mid-upload (returns what it was
        writing; the process is left stopped) or ``upload_wait_s`` passes (None, stopped)."""
        rng = random.Random(self.seed + pid)
        deadline = time.monotonic() + self.upload_wait_s
        local = self.store.local_path
        patterns = (
            re.compile(rf"/decoupled/push/\d{{3}}-\d{{10}}-{rank:05d}-\d{{4}}\."),
            re.compile(rf"/contrib/{rank:05d}(-[0-9a-f]+)?\.safetensors"),  # per-writer keys
        )
        restore = None
        if local is None and self.proxy is not None:
            # on localhost a PUT's body is sent in a few ms: slow the wire while probing so
            # that the freeze lands inside one (the throttle is restored afterwards)
            restore = self.proxy.rate
            self.proxy.throttle(min(restore or math.inf, UPLOAD_PROBE_RATE))
        try:
            return self._probe(pid, rng, deadline, local, patterns)
        finally:
            if self.proxy is not None and local is None:
                self.proxy.throttle(restore)

    def _probe(
        self,
        pid: int,
        rng: random.Random,
        deadline: float,
        local: Path | None,
        patterns: tuple[re.Pattern[str], ...],
    ) -> str | None:
        while time.monotonic() < deadline and not self._stop.is_set():
            if not _signal(pid, signal.SIGSTOP):
                return None
            time.sleep(0.002)
            found: str | None = None
            if local is not None:
                found = uploading_file(pid, str(local))
            elif self.proxy is not None:
                for req in self.proxy.inflight_puts():
                    if any(p.search(req["path"]) for p in patterns):
                        found = f"{req['path']} ({req['sent']} of {req['length']} bytes sent)"
            if found:
                return found
            _signal(pid, signal.SIGCONT)
            time.sleep(rng.uniform(0.0005, 0.01))
        _signal(pid, signal.SIGSTOP)
        return None

    def _do_stop(self, i: int, ev: ChaosEventConfig) -> None:
        pid = self._pid(ev)
        if pid is None or not _signal(pid, signal.SIGSTOP):
            self._record(event=i, action="stop", target=ev.target, outcome="not running")
            return
        self._record(
            event=i,
            action="stop",
            target=ev.target,
            pid=pid,
            outcome="stopped",
            duration_s=ev.duration_s,
        )
        self._stop.wait(ev.duration_s)
        _signal(pid, signal.SIGCONT)
        self._record(event=i, action="stop", target=ev.target, pid=pid, outcome="continued")

    def _do_slow(self, i: int, ev: ChaosEventConfig) -> None:
        pid = self._pid(ev)
        if pid is None:
            self._record(event=i, action="slow", target=ev.target, outcome="not running")
            return
        run_s = 0.05
        end = time.monotonic() + ev.duration_s
        self._record(
            event=i,
            action="slow",
            target=ev.target,
            pid=pid,
            outcome="slowed",
            factor=ev.factor,
            duration_s=ev.duration_s,
        )
        try:
            while time.monotonic() < end and not self._stop.is_set():
                if not _signal(pid, signal.SIGSTOP):
                    break
                time.sleep(run_s * (ev.factor - 1))
                _signal(pid, signal.SIGCONT)
                time.sleep(run_s)
        finally:
            _signal(pid, signal.SIGCONT)
        self._record(event=i, action="slow", target=ev.target, pid=pid, outcome="full speed")

    def _do_corrupt(self, i: int, ev: ChaosEventConfig) -> None:
        kind, _, who = ev.target.partition(":")
        rank = int(who) if who.isdigit() else None
        key: str | None = None
        if kind == "push":  # corrupted while the synchronizer is frozen
            key = self._fresh_push(rank)
            self._record(
                event=i,
                action="corrupt",
                target=ev.target,
                key=key,
                outcome="corrupted" if key else "no new push",
            )
            return
        if kind == "global":
            key = self._merged_global()
        elif kind == "contribution":
            key = _newest_contribution(self.store, rank)
        else:
            raise ValueError(
                f"corrupt target {ev.target!r}: use push[:rank], global or contribution[:rank]"
            )
        ok = key is not None and corrupt_object(self.store, key, seed=self.seed + i)
        self._record(
            event=i,
            action="corrupt",
            target=ev.target,
            key=key,
            outcome="corrupted" if ok else "nothing to corrupt",
        )

    def _merged_global(self) -> str | None:
        """The newest global of fragment 0 that a merge wrote (version >= 1), waiting up to
        upload_wait_s for the first merge: version 0, the run's starting state, is a fault of
        another kind (while it is the only state there is nothing to fall back on)."""
        from composer_replication.exchange.push_store import global_key

        docs = DecoupledStore(self.store)
        deadline = time.monotonic() + self.upload_wait_s
        while True:
            versions = [v for v in docs.versions(0, "global") if v >= 1]
            if versions:
                return global_key(0, versions[-1])
            if time.monotonic() >= deadline or self._stop.is_set():
                return None
            time.sleep(0.05)

    def _fresh_push(self, rank: int | None) -> str | None:
        """Freeze the synchronizer, wait for a push it cannot have seen, corrupt it, continue
        the synchronizer; the key corrupted (None if no push came within upload_wait_s)."""
        docs = DecoupledStore(self.store)
        sync_pid = self.synchronizer_pid() if self.synchronizer_pid is not None else None
        if sync_pid is not None:
            _signal(sync_pid, signal.SIGSTOP)
        try:
            before = set(docs.list_pushes())
            deadline = time.monotonic() + self.upload_wait_s
            while time.monotonic() < deadline and not self._stop.is_set():
                new = sorted(
                    p for p in set(docs.list_pushes()) - before if rank is None or p.learner == rank
                )
                if new:
                    key = new[-1].key
                    corrupt_object(self.store, key, seed=self.seed)
                    return key
                time.sleep(0.01)
            return None
        finally:
            if sync_pid is not None:
                _signal(sync_pid, signal.SIGCONT)

    def _do_kill_synchronizer(self, i: int, ev: ChaosEventConfig) -> None:
        pid = self.targets.kill_synchronizer(ev.restart_after_s)
        self._record(
            event=i,
            action="kill_synchronizer",
            pid=pid,
            outcome="killed" if pid else "not running",
            restart_after_s=ev.restart_after_s,
        )

    def _do_throttle(self, i: int, ev: ChaosEventConfig) -> None:
        assert self.proxy is not None
        self.proxy.throttle(ev.rate_bytes_s)
        self._record(event=i, action="throttle", outcome="throttled", rate_bytes_s=ev.rate_bytes_s)
        self._stop.wait(ev.duration_s)
        self.proxy.throttle(None)
        self._record(event=i, action="throttle", outcome="full speed")

    def _do_read_only(self, i: int, ev: ChaosEventConfig) -> None:
        assert self.proxy is not None
        self.proxy.read_only(True)
        self._record(event=i, action="read_only", outcome="read-only")
        self._stop.wait(ev.duration_s)
        self.proxy.read_only(False)
        self._record(event=i, action="read_only", outcome="writable", refused=self.proxy.refused)
