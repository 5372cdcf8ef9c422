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
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from composer_replication.executors.executor import (
    ENV_RANK,
    ExecutorBase,
    ReplicaHandle,
    ReplicaStatus,
    Resources,
    check_arg_style,
    read_log_file,
)
from composer_replication.executors.spare import (
    Assignment,
    assignment_line,
    is_module_name,
    runnable_argv,
    spare_command,
    startup_vars,
)

__all__ = ["LocalProcessExecutor", "exit_reason", "spawn_in_group", "terminate_groups"]

log = logging.getLogger(__name__)

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
    stdin: int = subprocess.DEVNULL,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen[bytes]:
    """Start command in a new session/process group, stdout+stderr appended to log_path.

    ``die_with_parent``: the child gets SIGKILL when this process dies (Linux, main thread;
    see the module docstring). ``stdin`` and ``pass_fds`` as for `subprocess.Popen` (a warm
    spare reads its assignment from a pipe and signals readiness on a passed fd)."""
    hook = _parent_death_hook() if die_with_parent else None
    log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115  (the child keeps its own copy)
    try:
        return subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdin=stdin,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
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


@dataclass
class _Spare:
    """One warm spare (executors/spare.py) and the read end of its readiness pipe."""

    proc: subprocess.Popen[bytes]
    ready_fd: int  # -1 once read to its end
    log_path: str
    ready: bool = False

    def usable(self) -> bool | None:
        """True: ready for an assignment; False: still loading; None: gone (or going)."""
        if self.proc.poll() is not None:
            return None
        if self.ready:
            return True
        try:
            data = os.read(self.ready_fd, 64)
        except BlockingIOError:
            return False
        self.close_fd()
        self.ready = data.startswith(b"ready")
        return True if self.ready else None

    def close_fd(self) -> None:
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1


class _WarmSpares:
    """The executor's warm spares: started (from the environment of the first launch a spare can
    run) once replicas are launched, each replaced by a new one when it takes a launch."""

    def __init__(
        self,
        count: int,
        preload: Sequence[str],
        python: str,
        cwd: str | None,
        die_with_parent: bool,
        log_dir: Callable[[], Path],
    ) -> None:
        self.count = count
        self.preload = list(preload)
        self.python = python
        self.cwd = cwd
        self.die_with_parent = die_with_parent
        self.log_dir = log_dir
        self.spares: list[_Spare] = []
        self.env: dict[str, str] | None = None  # what every spare starts with
        self.takeovers = 0
        self.failed: str | None = None  # a spare died before it was ready: no more spares
        self.closed = False
        self.lock = threading.RLock()

    def fill(self, env: dict[str, str]) -> None:
        """Start spares until `count` are alive (the first call fixes their environment)."""
        with self.lock:
            if self.env is None:
                self.env = env
            self._reap()
            while not self.closed and self.failed is None and len(self.spares) < self.count:
                self._spawn(self.env)

    def _spawn(self, env: dict[str, str]) -> None:
        read_fd, write_fd = os.pipe()
        try:
            os.set_blocking(read_fd, False)
            log_path = str(self.log_dir() / f"spare-{uuid.uuid4().hex[:8]}.log")
            command = spare_command(self.python, write_fd, self.preload)
            proc = spawn_in_group(
                command,
                env,
                self.cwd,
                log_path,
                die_with_parent=self.die_with_parent,
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.spares.append(_Spare(proc, read_fd, log_path))

    def _reap(self) -> None:
        """Drop spares that are gone; one that died before it was ready stops the refills (its
        log says why: a preload that does not import, a package the interpreter cannot find)."""
        alive = []
        for spare in self.spares:
            if spare.usable() is not None:
                alive.append(spare)
                continue
            if not spare.ready and self.failed is None:
                code = spare.proc.wait()
                self.failed = (
                    f"warm spare pid {spare.proc.pid} ended ({exit_reason(code)}) before it was "
                    f"ready; see {spare.log_path}"
                )
                log.warning("%s; replicas launch cold from now on", self.failed)
            _discard(spare)
        self.spares = alive

    def pick(self, command: list[str], env: dict[str, str]) -> _Spare | None:
        """A ready spare that can run command with env (removed from the pool), or None."""
        with self.lock:
            if self.env is None or runnable_argv(command, self.python) is None:
                return None
            if startup_vars(env) != startup_vars(self.env):
                return None
            self._reap()
            for spare in self.spares:
                if spare.ready:
                    self.spares.remove(spare)
                    return spare
            return None

    def hand(
        self, spare: _Spare, command: list[str], env: dict[str, str], log_path: str
    ) -> subprocess.Popen[bytes] | None:
        """Give spare the launch (its process then is the replica) and start its replacement;
        None when the spare was gone (the caller launches cold)."""
        argv = runnable_argv(command, self.python)
        assert argv is not None and spare.proc.stdin is not None  # pick() checked both
        line = assignment_line(Assignment(argv, env, self.cwd, os.path.abspath(log_path)))
        try:
            spare.proc.stdin.write(line)
            spare.proc.stdin.close()
        except OSError:  # it died since pick()
            _discard(spare)
            return None
        with self.lock:
            self.takeovers += 1
            if self.env is not None:
                self.fill(self.env)
        return spare.proc

    def pids(self, ready: bool) -> list[int]:
        with self.lock:
            self._reap()
            return [s.proc.pid for s in self.spares if s.ready or not ready]

    def close(self) -> None:
        """End every spare (idempotent; also at interpreter exit); no more are started."""
        with self.lock:
            self.closed = True
            spares, self.spares = self.spares, []
        if spares:
            terminate_groups([s.proc for s in spares], grace=1.0)
        for spare in spares:
            _discard(spare)


def _discard(spare: _Spare) -> None:
    """Close what this side holds of a spare; kill its group if it still runs."""
    spare.close_fd()
    if spare.proc.stdin is not None and not spare.proc.stdin.closed:
        try:
            spare.proc.stdin.close()
        except OSError:
            pass
    if spare.proc.poll() is None:
        terminate_groups([spare.proc], grace=0.0)


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
      warm_spares: keep this many warm spares (executors/spare.py: a Python process started
        ahead, ``preload`` imported, waiting for one assignment) once replicas are launched; a
        restart (or a later launch) of a script or module entrypoint is handed to a ready one,
        which is then the replica (its pid, process group, log, parent-death signal), and a new
        spare replaces it. No spare ready: a cold launch. 0 (the default): none.
      preload: modules each spare imports before it is ready (e.g. ``("torch",)``).
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
        warm_spares: int = 0,
        preload: Sequence[str] = (),
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
        if isinstance(warm_spares, bool) or not isinstance(warm_spares, int) or warm_spares < 0:
            raise ValueError(f"warm_spares must be an integer >= 0, got {warm_spares!r}")
        if isinstance(preload, str) or not all(
            isinstance(m, str) and is_module_name(m) for m in preload
        ):
            raise ValueError(f"preload must be a list of module names, got {preload!r}")
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._replicas: dict[str, _Replica] = {}
        self._lock = threading.Lock()
        # At interpreter exit, end what is still running. Not at garbage collection: a driver
        # that drops the executor object has not asked for its replicas to die. Holds only the
        # dict, not self.
        atexit.register(_kill_all, self._replicas, self.grace_period)
        self._spares: _WarmSpares | None = None
        if warm_spares:
            self._spares = _WarmSpares(
                warm_spares, preload, self.python, self.cwd, die_with_driver, lambda: self.log_dir
            )
            atexit.register(self._spares.close)

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

    @property
    def spare_takeovers(self) -> int:
        """How many launches (restarts included) a warm spare took."""
        return self._spares.takeovers if self._spares else 0

    def spare_pids(self, ready: bool = False) -> list[int]:
        """The pids of the warm spares alive now (``ready``: only those whose preloads are
        done, which the next launch may take)."""
        return self._spares.pids(ready) if self._spares else []

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
        proc = self._spawn(command, full_env, log_path)
        with self._lock:
            self._replicas[job_id] = _Replica(proc, command, full_env, log_path)
        if self._spares is not None and runnable_argv(command, self.python) is not None:
            # what every spare starts with: this launch's environment less its secrets and rank
            self._spares.fill(self._full_env({k: v for k, v in env.items() if k != ENV_RANK}))
        return self._new_handle(rank, job_id, ReplicaStatus.RUNNING, log_path)

    def _spawn(
        self, command: list[str], env: dict[str, str], log_path: str, restart: str = ""
    ) -> subprocess.Popen[bytes]:
        """Start one replica's process: a ready warm spare takes it, else a cold launch.
        ``restart``: the line that announces a restart in the log."""
        spare = self._spares.pick(command, env) if self._spares else None
        if restart:
            taker = f" (warm spare pid {spare.proc.pid})" if spare else ""
            self._log_line(log_path, f"{restart}{taker} ===")
        if spare is not None and self._spares is not None:
            proc = self._spares.hand(spare, command, env, log_path)
            if proc is not None:
                return proc
            self._log_line(log_path, f"warm spare pid {spare.proc.pid} was gone; cold launch ===")
        return spawn_in_group(
            command, env, self.cwd, log_path, die_with_parent=self.die_with_driver
        )

    @staticmethod
    def _log_line(log_path: str, text: str) -> None:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(f"\n=== composer-replication: {text}\n")

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
        restart = (
            f"replica {handle.replica_id} {exit_reason(code)}; "
            f"restart {handle.restarts} of {self.max_restarts}"
        )
        rep.proc = self._spawn(rep.command, rep.env, rep.log_path, restart)
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
        """Stop every replica this executor still runs, and its warm spares (also done at
        interpreter exit)."""
        _kill_all(self._replicas, self.grace_period)
        if self._spares is not None:
            self._spares.close()

    def __enter__(self) -> LocalProcessExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
