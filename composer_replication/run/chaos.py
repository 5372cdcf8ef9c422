"""The chaos harness: inject real faults into a running run, then check that nothing was lost.

Usable from tests, benchmarks and `composer-replication train` (``[chaos]`` on the local
backend). Faults are real signals and real bytes, never simulated inside the replicas:

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
                       yet seen is chosen), the newest global fragment ("global"), or the newest
                       sync-mode contribution ("contribution", "contribution:<rank>")
    kill_synchronizer  SIGKILL the decoupled run's synchronizer; it is started again after
                       ``restart_after_s`` (and must wait for its lease to expire)
    throttle           limit the bytes per second through the S3 endpoint (`ThrottleProxy`
                       between the replicas and the server); file:// has no connection to throttle

`ChaosInjector` runs a schedule against `Targets` (pids of replicas, the synchronizer) and logs
what it did. `check_decoupled_run` checks the store afterwards: the run finished; no committed
merge was lost (every version a learner loaded is the stored one, the version chain has no
gaps) or applied twice (no push in two merge records); every push written was consumed by a
merge record or refused (a refusal record); killed learners started again, from the newest
global; every live learner holds the same final global fragments
(tests/run/test_chaos_checker.py plants each violation and shows it caught).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from composer_replication.config.schema import ChaosEventConfig
from composer_replication.exchange.push_store import DecoupledStore
from composer_replication.exchange.store import ObjectStore

__all__ = [
    "ChaosInjector",
    "LocalRunResult",
    "ProcessTargets",
    "Targets",
    "ThrottleProxy",
    "check_decoupled_run",
    "corrupt_object",
    "run_local",
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


class ProcessTargets:
    """`Targets` over a `LocalProcessExecutor`'s replicas and the driver's synchronizer."""

    def __init__(self, executor: Any, handles: Sequence[Any], synchronizer: Any = None) -> None:
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


# ----------------------------------------------------------------------------- the proxy


class ThrottleProxy:
    """A TCP proxy on 127.0.0.1 in front of an S3 endpoint: limits bytes per second (both
    directions, shared) while throttled, and tracks the PUT requests in flight (method, path,
    body bytes sent and expected), so the harness can kill a client half-way through one.

    Point the replicas' ``endpoint_url`` at `endpoint`.
    """

    def __init__(self, upstream: str) -> None:
        m = re.match(r"^https?://([^:/]+):(\d+)", upstream)
        if m is None:
            raise ValueError(f"ThrottleProxy needs an http://host:port endpoint, got {upstream!r}")
        self.upstream = (m.group(1), int(m.group(2)))
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(128)
        self.port = self._server.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.rate: float | None = None  # bytes per second while throttled
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._last = time.monotonic()
        self._inflight: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="chaos-proxy", daemon=True)
        self._thread.start()

    def throttle(self, rate_bytes_s: float | None) -> None:
        """Limit to ``rate_bytes_s`` (None: full speed)."""
        with self._lock:
            self.rate = rate_bytes_s
            self._tokens = 0.0
            self._last = time.monotonic()

    def inflight_puts(self) -> list[dict[str, Any]]:
        """PUT requests whose body has started but not finished: {path, sent, length}."""
        with self._lock:
            return [dict(r) for r in self._inflight.values()
                    if r["method"] == "PUT" and 0 < r["sent"] < r["length"]]  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        try:
            self._server.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.close()
            except OSError:
                pass

    def _take(self, n: int) -> None:
        """Block until ``n`` bytes may pass (token bucket at the current rate)."""
        while True:
            with self._lock:
                rate = self.rate
                if rate is None:
                    return
                now = time.monotonic()
                self._tokens = min(rate * 0.05, self._tokens + (now - self._last) * rate)
                self._last = now
                if self._tokens >= n or self._tokens >= rate * 0.05:
                    self._tokens -= n
                    return
                wait = (min(n, rate * 0.05) - self._tokens) / rate
            time.sleep(max(wait, 0.001))

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            cid = id(client)
            threading.Thread(target=self._pump, args=(client, upstream, cid, True),
                             daemon=True).start()  # fmt: skip
            threading.Thread(target=self._pump, args=(upstream, client, cid, False),
                             daemon=True).start()  # fmt: skip

    def _pump(self, src: socket.socket, dst: socket.socket, cid: int, requests: bool) -> None:
        buf = b""
        try:
            while True:
                data = src.recv(16384)
                if not data:
                    break
                if requests:
                    buf = self._track(cid, buf + data)
                for i in range(0, len(data), 4096):
                    chunk = data[i : i + 4096]
                    self._take(len(chunk))
                    dst.sendall(chunk)
        except OSError:
            pass
        finally:
            with self._lock:
                self._inflight.pop(cid, None)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _track(self, cid: int, buf: bytes) -> bytes:
        """Follow HTTP/1.1 requests on a client connection (headers, then Content-Length body
        bytes); returns the unparsed remainder."""
        while buf:
            with self._lock:
                req = self._inflight.get(cid)
            if req is not None and req["sent"] < req["length"]:
                take = min(len(buf), req["length"] - req["sent"])
                with self._lock:
                    req["sent"] += take
                buf = buf[take:]
                if req["sent"] >= req["length"]:
                    with self._lock:
                        self._inflight.pop(cid, None)
                continue
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return buf[-65536:]
            head = buf[:end].decode("latin-1", "replace").split("\r\n")
            method, _, rest = head[0].partition(" ")
            path = rest.rpartition(" ")[0]
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length" and value.strip().isdigit():
                    length = int(value.strip())
            with self._lock:
                self._inflight[cid] = {"method": method, "path": path, "sent": 0, "length": length}
                if length == 0:
                    self._inflight.pop(cid, None)
            buf = buf[end + 4 :]
        return b""


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
        contrib_key,
        parse_contrib_name,
        parse_step_dir,
        step_prefix,
    )

    steps = sorted((s for s in map(parse_step_dir, store.list("steps/")) if s is not None),
                   reverse=True)  # fmt: skip
    for s in steps:
        ranks = [r for r in map(parse_contrib_name, store.list(step_prefix(s) + "contrib/"))
                 if r is not None and (rank is None or r == rank)]  # fmt: skip
        if ranks:
            return contrib_key(s, ranks[-1])
    return None


# ----------------------------------------------------------------------------- the injector


@dataclass
class ChaosInjector:
    """Run ``events`` (times relative to `start`) against ``targets``; `log` records each one.

    ``synchronizer_pid`` (optional) lets "corrupt push" freeze the synchronizer while it picks a
    push the synchronizer has not seen. ``proxy`` is required for "throttle" and for
    ``kill during="upload"`` on S3.
    """

    events: Sequence[ChaosEventConfig]
    targets: Targets
    store: ObjectStore
    proxy: ThrottleProxy | None = None
    synchronizer_pid: Callable[[], int | None] | None = None
    upload_wait_s: float = 60.0
    seed: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for ev in self.events:
            if ev.action == "throttle" and self.proxy is None:
                raise ValueError("chaos: 'throttle' needs the store behind a ThrottleProxy (S3)")
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
            t = threading.Thread(target=self._run_event, args=(i, ev), name=f"chaos-{i}",
                                 daemon=True)  # fmt: skip
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

    def _record(self, **entry: Any) -> None:
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
            self._record(event=i, action=ev.action, target=ev.target, outcome="error",
                         error=f"{type(exc).__name__}: {exc}")  # fmt: skip

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
            self._record(event=i, action="kill", target=ev.target, pid=pid, during="upload",
                         outcome="killed mid-upload" if caught else "killed (no upload caught)",
                         upload=caught, heads=heads)  # fmt: skip
            return
        heads = self._heads()
        _signal(pid, signal.SIGKILL)
        self._record(event=i, action="kill", target=ev.target, pid=pid, during="any",
                     outcome="killed", heads=heads)  # fmt: skip

    def _freeze_during_upload(self, pid: int, rank: int) -> str | None:
        """SIGSTOP ``pid`` at random moments until it is frozen mid-upload (returns what it was
        writing; the process is left stopped) or ``upload_wait_s`` passes (None, stopped)."""
        rng = random.Random(self.seed + pid)
        deadline = time.monotonic() + self.upload_wait_s
        local = self.store.local_path
        patterns = (re.compile(rf"/decoupled/push/\d{{3}}-\d{{10}}-{rank:05d}-\d{{4}}\."),
                    re.compile(rf"/contrib/{rank:05d}\.safetensors"))  # fmt: skip
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

    def _probe(self, pid: int, rng: random.Random, deadline: float, local: Any,
               patterns: tuple[re.Pattern[str], ...]) -> str | None:  # fmt: skip
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
        self._record(event=i, action="stop", target=ev.target, pid=pid, outcome="stopped",
                     duration_s=ev.duration_s)  # fmt: skip
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
        self._record(event=i, action="slow", target=ev.target, pid=pid, outcome="slowed",
                     factor=ev.factor, duration_s=ev.duration_s)  # fmt: skip
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
            self._record(event=i, action="corrupt", target=ev.target, key=key,
                         outcome="corrupted" if key else "no new push")  # fmt: skip
            return
        if kind == "global":
            versions = DecoupledStore(self.store).versions(0, "global")
            if versions:
                from composer_replication.exchange.push_store import global_key

                key = global_key(0, versions[-1])
        elif kind == "contribution":
            key = _newest_contribution(self.store, rank)
        else:
            raise ValueError(f"corrupt target {ev.target!r}: use push[:rank], global or "
                             "contribution[:rank]")  # fmt: skip
        ok = key is not None and corrupt_object(self.store, key, seed=self.seed + i)
        self._record(event=i, action="corrupt", target=ev.target, key=key,
                     outcome="corrupted" if ok else "nothing to corrupt")  # fmt: skip

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
                new = sorted(p for p in set(docs.list_pushes()) - before
                             if rank is None or p.learner == rank)  # fmt: skip
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
        self._record(event=i, action="kill_synchronizer", pid=pid,
                     outcome="killed" if pid else "not running",
                     restart_after_s=ev.restart_after_s)  # fmt: skip

    def _do_throttle(self, i: int, ev: ChaosEventConfig) -> None:
        assert self.proxy is not None
        self.proxy.throttle(ev.rate_bytes_s)
        self._record(event=i, action="throttle", outcome="throttled", rate_bytes_s=ev.rate_bytes_s)
        self._stop.wait(ev.duration_s)
        self.proxy.throttle(None)
        self._record(event=i, action="throttle", outcome="full speed")


# ----------------------------------------------------------------------------- a whole run


@dataclass
class LocalRunResult:
    """What `run_local` saw: the injector's log, restarts, exit codes, the run's duration."""

    log: list[dict[str, Any]]
    restarts: list[int]
    exit_codes: list[int | None]
    synchronizer_restarts: int
    synchronizer_exit: int | None
    seconds: float
    logs: str


def run_local(
    *,
    n: int,
    entrypoint: str,
    args: Sequence[Any],
    env: dict[str, str],
    store: ObjectStore,
    events: Sequence[ChaosEventConfig] = (),
    log_dir: str | os.PathLike[str],
    synchronizer: bool = False,
    ready: Callable[[], bool] | None = None,
    on_ready: Callable[[], None] | None = None,
    proxy: ThrottleProxy | None = None,
    max_restarts: int = 5,
    timeout_s: float = 900.0,
    upload_wait_s: float = 60.0,
    seed: int = 0,
) -> LocalRunResult:
    """Launch ``n`` replica processes (`LocalProcessExecutor`, restarted when they die) and, with
    ``synchronizer``, the run's synchronizer (`SynchronizerProcess` on ``store``, configured by
    the run_config.json the caller put there); once ``ready()`` holds, call ``on_ready`` and
    start the chaos schedule; supervise until every replica ended; stop the synchronizer.
    ``env`` reaches every process (put the storage options in $COMPOSER_STORAGE_OPTIONS)."""
    from pathlib import Path

    from composer_replication.executors.local import LocalProcessExecutor
    from composer_replication.run.synchronizer import SynchronizerProcess

    log_path = Path(log_dir)
    sync = (
        SynchronizerProcess(store.uri, env, log_path / "synchronizer.log") if synchronizer else None
    )
    executor = LocalProcessExecutor(log_dir=log_path, max_restarts=max_restarts, grace_period=2)
    t0 = time.monotonic()
    if sync is not None:
        sync.start()
    handles = executor.launch_replicas(n, entrypoint, list(args), env=env)
    injector = ChaosInjector(events, ProcessTargets(executor, handles, sync), store, proxy=proxy,
                             synchronizer_pid=(lambda: sync.pid) if sync else None,
                             upload_wait_s=upload_wait_s, seed=seed)  # fmt: skip
    sync_exit: int | None = None
    try:
        deadline = t0 + timeout_s
        while not all(h.status.done for h in handles) and time.monotonic() < deadline:
            executor.poll(handles)
            if sync is not None:
                sync.ensure_running()
            if not injector.started and (ready is None or ready()):
                if on_ready is not None:
                    on_ready()
                injector.start()
            time.sleep(0.05)
        injector.stop()
        if sync is not None:  # it finishes by itself once every learner is done
            end = time.monotonic() + 60
            while sync.pid is not None and time.monotonic() < end:
                sync.ensure_running()
                time.sleep(0.1)
            sync_exit = sync.stop()
    finally:
        injector.stop()
        executor.cancel([h for h in handles if not h.status.done])
        if sync is not None:
            sync.stop(grace_s=2)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                     for p in sorted(log_path.glob("*.log")))  # fmt: skip
    return LocalRunResult(
        log=list(injector.log), restarts=[h.restarts for h in handles],
        exit_codes=[h.exit_code for h in handles],
        synchronizer_restarts=sync.restarts if sync else 0, synchronizer_exit=sync_exit,
        seconds=time.monotonic() - t0, logs=logs,
    )  # fmt: skip


# ----------------------------------------------------------------------------- checks


def check_decoupled_run(
    store: ObjectStore,
    reports: dict[int, dict[str, Any]] | None = None,
    kills: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The after-run assertions over the store (and the learners' reports, if any).

    ``reports[rank]``: ``{"final_versions": [...], "digest": str, "starts": [[versions], ...],
    "loaded": {"<fragment>/<version>": digest}, "written": [push names]}`` (what each live
    learner held at the end, the versions it started from at each (re)start, the digests of
    the globals it loaded, the pushes it wrote). ``kills``: the injector's kill entries (with
    ``heads`` at the kill), in order.

    Invariants (each a problem when broken):

    * no merge is lost: each fragment's merge records run 1, 2, ... up to its final version,
      and the final version's state reads back;
    * every push written (in the store now, or in a report's ``written``) was consumed by a
      merge record (merged, rejected by screening, superseded or dropped) or refused (a
      refusal record): none was silently ignored;
    * no push is merged by two records;
    * a learner applied exactly the stored weights of every version it loaded;
    * a killed learner came back (a later start in its report) from at least the versions
      announced when it was killed;
    * every learner ends on the same final versions and weights.

    Returns {"ok": bool, "problems": [...], "finished", "versions", "merges",
    "rounds_lost", "pushes_unaccounted", "applied_twice", "rejoined", "same_final",
    "damaged_snapshots"} (stored snapshots of superseded versions that no longer read back:
    reported, not a failure).
    """
    from composer_replication.exchange.protocol import tensors_digest

    docs = DecoupledStore(store)
    problems: list[str] = []
    manifest = docs.read_manifest()
    if manifest is None:
        return {"ok": False, "problems": ["no decoupled manifest: the run never started"]}
    n_frag = len(manifest["fragments"])
    final = docs.read_final(n_frag)
    if final is None:
        problems.append("no final.json: the run did not finish")
    versions = final["versions"] if final else docs.read_heads(n_frag) or [0] * n_frag
    lost: list[str] = []
    consumed: dict[str, int] = {}
    twice: list[str] = []  # merged (included) by two records: a merge applied twice
    reconsumed: list[str] = []  # consumed again without being merged again (bookkeeping)
    merged: set[str] = set()
    merges = 0
    stored_digest: dict[str, str] = {}
    damaged: list[str] = []
    unreadable: set[tuple[int, int]] = set()
    for p in range(n_frag):
        records = docs.versions(p, "merge")
        merges += len(records)
        # every version 1..final is in the final model, each made by its record (kept for good)
        missing = sorted(set(range(1, versions[p] + 1)) - set(records))
        if missing:
            lost.append(f"fragment {p}: merge records {missing} missing; versions 1-"
                        f"{versions[p]} make the final model")  # fmt: skip
        beyond = [v for v in records if v > versions[p]]
        if beyond:
            lost.append(f"fragment {p}: merge records {beyond} beyond the final version "
                        f"{versions[p]}")  # fmt: skip
        for v in records:
            try:
                rec = docs.read_merge(p, v)
            except Exception as exc:  # noqa: BLE001 - reported as a problem
                problems.append(f"fragment {p} record {v} unreadable: {exc}")
                continue
            if rec is None:
                continue
            merged_here = {e["push"] for e in rec["inputs"]
                           if (rec["decisions"].get(e["push"]) or {}).get("included")}  # fmt: skip
            for name in rec["consumed"]:
                if name in consumed:
                    both = name in merged_here and name in merged
                    (twice if both else reconsumed).append(
                        f"{name} in records {consumed[name]} and {v} of fragment {p}"
                    )
                consumed[name] = v
            merged |= merged_here
        for v in docs.versions(p, "global"):
            try:
                tensors = docs.fetch_global(p, v, None)
            except Exception as exc:  # noqa: BLE001 - a snapshot damaged after it was written
                damaged.append(f"fragment {p} version {v}: {exc}")
                unreadable.add((p, v))
                continue
            if tensors is not None:
                stored_digest[f"{p}/{v}"] = tensors_digest(tensors)
        # A superseded version's snapshot may be damaged (its merge lives on in every later
        # version); the final one must be readable, or learners could not hold it.
        if records and f"{p}/{versions[p]}" not in stored_digest and versions[p] in records:
            lost.append(f"fragment {p}: the final version {versions[p]} has no readable state")
    reports = reports or {}
    written = {pid.name for pid in docs.list_pushes()}
    for rep in reports.values():
        written |= set(rep.get("written") or [])
    refused = docs.read_refusals()
    unaccounted = sorted(written - set(consumed) - set(refused))
    lost_pushes = [f"push {name} was written but never consumed by a merge or refused"
                   for name in unaccounted]  # fmt: skip
    for rank, rep in sorted(reports.items()):
        for key, digest in (rep.get("loaded") or {}).items():
            if key in stored_digest and stored_digest[key] != digest:
                lost.append(f"learner {rank} applied fragment/version {key} with different "
                            "weights than the stored chain")  # fmt: skip

    def newest_enough(start: list[int], heads: list[int]) -> bool:
        # every fragment at least at the version announced when the learner was killed, or
        # only damaged snapshots (unreadable, so correctly skipped) in between
        return all(a >= b or all((p, v) in unreadable for v in range(a + 1, b + 1))
                   for p, (a, b) in enumerate(zip(start, heads)))  # fmt: skip

    rejoined: list[str] = []
    for kill in kills:
        rank = int(kill.get("target", -1))
        heads = kill.get("heads")
        starts = (reports.get(rank) or {}).get("starts") or []
        later = starts[1:]  # the starts after the first are restarts
        if (
            rank in reports
            and str(kill.get("outcome", "killed")).startswith("killed")
            and not later
        ):
            rejoined.append(f"learner {rank} was killed and never started again")
        elif heads and later and not any(newest_enough(s, heads) for s in later):
            rejoined.append(f"learner {rank} restarted from {later} older than {heads}")
    finals = {r: tuple(rep.get("final_versions") or []) for r, rep in reports.items()
              if rep.get("final_versions") is not None}  # fmt: skip
    digests = {r: rep.get("digest") for r, rep in reports.items() if rep.get("digest")}
    same = (len(set(finals.values())) <= 1 and len(set(digests.values())) <= 1
            and all(list(f) == list(versions) for f in finals.values()))  # fmt: skip
    if not same:
        problems.append(f"learners end on different globals: {finals} {digests}")
    problems += lost + lost_pushes + [f"applied twice: {t}" for t in twice] + rejoined
    problems += [f"consumed twice (not merged twice): {t}" for t in reconsumed]
    return {
        "ok": not problems,
        "problems": problems,
        "finished": final is not None,
        "versions": list(versions),
        "merges": merges,
        "rounds_lost": len(lost),
        "pushes_unaccounted": len(unaccounted),
        "applied_twice": len(twice),
        "rejoined": not rejoined,
        "same_final": same,
        "damaged_snapshots": damaged,
    }


def read_json_lines(path: str) -> list[dict[str, Any]]:
    """Records of a JSONL file ([] if absent; a torn last line is skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out
