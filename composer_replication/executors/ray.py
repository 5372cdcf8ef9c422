"""RayExecutor: each replica a Ray actor that runs the replica command in a subprocess.

Running the same command line as LocalProcessExecutor (rather than calling a Python function in
the actor) keeps script and module entrypoints identical across backends, keeps a crashing
replica from taking the Ray worker down, and lets cancel end the replica's whole process tree:
the actor starts the command in its own process group and, when asked, signals that group
(SIGTERM, grace, SIGKILL) before the actor itself is killed. Killing only the actor
(`ray.kill`) would leave the subprocess running as an orphan on the node.

Placement uses Ray's resources: num_cpus / num_gpus / memory / custom resources /
accelerator_type per replica (Ray sets CUDA_VISIBLE_DEVICES in the actor; the subprocess
inherits it).
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.executors.executor import (
    ExecutorBase,
    ReplicaHandle,
    ReplicaStatus,
    Resources,
    check_arg_style,
    read_log_file,
    validate_launch,
)
from composer_replication.executors.local import (
    exit_reason,
    spawn_in_group,
    terminate_groups,
)
from composer_replication.executors.redact import import_sdk

__all__ = ["RayExecutor", "ReplicaRunner"]

_RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")

if TYPE_CHECKING:
    import subprocess

    from ray import ObjectRef
    from ray.actor import ActorHandle


def _import_ray() -> Any:
    return import_sdk("ray", "ray")


class ReplicaRunner:
    """Actor body (wrapped with ray.remote at launch): runs one replica command.

    `run` blocks until the subprocess exits and returns its exit code; `started`, `terminate`
    and `read_log` are answered concurrently (the actor is created with max_concurrency > 1).
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: str | None = None
        self._cancelled = False
        self._lock = threading.Lock()
        self._started = threading.Event()

    def run(
        self,
        command: list[str],
        env: dict[str, str],
        cwd: str | None,
        log_path: str | None,
        use_worker_python: bool,
    ) -> int:
        if use_worker_python:
            command = [sys.executable, *command[1:]]
        if log_path is None:
            log_path = tempfile.mkstemp(prefix="composer-replication-", suffix=".log")[1]
        else:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        with self._lock:
            self._log_path = log_path
            if self._cancelled:  # cancel() won the race: never start
                self._started.set()
                return -15
            try:
                self._proc = spawn_in_group(command, full_env, cwd, log_path)
            finally:
                self._started.set()
        return self._proc.wait()

    def started(self) -> int | None:
        """Block until run() has started the subprocess (or given up); return its pid."""
        self._started.wait()
        return None if self._proc is None else self._proc.pid

    def terminate(self, grace: float) -> None:
        with self._lock:
            self._cancelled = True
            proc = self._proc
        if proc is not None:
            terminate_groups([proc], grace)

    def read_log(self, tail: int | None) -> str:
        if self._log_path is None:
            return ""
        return read_log_file(self._log_path, tail)


def _shutdown_at_exit(ref: weakref.ref[RayExecutor]) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()


@dataclass
class _Replica:
    actor: ActorHandle[ReplicaRunner]
    run_ref: ObjectRef[int]  # `ReplicaRunner.run`: the exit code
    started_ref: ObjectRef[int | None]  # `ReplicaRunner.started`: the pid
    log_path: str  # driver-side copy (or the file itself when Ray is local)
    same_fs: bool
    released: bool = False


class RayExecutor(ExecutorBase):
    """Replicas as Ray actors (one subprocess each). See docs/backends.md.

    Args:
      address: None starts a private local Ray (ray.init(num_cpus=init_num_cpus,
        include_dashboard=False)); "auto" / "ray://host:10001" / "host:6379" joins a cluster.
        When Ray is already initialised in this process it is used as is.
      num_cpus, num_gpus: per-replica defaults (a launch's resources= overrides them).
      init_num_cpus: logical CPUs of a local Ray (default: Ray's choice, the machine's cores).
      runtime_env: Ray runtime_env for the actors (pip packages, working_dir, env_vars).
      log_dir: driver-side log directory (default: a new temp dir).
      cwd: the replicas' working directory (default: the driver's with a local Ray, the Ray
        worker's on a cluster).
      python: interpreter for the replica command (default: the Ray worker's sys.executable).
      grace_period: seconds between SIGTERM and SIGKILL on cancel/timeout.
      poll_interval: seconds between polls in collect().
      ray_init_kwargs: extra keyword arguments for ray.init.
      shared_filesystem: whether the replicas see the driver's filesystem (default: True exactly
        when address is None). If so, they write their logs straight into log_dir and script
        entrypoints are checked here; if not, logs stay on the node (read through the actor
        while running, copied to log_dir when the replica ends) and nothing is checked locally.
    """

    backend = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        init_num_cpus: int | None = None,
        runtime_env: dict[str, Any] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        python: str | None = None,
        arg_style: str = "auto",
        grace_period: float = 5.0,
        poll_interval: float = 0.2,
        ray_init_kwargs: dict[str, object] | None = None,
        shared_filesystem: bool | None = None,
    ) -> None:
        self._ray = _import_ray()
        self.address = address
        self.defaults = self._check_resources({"num_cpus": num_cpus, "num_gpus": num_gpus})
        if grace_period < 0 or poll_interval <= 0:
            raise ValueError(
                f"grace_period must be >= 0 and poll_interval > 0, got {grace_period}, "
                f"{poll_interval}"
            )
        self.init_num_cpus = init_num_cpus
        self.runtime_env = runtime_env
        self.same_fs = address is None if shared_filesystem is None else bool(shared_filesystem)
        self._cwd = os.fspath(cwd) if cwd is not None else None
        self._use_worker_python = python is None
        self.python = python or "python"
        self.arg_style = check_arg_style(arg_style)
        self.grace_period = float(grace_period)
        self.poll_interval = float(poll_interval)
        self.ray_init_kwargs = dict(ray_init_kwargs or {})
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._replicas: dict[str, _Replica] = {}
        self._started_ray = False
        self._runner_cls: Any = None
        self._atexit_registered = False

    # -- setup
    @property
    def cwd(self) -> str | None:
        """The replicas' working directory: as given, else the driver's current one when Ray is
        local (same filesystem), else None (the Ray worker's)."""
        if self._cwd is not None:
            return self._cwd
        return os.getcwd() if self.same_fs else None

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="composer-replication-ray-logs-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        return self._log_dir

    def _ensure_ray(self) -> None:
        ray = self._ray
        if not ray.is_initialized():
            kwargs: dict[str, object] = {"include_dashboard": False, "log_to_driver": False}
            if self.address is None and self.init_num_cpus is not None:
                kwargs["num_cpus"] = self.init_num_cpus
            kwargs.update(self.ray_init_kwargs)
            ray.init(address=self.address, **kwargs)
            self._started_ray = True
        if not self._atexit_registered:
            # Registered after ray.init, so it runs before Ray's own exit hook (atexit is LIFO):
            # replica subprocesses must be ended while their actors can still be reached.
            atexit.register(_shutdown_at_exit, weakref.ref(self))
            self._atexit_registered = True
        if self._runner_cls is None:
            self._runner_cls = ray.remote(ReplicaRunner)

    def check_launch(self, n_replicas: int, entrypoint: str) -> None:
        # On a cluster the script/module must exist on the nodes, not necessarily here.
        validate_launch(n_replicas, entrypoint, cwd=self.cwd, check_local=self.same_fs)

    def _check_resources(self, resources: Resources) -> Resources:
        unknown = sorted(set(resources) - set(_RESOURCE_KEYS))
        if unknown:
            raise ValueError(
                f"unknown Ray resources {unknown}; use {list(_RESOURCE_KEYS)} (custom resources "
                "go in resources={'resources': {'name': amount}})"
            )
        for key in ("num_cpus", "num_gpus", "memory"):
            value = resources.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or value < 0
            ):
                raise ValueError(f"Ray resource {key} must be a number >= 0, got {value!r}")
        custom = resources.get("resources")
        if custom is not None and not isinstance(custom, dict):
            raise ValueError(f"Ray resources['resources'] must be a dict, got {custom!r}")
        return resources

    # -- ExecutorBase
    def _start(
        self,
        rank: int,
        world_size: int,
        command: list[str],
        env: dict[str, str],
        resources: Resources,
        secrets: dict[str, str],
    ) -> ReplicaHandle:
        """The rank's own secrets go into its actor's ``runtime_env`` env_vars (the replica
        process inherits the actor's environment), not into the task arguments."""
        self._ensure_ray()
        options: Resources = {**self.defaults, **resources, "max_concurrency": 4}
        if self.runtime_env is not None:
            options["runtime_env"] = self.runtime_env
        if secrets:
            runtime_env = dict(self.runtime_env or {})
            runtime_env["env_vars"] = {**dict(runtime_env.get("env_vars") or {}), **secrets}
            options["runtime_env"] = runtime_env
        launch = uuid.uuid4().hex[:8]
        # The actor's name is the job id, so `ray list actors` shows which replica is which.
        job_id = f"composer-replication-{launch}-r{rank}"
        actor = self._runner_cls.options(name=job_id, **options).remote()
        log_path = str(self.log_dir / f"replica-{rank}-{launch}.log")
        worker_log = log_path if self.same_fs else None
        run_ref = actor.run.remote(command, env, self.cwd, worker_log, self._use_worker_python)
        self._replicas[job_id] = _Replica(
            actor, run_ref, actor.started.remote(), log_path, self.same_fs
        )
        return self._new_handle(rank, job_id, ReplicaStatus.PENDING, log_path)

    def _replica(self, handle: ReplicaHandle) -> _Replica:
        try:
            return self._replicas[handle.job_id]
        except KeyError:
            raise ValueError(
                f"handle {handle.job_id!r} (backend {handle.backend!r}) was not launched by "
                "this RayExecutor"
            ) from None

    def _refresh(self, handle: ReplicaHandle) -> None:
        ray = self._ray
        rep = self._replica(handle)
        done, _ = ray.wait([rep.run_ref], timeout=0)
        if not done:
            started, _ = ray.wait([rep.started_ref], timeout=0)
            if started:
                handle.status = ReplicaStatus.RUNNING
            return
        code: int | None = None
        try:
            code = int(ray.get(rep.run_ref))
            reason = exit_reason(code)
        except Exception as exc:  # actor died (node lost, OOM) or could not start the command
            code, reason = None, f"ray replica error: {type(exc).__name__}: {exc}"
        self._release(rep)
        handle.exit_code = code
        handle.end_time = time.time()
        if code == 0:
            handle.status = ReplicaStatus.SUCCEEDED
        else:
            self._fail(handle, reason)

    def _terminate(self, handle: ReplicaHandle) -> None:
        self._terminate_all([handle])

    def _terminate_all(self, handles: list[ReplicaHandle]) -> None:
        reps = [self._replica(h) for h in handles]
        self._stop(reps)
        ray = self._ray
        for handle, rep in zip(handles, reps):
            if handle.exit_code is None:
                done, _ = ray.wait([rep.run_ref], timeout=0)
                if done:
                    try:
                        handle.exit_code = ray.get(rep.run_ref)
                    except Exception:  # the actor died: no exit code to report
                        pass

    def _stop(self, reps: list[_Replica]) -> None:
        """End the subprocess trees (through their actors, all at once), then free the actors."""
        ray = self._ray
        live = [r for r in reps if not r.released]
        if not live:
            return
        started = [bool(ray.wait([r.started_ref], timeout=0)[0]) for r in live]
        refs: list[ObjectRef[None]] = [r.actor.terminate.remote(self.grace_period) for r in live]
        running: list[ObjectRef[None]] = [ref for ref, s in zip(refs, started) if s]
        waiting: list[ObjectRef[None]] = [ref for ref, s in zip(refs, started) if not s]
        if running:
            ray.wait(running, num_returns=len(running), timeout=self.grace_period + 15)
        if waiting:
            # Not placed yet (or placed a moment ago): an actor that exists answers at once and
            # sets its cancelled flag; one still waiting for resources never will.
            ray.wait(waiting, num_returns=len(waiting), timeout=1.0)
        for rep in live:
            self._release(rep)

    def _release(self, rep: _Replica) -> None:
        """Copy the log to the driver (cluster case) and free the actor's resources."""
        if rep.released:
            return
        rep.released = True
        ray = self._ray
        if not rep.same_fs:
            try:
                text = ray.get(rep.actor.read_log.remote(None), timeout=30)
                Path(rep.log_path).write_text(text, encoding="utf-8")
            except Exception as exc:  # keep going: the status matters more than the log
                Path(rep.log_path).write_text(f"<log unavailable: {exc}>\n", encoding="utf-8")
        try:
            ray.kill(rep.actor, no_restart=True)
        except Exception:  # already dead
            pass

    def _wait(self, pending: list[ReplicaHandle], seconds: float) -> None:
        # Wake as soon as one replica finishes instead of sleeping the whole interval.
        refs = [self._replicas[h.job_id].run_ref for h in pending if h.job_id in self._replicas]
        if refs:
            self._ray.wait(refs, num_returns=1, timeout=seconds)
        else:
            time.sleep(seconds)

    def logs(self, handle: ReplicaHandle, tail: int | None = None) -> str:
        rep = self._replica(handle)
        if rep.same_fs or rep.released:
            return read_log_file(rep.log_path, tail)
        return self._ray.get(rep.actor.read_log.remote(tail), timeout=30)

    def shutdown(self) -> None:
        """Stop this executor's unfinished replicas; shut Ray down if this executor started it."""
        if self._ray.is_initialized():
            self._stop(list(self._replicas.values()))
        if self._started_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
