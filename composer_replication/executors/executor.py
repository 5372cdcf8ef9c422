"""The executor seam: launch N DiLoCo replicas on some backend, watch them, collect them.

Replicas of one run share nothing but the object store, so a backend only has to start N copies
of one command with a per-replica environment, report how each ended, fetch its log and stop it.
This module holds everything that is the same for every backend:

- `ReplicaStatus` / `ReplicaHandle`: what the driver sees of one replica.
- `ServerlessExecutor`: the Protocol every backend satisfies (`launch_replicas`, `poll`,
  `collect`, `cancel`, `logs`); `RankLauncher` adds what `MultiExecutor` needs of a
  sub-executor (`check_launch`, `launch_ranks`); `Releasable` executors (`shutdown`) are shut
  down by the driver when the run is over. The seed driver works unchanged with any of
  them::

      handles = executor.launch_replicas(n_replicas=4, entrypoint="diloco_replica.py",
          entrypoint_args={"rendezvous": uri, "rank_env": "REPLICA_RANK"})
      result = executor.collect(handles, timeout=3600)
      print({h.replica_id: h.exit_code for h in result})

- `build_command`, `replica_env`, `validate_launch`: the one implementation of "what does replica
  k run, with which environment", so all backends start byte-identical commands.
- per-rank secrets (``launch_replicas(..., secrets={rank: {"NAME": "value"}})``, e.g. each
  replica's own signing key): each rank gets only its own, through the backend's secret
  mechanism (the `secrets` argument of `ExecutorBase._start`).
- `SupervisorBase` / `ExecutorBase`: optional base classes with the poll, collect (timeout,
  Ctrl-C) and cancel loops, and the launch-all-or-cancel loop; a backend implements `_start`,
  `_refresh`, `_terminate` and `logs`.

Handles are mutable records: `poll`, `collect` and `cancel` update them in place (and `poll` /
`collect` also return them), so a driver may keep its own list.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol, TypeAlias, runtime_checkable

from composer_replication.executors.spare import is_module_name
from composer_replication.json_types import JSONValue

__all__ = [
    "ENV_RANK",
    "ENV_RENDEZVOUS",
    "ENV_WORLD_SIZE",
    "ExecutorBase",
    "ReplicaHandle",
    "RankLauncher",
    "Releasable",
    "ReplicaStatus",
    "ServerlessExecutor",
    "SupervisorBase",
    "ARG_STYLES",
    "args_to_argv",
    "build_command",
    "check_arg_style",
    "check_secrets",
    "failure_error",
    "read_log_file",
    "replica_env",
    "tail_lines",
    "validate_launch",
]

ENV_RANK = "REPLICA_RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_RENDEZVOUS = "DILOCO_RENDEZVOUS"

LAUNCH_MODULE = "composer_replication.executors.launch"

# How many log lines a failed replica's `error` carries: enough to show a traceback, short
# enough to print a dict of failures.
ERROR_TAIL_LINES = 20

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

SecretsByRank = Mapping[int, Mapping[str, str]]
"""rank -> {environment variable: secret value} that only that rank may see."""


# A replica's entry-point arguments (`[backend] entrypoint_args`): keyword -> value (rendered by
# `args_to_argv`), or a list passed through as strings.
EntrypointArgs: TypeAlias = Mapping[str, JSONValue] | Sequence[JSONValue]
# A launch's resources (`[backend] resources`, from TOML): name -> value, checked by the backend's
# `_check_resources`.
Resources: TypeAlias = dict[str, JSONValue]


class ReplicaStatus(StrEnum):
    """Lifecycle of one replica (a str enum). PENDING -> RUNNING -> one of three terminal states."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def done(self) -> bool:
        """True for the terminal states (SUCCEEDED, FAILED, CANCELLED)."""
        return self in (ReplicaStatus.SUCCEEDED, ReplicaStatus.FAILED, ReplicaStatus.CANCELLED)


@dataclass
class ReplicaHandle:
    """What the driver knows about one replica.

    replica_id is the replica's rank (0..world_size-1, globally unique within a run even when the
    run spans several executors). job_id is the backend's own identifier (pid, Ray actor id,
    Kubernetes job/index, Modal call id, ...). exit_code is None while running or when the
    backend cannot tell; negative values are signals (local processes). error, for a FAILED
    replica, gives the reason and the tail of its log.
    """

    replica_id: int
    backend: str
    job_id: str
    status: ReplicaStatus
    exit_code: int | None = None
    start_time: float | None = None
    end_time: float | None = None
    log_location: str | None = None
    restarts: int = 0
    error: str | None = None


@runtime_checkable
class ServerlessExecutor(Protocol):
    """A place that can run N replicas of one command. See the module docstring."""

    backend: str

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
        """Start replicas 0..n_replicas-1; bad input raises ValueError before anything starts.
        ``secrets[rank]`` reaches only that replica, as environment variables set through the
        backend's secret mechanism."""
        ...

    def poll(self, handles: list[ReplicaHandle]) -> list[ReplicaHandle]:
        """Refresh the handles' status without blocking."""
        ...

    def collect(self, handles: list[ReplicaHandle], timeout: float) -> list[ReplicaHandle]:
        """Wait for every replica; on timeout cancel the rest and mark them FAILED."""
        ...

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        """Stop every unfinished replica (and everything it started); mark it CANCELLED."""
        ...

    def logs(self, handle: ReplicaHandle, tail: int | None = None) -> str:
        """The replica's combined stdout/stderr (the last `tail` lines when given)."""
        ...


@runtime_checkable
class Releasable(Protocol):
    """An executor that holds something beyond its replicas' lifetime (a Ray it started, a
    thread pool): the driver calls `shutdown()` once the run is over. Optional: an executor
    without it holds nothing."""

    def shutdown(self) -> None:
        """Stop what is still running and release what this executor started; idempotent."""
        ...


@runtime_checkable
class RankLauncher(ServerlessExecutor, Protocol):
    """An executor that can start a subset of a larger run's ranks (what `MultiExecutor` needs
    of each sub-executor; every `ExecutorBase` is one)."""

    def check_launch(self, n_replicas: int, entrypoint: str) -> None:
        """Raise ValueError for a launch of `n_replicas` that cannot work; start nothing."""
        ...

    def launch_ranks(
        self,
        ranks: Sequence[int],
        world_size: int,
        entrypoint: str,
        entrypoint_args: EntrypointArgs | None = None,
        *,
        env: dict[str, str] | None = None,
        resources: Resources | None = None,
        secrets: SecretsByRank | None = None,
    ) -> list[ReplicaHandle]:
        """Start the given ranks of a run of `world_size` replicas."""
        ...


# ----------------------------------------------------------------------------- shared helpers


ARG_STYLES: tuple[str, ...] = ("auto", "flags", "hydra")
_HYDRA_PREFIXES = ("+", "~")  # Hydra's append (+key, ++key) and delete (~key) overrides


def check_arg_style(arg_style: str) -> str:
    """`arg_style`, or ValueError naming the choices."""
    if arg_style not in ARG_STYLES:
        raise ValueError(f"arg_style must be one of {list(ARG_STYLES)}, got {arg_style!r}")
    return arg_style


def _hydra_value(value: object) -> str:
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value)


def args_to_argv(entrypoint_args: EntrypointArgs | None, arg_style: str = "auto") -> list[str]:
    """Turn entrypoint_args into command-line arguments.

    A dict's entries become, by `arg_style`:

    - ``"flags"``: ["--key", "value", ...] with the key spelled as given: True gives the bare
      flag, False/None omit it, a list/tuple repeats the flag once per element (argparse style).
    - ``"hydra"``: ["key=value", ...] (Hydra/OmegaConf overrides, as verl's and PRIME-RL's
      entry points take them): True/False become true/false, a list ``[a,b]``, None omits it.
    - ``"auto"`` (the default): a key that is a Hydra override (``+key``, ``++key``, ``~key``)
      the Hydra way, every other key as a flag; so ``{"config": "x.yaml",
      "+diloco.sync_every_h": 500}`` gives ``--config x.yaml +diloco.sync_every_h=500``.

    A list is passed through as strings. None gives [].
    """
    check_arg_style(arg_style)
    if entrypoint_args is None:
        return []
    if isinstance(entrypoint_args, Mapping):
        argv: list[str] = []
        for key, value in entrypoint_args.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"entrypoint_args keys must be non-empty strings, got {key!r}")
            if value is None:
                continue
            hydra_key = key.startswith(_HYDRA_PREFIXES)
            if arg_style == "hydra" or (arg_style == "auto" and hydra_key):
                argv.append(f"{key}={_hydra_value(value)}")
                continue
            if hydra_key:
                raise ValueError(
                    f"entrypoint_args key {key!r} is a Hydra override, which arg_style='flags' "
                    f"would pass as '--{key}'; use arg_style='hydra' or 'auto'"
                )
            flag = f"--{key}"
            if value is False:
                continue
            if value is True:
                argv.append(flag)
            elif isinstance(value, list | tuple):
                for item in value:
                    argv += [flag, str(item)]
            else:
                argv += [flag, str(value)]
        return argv
    if isinstance(entrypoint_args, str | bytes):
        raise ValueError(
            "entrypoint_args must be a dict or a list of arguments, not a string; "
            f"got {entrypoint_args!r} (split it into a list)"
        )
    if isinstance(entrypoint_args, Sequence):
        return [str(a) for a in entrypoint_args]
    raise ValueError(
        f"entrypoint_args must be a dict, a list or None, got {type(entrypoint_args).__name__}"
    )


def _is_script(entrypoint: str) -> bool:
    return entrypoint.endswith(".py") or "/" in entrypoint or os.sep in entrypoint


def build_command(
    entrypoint: str,
    entrypoint_args: EntrypointArgs | None = None,
    python: str = "python",
    arg_style: str = "auto",
) -> list[str]:
    """The argv replica processes run.

    "pkg.mod"          -> [python, -m, pkg.mod, *args]
    "pkg.mod:function" -> [python, -m, composer_replication.executors.launch,
                           pkg.mod:function, *args]   (launch calls function(argv), exits with it)
    "path/x.py"        -> [python, path/x.py, *args]
    """
    argv = args_to_argv(entrypoint_args, arg_style)
    if _is_script(entrypoint):
        return [python, entrypoint, *argv]
    if ":" in entrypoint:
        return [python, "-m", LAUNCH_MODULE, entrypoint, *argv]
    return [python, "-m", entrypoint, *argv]


def replica_env(
    rank: int,
    world_size: int,
    entrypoint_args: EntrypointArgs | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The variables one replica gets on top of its backend's base environment.

    REPLICA_RANK and WORLD_SIZE always; DILOCO_RENDEZVOUS when entrypoint_args (a dict) has
    "rendezvous"; the variable named by entrypoint_args["rank_env"] (when given) is also set to
    the rank, so a replica script written for another name (e.g. "RANK") finds it. The user's
    env is applied first, so these per-replica values win over it.
    """
    out = {str(k): str(v) for k, v in (env or {}).items()}
    out[ENV_RANK] = str(rank)
    out[ENV_WORLD_SIZE] = str(world_size)
    if isinstance(entrypoint_args, Mapping):
        rendezvous = entrypoint_args.get("rendezvous")
        if rendezvous is not None:
            out[ENV_RENDEZVOUS] = str(rendezvous)
        rank_env = entrypoint_args.get("rank_env")
        if rank_env is not None:
            if not isinstance(rank_env, str) or not re.match(r"^[A-Za-z_]\w*$", rank_env):
                raise ValueError(f"rank_env must be an environment variable name, got {rank_env!r}")
            out[rank_env] = str(rank)
    return out


def check_secrets(secrets: SecretsByRank | None, ranks: Sequence[int]) -> dict[int, dict[str, str]]:
    """Validated per-rank secrets (ValueError naming what is wrong); {} when None."""
    if secrets is None:
        return {}
    if not isinstance(secrets, Mapping):
        raise ValueError(f"secrets must map rank -> {{NAME: value}}, got {type(secrets).__name__}")
    out: dict[int, dict[str, str]] = {}
    for rank, values in secrets.items():
        if rank not in ranks:
            raise ValueError(f"secrets given for rank {rank!r}, which this launch does not start")
        if not isinstance(values, Mapping) or not all(
            isinstance(k, str) and _ENV_NAME_RE.match(k) and isinstance(v, str)
            for k, v in values.items()
        ):
            raise ValueError(f"secrets[{rank}] must map environment variable names to strings")
        out[rank] = dict(values)
    return out


def validate_launch(
    n_replicas: int,
    entrypoint: str,
    *,
    cwd: str | os.PathLike[str] | None = None,
    check_local: bool = True,
) -> None:
    """Raise ValueError for a launch that cannot work, before anything is started.

    n_replicas must be an int >= 1; entrypoint a script path or "pkg.mod[:function]". With
    check_local (the default; remote backends whose image holds the code pass False) a script
    must exist (relative to cwd) and a module must be importable here.
    """
    if isinstance(n_replicas, bool) or not isinstance(n_replicas, int) or n_replicas < 1:
        raise ValueError(f"n_replicas must be an integer >= 1, got {n_replicas!r}")
    if not isinstance(entrypoint, str) or not entrypoint.strip():
        raise ValueError(
            "entrypoint must be a script path ('train.py') or a module ('pkg.mod' or "
            f"'pkg.mod:function'), got {entrypoint!r}"
        )
    if _is_script(entrypoint):
        if check_local:
            path = os.path.join(os.fspath(cwd), entrypoint) if cwd is not None else entrypoint
            if not os.path.isfile(path):
                raise ValueError(
                    f"entrypoint script {entrypoint!r} not found (looked at "
                    f"{os.path.abspath(path)!r}); pass an existing .py file or a module name"
                )
        return
    module, _, function = entrypoint.partition(":")
    if not is_module_name(module) or (":" in entrypoint and not function.isidentifier()):
        raise ValueError(
            f"entrypoint {entrypoint!r} is neither a script path nor 'pkg.mod' / 'pkg.mod:function'"
        )
    if check_local:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as exc:
            spec = None
            reason = f" ({type(exc).__name__}: {exc})"
        else:
            reason = ""
        if spec is None:
            raise ValueError(
                f"entrypoint module {module!r} cannot be found{reason}; check the name and that "
                "its package is installed (or on PYTHONPATH)"
            )


def tail_lines(text: str, tail: int | None) -> str:
    """The last `tail` lines of text (all of it when tail is None)."""
    if tail is None:
        return text
    if tail < 0:
        raise ValueError(f"tail must be >= 0 or None, got {tail}")
    if tail == 0:
        return ""
    lines = text.splitlines(keepends=True)
    return "".join(lines[-tail:])


def read_log_file(path: str | os.PathLike[str], tail: int | None = None) -> str:
    """A replica's log file (its last `tail` lines when given); "" while it does not exist."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return tail_lines(text, tail)


def failure_error(reason: str, log_tail: str) -> str:
    """The `error` text of a failed replica: the reason, then its last log lines."""
    log_tail = log_tail.rstrip("\n")
    if not log_tail:
        return f"{reason} (log is empty)"
    return f"{reason}; last log lines:\n{log_tail}"


# ----------------------------------------------------------------------------- optional base


class SupervisorBase(ABC):
    """poll / collect (timeout, Ctrl-C) / cancel loops over handles, for any backend.

    A subclass implements:
      _refresh(handle)   update a not-done handle from the backend (status, exit_code, times;
                         a failure through `self._fail(handle, reason)`); must not block
      _terminate(handle) stop the replica and everything it started (best effort, idempotent;
                         it need not touch the handle's status)
      logs(handle, tail)
    and may override `_terminate_all` (stop many at once, e.g. signal all then wait once) and
    `_wait` (sleep between polls).
    """

    backend: str = "base"
    poll_interval: float = 1.0

    @abstractmethod
    def _refresh(self, handle: ReplicaHandle) -> None: ...

    @abstractmethod
    def _terminate(self, handle: ReplicaHandle) -> None: ...

    @abstractmethod
    def logs(self, handle: ReplicaHandle, tail: int | None = None) -> str: ...

    def _terminate_all(self, handles: list[ReplicaHandle]) -> None:
        for handle in handles:
            self._terminate(handle)

    # -- the protocol (launch lives in ExecutorBase / MultiExecutor)
    def poll(self, handles: list[ReplicaHandle]) -> list[ReplicaHandle]:
        for handle in handles:
            if not handle.status.done:
                self._refresh(handle)
        return handles

    def collect(
        self, handles: list[ReplicaHandle], timeout: float, *, poll_interval: float | None = None
    ) -> list[ReplicaHandle]:
        """Wait until every replica is done, at most `timeout` seconds.

        Replicas still running at the deadline are stopped and marked FAILED with error
        "timeout after {timeout}s". A KeyboardInterrupt (Ctrl-C) while waiting cancels every
        unfinished replica, then propagates. Never raises because a replica failed.
        """
        if timeout is None or timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        interval = self.poll_interval if poll_interval is None else poll_interval
        deadline = time.monotonic() + timeout
        try:
            while True:
                self.poll(handles)
                pending = [h for h in handles if not h.status.done]
                if not pending:
                    return handles
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._timeout(pending, timeout)
                    return handles
                self._wait(pending, min(interval, remaining))
        except KeyboardInterrupt:
            self._cancel_quietly(handles)
            raise

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        pending = [h for h in handles if not h.status.done]
        if not pending:
            return
        self._terminate_all(pending)
        for handle in pending:
            handle.status = ReplicaStatus.CANCELLED
            if handle.end_time is None:
                handle.end_time = time.time()

    # -- helpers for subclasses
    def _wait(self, pending: list[ReplicaHandle], seconds: float) -> None:
        """Sleep between polls; a backend with a cheap blocking wait may override."""
        time.sleep(max(seconds, 0.0))

    def _timeout(self, pending: list[ReplicaHandle], timeout: float) -> None:
        self._terminate_all(pending)
        for handle in pending:
            self._fail(handle, f"timeout after {timeout:g}s")

    def _fail(self, handle: ReplicaHandle, reason: str) -> None:
        """Mark a handle FAILED with `reason` and its log tail."""
        try:
            log_tail = self.logs(handle, tail=ERROR_TAIL_LINES)
        except Exception as exc:  # the log may be gone with the machine; the reason still counts
            log_tail = f"<log unavailable: {type(exc).__name__}: {exc}>"
        handle.status = ReplicaStatus.FAILED
        handle.error = failure_error(reason, log_tail)
        if handle.end_time is None:
            handle.end_time = time.time()

    def _cancel_quietly(self, handles: list[ReplicaHandle]) -> None:
        """Cancel, never raising: used on the way out of an error that must propagate."""
        try:
            self.cancel(handles)
        except Exception:  # one at a time, so one failure cannot spare the others
            for handle in handles:
                try:
                    self.cancel([handle])
                except Exception:  # the original error matters more than this one
                    pass


class ExecutorBase(SupervisorBase):
    """SupervisorBase plus launch-all-or-cancel; a backend adds `_start` for one replica.

      _start(rank, world_size, command, env, resources, secrets) -> ReplicaHandle
      (`_new_handle` builds it; `secrets` go through the backend's secret store)

    and may override `_check_resources` (reject bad resources up front), `check_launch` (e.g.
    skip local checks for code that lives in an image) and `python` (the interpreter replicas
    use). Every backend takes ``arg_style`` ("auto", "flags", "hydra"; see `args_to_argv`): how
    a dict of entrypoint_args becomes the replicas' argv.
    `launch_ranks(ranks, world_size, ...)` starts an arbitrary subset of ranks of a larger run;
    `MultiExecutor` relies on it to spread one run over several executors.
    """

    python: str = "python"
    arg_style: str = "auto"  # how a dict of entrypoint_args becomes argv (`args_to_argv`)

    @abstractmethod
    def _start(
        self,
        rank: int,
        world_size: int,
        command: list[str],
        env: dict[str, str],
        resources: Resources,
        secrets: dict[str, str],
    ) -> ReplicaHandle:
        """Start one replica. ``secrets`` are this rank's own (often empty): hand them over
        through the backend's secret mechanism, never where other ranks or job specs show
        them."""

    def _check_resources(self, resources: Resources) -> Resources:
        """Validate/normalise resources before launch (raise ValueError). Default: any dict."""
        return resources

    def check_launch(self, n_replicas: int, entrypoint: str) -> None:
        """Raise ValueError for a launch that cannot work (default: `validate_launch`)."""
        validate_launch(n_replicas, entrypoint)

    def _new_handle(
        self,
        rank: int,
        job_id: str,
        status: ReplicaStatus,
        log_location: str | None,
        start_time: float | None = None,
    ) -> ReplicaHandle:
        """The handle `_start` returns: this backend's, started now unless start_time is given."""
        start = time.time() if start_time is None else start_time
        return ReplicaHandle(
            replica_id=rank,
            backend=self.backend,
            job_id=job_id,
            status=status,
            start_time=start,
            log_location=log_location,
        )

    def _prepare(
        self,
        world_size: int,
        entrypoint: str,
        entrypoint_args: EntrypointArgs | None,
        resources: Resources | None,
    ) -> tuple[list[str], Resources]:
        """Check a launch (entrypoint, resources) and return (command, checked resources)."""
        self.check_launch(world_size, entrypoint)
        if resources is not None and not isinstance(resources, dict):
            raise ValueError(f"resources must be a dict or None, got {type(resources).__name__}")
        checked = self._check_resources(dict(resources or {}))
        command = build_command(entrypoint, entrypoint_args, self.python, self.arg_style)
        return command, checked

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
        """Start ranks 0..n_replicas-1 (see `launch_ranks`)."""
        self.check_launch(n_replicas, entrypoint)
        return self.launch_ranks(
            range(n_replicas),
            n_replicas,
            entrypoint,
            entrypoint_args,
            env=env,
            resources=resources,
            secrets=secrets,
        )

    def launch_ranks(
        self,
        ranks: Sequence[int],
        world_size: int,
        entrypoint: str,
        entrypoint_args: EntrypointArgs | None = None,
        *,
        env: dict[str, str] | None = None,
        resources: Resources | None = None,
        secrets: SecretsByRank | None = None,
    ) -> list[ReplicaHandle]:
        """Start the given ranks of a run of world_size replicas.

        Everything is validated first; if starting one replica fails, the ones already started
        are cancelled and the error propagates, so a failed launch leaves nothing running.
        """
        ranks = list(ranks)
        if not ranks:
            raise ValueError("launch_ranks needs at least one rank")
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world_size]
        if bad or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must be distinct integers in [0, {world_size}), got {ranks}")
        own = check_secrets(secrets, ranks)
        command, resources = self._prepare(world_size, entrypoint, entrypoint_args, resources)
        envs = {r: replica_env(r, world_size, entrypoint_args, env) for r in ranks}
        launched: list[ReplicaHandle] = []
        try:
            for rank in ranks:
                launched.append(
                    self._start(rank, world_size, command, envs[rank], resources, own.get(rank, {}))
                )
        except BaseException:
            self._cancel_quietly(launched)
            raise
        return launched
