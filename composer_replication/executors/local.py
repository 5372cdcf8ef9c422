"""LocalProcessExecutor: N replicas as subprocesses of this machine (the dev loop, and CI).

Each replica is one process started in its own session (so its own process group): signals go
to the whole tree it spawns (data loaders, compile workers, ...), and the terminal's Ctrl-C
reaches only the driver, which then cancels the replicas in order instead of leaving them
half-killed. Stopping a replica is SIGTERM to its group, a grace period, then SIGKILL to the
group. stdout and stderr go to one log file per replica.

Replicas die with their driver (``die_with_driver=True``, the default, Linux): each child asks the
kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)`` through ctypes, set between
fork and exec), so a driver that is SIGKILLed or crashes leaves no replica behind to write into
the run next to the ones a `--resume` starts (the run generation in the store fences any that
escape: exchange/fencing.py). The kernel ties the signal to the *thread* that started the child,
so it is set only for launches from the main thread (a launch from another thread, which may end
before the driver does, gets none). Elsewhere (macOS) the option does nothing.

Limits: a process that calls setsid() itself leaves the group and escapes cleanup; the replica's
own children (data loaders) are not covered by its parent-death signal.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from composer_replication.executors.executor import (
    ExecutorBase,
    ReplicaHandle,
    ReplicaStatus,
    Resources,
    check_arg_style,
    read_log_file,
)

__all__ = ["LocalProcessExecutor", "exit_reason", "spawn_in_group", "terminate_groups"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _parent_death_hook() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGKILL when this thread dies (None: unavailable).

    libc and prctl are looked up here, before the fork: the hook itself only calls prctl and
    getppid (no imports, no allocation-heavy work between fork and exec)."""
    if (
        not sys.platform.startswith("linux")
        or threading.current_thread() is not threading.main_thread()
    ):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)

    return hook


def spawn_in_group(
    command: list[str],
    env: dict[str, str],
    cwd: str | None,
    log_path: str,
    *,
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start command in a new session/process group, stdout+stderr appended to log_path.

    ``die_with_parent``: the child gets SIGKILL when this process dies (Linux, main thread;
    see the module docstring)."""
    hook = _parent_death_hook() if die_with_parent else None
    log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115  (the child keeps its own copy)
    try:
        return subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            preexec_fn=hook,  # noqa: PLW1509  (only prctl + getppid between fork and exec)
        )
    finally:
        log.close()


def _proc_group_alive(pgid: int) -> bool | None:
    """Linux: does any non-zombie process have this pgid? None when /proc is unavailable.

    Zombies must not count: a killed grandchild is re-parented to PID 1, and in containers PID 1
    often never reaps, so signal 0 would report the group alive forever.
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):  # exited while we looked
            continue
        # fields after "(comm)": state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists but is not ours any more (pid reuse): nothing to wait for
        return False
    alive = _proc_group_alive(pgid)
    return True if alive is None else alive


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_groups(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """End every process group led by procs: SIGTERM, wait up to grace s, SIGKILL the rest.

    The leaders are reaped here; the group counts as gone when no live (non-zombie) member is
    left, so this returns as soon as everything has exited.
    """
    pgids = [p.pid for p in procs]  # start_new_session: pgid == pid of the leader
    for pgid in pgids:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + max(grace, 0.0)
    while time.monotonic() < deadline:
        for p in procs:
            p.poll()
        if not any(_group_alive(g) for g in pgids):
            break
        time.sleep(0.02)
    for pgid in pgids:
        _signal_group(pgid, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # unkillable (D state); nothing more we can do
            pass
    # Grandchildren killed by SIGKILL are reaped by init shortly after; wait briefly so callers
    # that check for orphans right after cancel() see them gone.
    deadline = time.monotonic() + 2.0
    while any(_group_alive(g) for g in pgids) and time.monotonic() < deadline:
        time.sleep(0.02)


def exit_reason(code: int) -> str:
    """'exit code 3' / 'killed by signal SIGKILL' for a Popen returncode."""
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class _Replica:
    """Executor-side state of one replica (the handle is what the driver sees)."""

    proc: subprocess.Popen[bytes]
    command: list[str]
    env: dict[str, str]
    log_path: str


def _kill_all(replicas: dict[str, _Replica], grace: float) -> None:
    """At interpreter exit: end whatever is still running (no orphans after the driver)."""
    live = [r.proc for r in replicas.values() if r.proc.poll() is None]
    if live:
        terminate_groups(live, grace)


class LocalProcessExecutor(ExecutorBase):
    """Replicas as local subprocesses, each in its own process group.

    Args:
      log_dir: where replica-{rank}-{launch}.log files go (default: a new temp directory).
      python: interpreter for module/script entrypoints (default: this one, sys.executable).
      cwd: working directory of the replicas (default: the driver's); relative script
        entrypoints are resolved against it.
      max_restarts: restart a replica that exits non-zero up to this many times (same rank,
        same command, handle.restarts counts them); the other replicas keep running.
      grace_period: seconds between SIGTERM and SIGKILL when stopping a replica.
      poll_interval: seconds between polls in collect().
      inherit_env: start from the driver's environment (True) or from an empty one.
      die_with_driver: the replicas get SIGKILL when this process dies, however it dies
        (Linux parent-death signal; see the module docstring).
    """

    backend = "local"

    def __init__(
        self,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        python: str | None = None,
        arg_style: str = "auto",
        cwd: str | os.PathLike[str] | None = None,
        max_restarts: int = 0,
        grace_period: float = 5.0,
        poll_interval: float = 0.2,
        inherit_env: bool = True,
        die_with_driver: bool = True,
    ) -> None:
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
        if grace_period < 0 or poll_interval <= 0:
            raise ValueError(
                f"grace_period must be >= 0 and poll_interval > 0, got {grace_period}, "
                f"{poll_interval}"
            )
        self.python = python or sys.executable
        self.arg_style = check_arg_style(arg_style)
        self.cwd = os.fspath(cwd) if cwd is not None else None
        if self.cwd is not None and not os.path.isdir(self.cwd):
            raise ValueError(f"cwd {self.cwd!r} is not a directory")
        self.max_restarts = max_restarts
        self.grace_period = float(grace_period)
        self.poll_interval = float(poll_interval)
        self.inherit_env = inherit_env
        if not isinstance(die_with_driver, bool):
            raise ValueError(f"die_with_driver must be true or false, got {die_with_driver!r}")
        self.die_with_driver = die_with_driver
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._replicas: dict[str, _Replica] = {}
        self._lock = threading.Lock()
        # At interpreter exit, end what is still running. Not at garbage collection: a driver
        # that drops the executor object has not asked for its replicas to die. Holds only the
        # dict, not self.
        atexit.register(_kill_all, self._replicas, self.grace_period)

    @property
    def log_dir(self) -> Path:
        """The log directory (created on first use)."""
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="composer-replication-logs-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        return self._log_dir

    def check_launch(self, n_replicas: int, entrypoint: str) -> None:
        from composer_replication.executors.executor import validate_launch

        validate_launch(n_replicas, entrypoint, cwd=self.cwd)

    def _check_resources(self, resources: Resources) -> Resources:
        if resources:
            raise ValueError(
                f"LocalProcessExecutor takes no resources (got {sorted(resources)}); replicas "
                "share this machine. Use RayExecutor for num_cpus/num_gpus placement."
            )
        return resources

    def pid(self, handle: ReplicaHandle) -> int:
        """The OS pid (== process group id) of the replica's current process."""
        return self._replica(handle).proc.pid

    def _replica(self, handle: ReplicaHandle) -> _Replica:
        try:
            return self._replicas[handle.job_id]
        except KeyError:
            raise ValueError(
                f"handle {handle.job_id!r} (backend {handle.backend!r}) was not launched by "
                "this LocalProcessExecutor"
            ) from None

    def _full_env(self, env: dict[str, str]) -> dict[str, str]:
        base = dict(os.environ) if self.inherit_env else {}
        # Unbuffered so that logs() and a failure's log tail show the latest lines.
        base.setdefault("PYTHONUNBUFFERED", "1")
        return {**base, **env}

    def _start(
        self,
        rank: int,
        world_size: int,
        command: list[str],
        env: dict[str, str],
        resources: Resources,
        secrets: dict[str, str],
    ) -> ReplicaHandle:
        env = {**env, **secrets}  # the replica's own process environment is private to it
        launch = uuid.uuid4().hex[:8]
        job_id = f"local-{launch}-r{rank}"
        log_path = str(self.log_dir / f"replica-{rank}-{launch}.log")
        full_env = self._full_env(env)
        proc = spawn_in_group(
            command, full_env, self.cwd, log_path, die_with_parent=self.die_with_driver
        )
        with self._lock:
            self._replicas[job_id] = _Replica(proc, command, full_env, log_path)
        return self._new_handle(rank, job_id, ReplicaStatus.RUNNING, log_path)

    def _refresh(self, handle: ReplicaHandle) -> None:
        rep = self._replica(handle)
        code = rep.proc.poll()
        if code is None:
            handle.status = ReplicaStatus.RUNNING
            return
        if _group_alive(rep.proc.pid):
            # The leader is gone; anything it left in its group would be an orphan.
            terminate_groups([rep.proc], grace=0.0)
        if code != 0 and handle.restarts < self.max_restarts:
            self._restart(handle, rep, code)
            return
        handle.exit_code = code
        handle.end_time = time.time()
        if code == 0:
            handle.status = ReplicaStatus.SUCCEEDED
        else:
            self._fail(handle, exit_reason(code))

    def _restart(self, handle: ReplicaHandle, rep: _Replica, code: int) -> None:
        handle.restarts += 1
        with open(rep.log_path, "a", encoding="utf-8") as log:
            log.write(
                f"\n=== composer-replication: replica {handle.replica_id} {exit_reason(code)}; "
                f"restart {handle.restarts} of {self.max_restarts} ===\n"
            )
        rep.proc = spawn_in_group(
            rep.command, rep.env, self.cwd, rep.log_path, die_with_parent=self.die_with_driver
        )
        handle.status = ReplicaStatus.RUNNING

    def _terminate(self, handle: ReplicaHandle) -> None:
        self._terminate_all([handle])

    def _terminate_all(self, handles: list[ReplicaHandle]) -> None:
        # Signal every group first and wait once: cancelling N replicas costs one grace period.
        reps = [self._replica(h) for h in handles]
        terminate_groups([r.proc for r in reps], self.grace_period)
        for handle, rep in zip(handles, reps):
            if handle.exit_code is None:
                handle.exit_code = rep.proc.returncode

    def logs(self, handle: ReplicaHandle, tail: int | None = None) -> str:
        return read_log_file(self._replica(handle).log_path, tail)

    def shutdown(self) -> None:
        """Stop every replica this executor still runs (also done at interpreter exit)."""
        _kill_all(self._replicas, self.grace_period)

    def __enter__(self) -> LocalProcessExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
