"""ModalExecutor: each DiLoCo replica as one call of a Modal function.

The executor builds one Modal App with one function, `run_replica(command, env)`, whose
container image, GPU, secrets, timeout and (optionally) a cloud bucket mount for the object
store come from the constructor. Launching N replicas spawns N calls of it, each with its own
environment (rank, world size, rendezvous); the function runs the replica command as a
subprocess, echoes its output to stdout (so Modal keeps it as the call's log) and returns the
exit code plus the log tail. The app runs detached: replicas keep training if the driver dies.

Watching is non-blocking: `FunctionCall.get(timeout=0)` raises TimeoutError while the call runs.
Modal does not expose "queued" vs "running" through that call, so a spawned replica reports
RUNNING until it ends. Cancel uses `FunctionCall.cancel(terminate_containers=True)`.

Credentials: Modal's standard places (MODAL_TOKEN_ID / MODAL_TOKEN_SECRET, or ~/.modal.toml from
`modal token new`). The image must contain Python and composer-replication (the function is
imported from this module inside the container), e.g.
`modal.Image.debian_slim().pip_install("composer-replication[train,diloco,serverless]")`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from composer_replication.executors.executor import (
    ExecutorBase,
    ReplicaHandle,
    ReplicaStatus,
    Resources,
    check_arg_style,
    tail_lines,
    validate_launch,
)
from composer_replication.executors.redact import (
    MissingCredentialsError,
    import_sdk,
    redact,
    sdk_errors,
)
from composer_replication.executors.remote import stream_command

if TYPE_CHECKING:
    import modal


class ReplicaResult(TypedDict):
    """What `run_replica` returns: the replica's exit code and its output's last lines."""

    exit_code: int
    log_tail: str


class BucketMount(TypedDict):
    """``bucket_mount`` of `ModalExecutor` (a `modal.CloudBucketMount`)."""

    bucket: str
    mount_path: str
    endpoint_url: NotRequired[str | None]
    key_prefix: NotRequired[str | None]
    secret: NotRequired[str | None]  # the name of a Modal Secret with the bucket's credentials
    read_only: NotRequired[bool]


__all__ = ["MODAL_GPUS", "ModalExecutor", "modal_credentials", "run_replica"]

# GPU types Modal accepts (modal.com/docs/guide/gpu), optionally with ":N" for N per container.
MODAL_GPUS = (
    "T4",
    "L4",
    "A10",
    "A10G",
    "A100",
    "A100-40GB",
    "A100-80GB",
    "L40S",
    "H100",
    "H100!",
    "H200",
    "B200",
    "B200+",
)


def run_replica(command: list[str], env: dict[str, str]) -> ReplicaResult:
    """The Modal function body: run one replica, stream its output, return exit code + tail.

    Runs inside the container. Output goes to stdout line by line, which is what Modal records
    as the call's log; the last lines also come back in the result, so a failure's reason
    survives even when logs are not available.
    """
    code, tail = stream_command(command, env)
    return {"exit_code": code, "log_tail": tail}


def modal_credentials(modal: Any) -> tuple[str, str]:
    """The Modal token from its standard places, or MissingCredentialsError."""
    token_id = modal.config.config.get("token_id")
    token_secret = modal.config.config.get("token_secret")
    if not token_id or not token_secret:
        raise MissingCredentialsError(
            "no Modal credentials: run `modal token new` (writes ~/.modal.toml) or set "
            "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"
        )
    return token_id, token_secret


def _check_gpu(gpu: object) -> None:
    if gpu is None:
        return
    kind, _, count = str(gpu).partition(":")
    if kind.upper() not in MODAL_GPUS or (count and not (count.isdigit() and int(count) >= 1)):
        raise ValueError(
            f"unknown Modal GPU {gpu!r}; use one of {list(MODAL_GPUS)}, optionally with ':N' "
            "for N GPUs per replica (e.g. 'H100:8'), or gpu=None for CPU"
        )


class ModalExecutor(ExecutorBase):
    """One Modal function call per replica (see the module docstring).

    image: a registry tag (str, used with `modal.Image.from_registry`) or a `modal.Image`.
    add_python: with a tag whose image has no Python, the version Modal should add ("3.11").
    gpu: Modal GPU string ("A100", "H100:8", ...) or None for CPU only.
    secrets: names of Modal Secrets (created with `modal secret create`), exposed as env.
    env: static environment for every replica (per-replica values are added at launch).
    timeout: seconds one replica may run (Modal's function timeout; max 24 h).
    bucket_mount: {"bucket": ..., "mount_path": "/store", "endpoint_url": None,
      "key_prefix": None, "secret": "<modal secret name>", "read_only": False} mounts an
      S3/GCS/R2 bucket into every container (a CloudBucketMount), so the rendezvous can be a
      file:// path under mount_path.
    modal_module: the `modal` package; tests inject a fake of the few names used here.
    resources at launch: {"gpu", "cpu", "memory" (MiB), "timeout"} override per launch.
    """

    backend = "modal"

    def __init__(
        self,
        image: str | modal.Image | None = None,
        *,
        gpu: str | None = "A100",
        secrets: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout: int = 24 * 3600,
        cpu: float | None = None,
        memory: int | None = None,
        bucket_mount: BucketMount | None = None,
        add_python: str | None = None,
        app_name: str = "composer-replication-diloco",
        python: str = "python",
        arg_style: str = "auto",
        detach: bool = True,
        poll_interval: float = 5.0,
        modal_module: Any = None,
    ) -> None:
        self._modal = modal_module if modal_module is not None else import_sdk("modal", "modal")
        if image is None or (isinstance(image, str) and not image.strip()):
            raise ValueError(
                "ModalExecutor needs image= (a registry tag or a modal.Image with "
                "Python and composer-replication installed); none was given"
            )
        _check_gpu(gpu)
        if not isinstance(timeout, int) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if bucket_mount is not None and not {"bucket", "mount_path"} <= set(bucket_mount):
            raise ValueError("bucket_mount needs at least 'bucket' and 'mount_path'")
        self._redact = list(modal_credentials(self._modal))
        self.image, self.gpu, self.secrets = image, gpu, list(secrets)
        self.env = dict(env or {})
        self.timeout, self.cpu, self.memory = timeout, cpu, memory
        self.bucket_mount = bucket_mount.copy() if bucket_mount else None
        self.app_name, self.python, self.detach = app_name, python, detach
        self.arg_style = check_arg_style(arg_style)
        self.add_python = add_python
        self.poll_interval = poll_interval
        self._app: Any = None  # modal.App (from the injectable `modal_module`)
        self._function: Any = None  # its `run_replica` modal.Function
        # the entered `app.run()` context while calls are live
        self._run_ctx: AbstractContextManager[modal.App] | None = None
        self._calls: dict[str, modal.FunctionCall[ReplicaResult]] = {}  # job_id -> its call
        self._done_calls: dict[str, modal.FunctionCall[ReplicaResult]] = {}  # kept for logs
        self._tails: dict[str, str] = {}  # job_id -> log tail returned by run_replica

    # ------------------------------------------------------------------ app
    def _build_function(self) -> Any:
        m = self._modal
        image = self.image
        if isinstance(image, str):
            image = m.Image.from_registry(image, add_python=self.add_python)
        volumes: dict[str, object] = {}
        if self.bucket_mount:
            b = self.bucket_mount
            volumes[b["mount_path"]] = m.CloudBucketMount(
                bucket_name=b["bucket"],
                bucket_endpoint_url=b.get("endpoint_url"),
                key_prefix=b.get("key_prefix"),
                secret=m.Secret.from_name(b["secret"]) if b.get("secret") else None,
                read_only=bool(b.get("read_only", False)),
            )
        app = m.App(name=self.app_name)
        decorator = app.function(
            image=image,
            gpu=self.gpu,
            env=self.env or None,
            secrets=[m.Secret.from_name(name) for name in self.secrets],
            volumes=volumes,
            timeout=self.timeout,
            cpu=self.cpu,
            memory=self.memory,
            retries=0,  # a replica that dies is the run's business (DiLoCo tolerates it)
            serialized=True,
            name="run_replica",
        )
        self._app = app
        return decorator(run_replica)

    def _ensure_running(self) -> None:
        """Build the function and start the (detached, ephemeral) app once."""
        if self._run_ctx is not None:
            return
        with sdk_errors(self.backend, "starting the Modal app", self._redact):
            self._function = self._build_function()
            ctx = self._app.run(detach=self.detach)
            ctx.__enter__()
        self._run_ctx = ctx

    def _stop_app_if_idle(self) -> None:
        if self._run_ctx is None or self._calls:
            return
        ctx, self._run_ctx = self._run_ctx, None
        try:
            with sdk_errors(self.backend, "stopping the Modal app", self._redact):
                ctx.__exit__(None, None, None)
        except Exception:  # the replicas are done; a failed disconnect is not their failure
            pass

    # ------------------------------------------------------------------ launch
    def check_launch(self, n_replicas: int, entrypoint: str) -> None:
        validate_launch(n_replicas, entrypoint, check_local=False)  # the code is in the image

    def _check_resources(self, resources: Resources) -> Resources:
        unknown = set(resources) - {"gpu", "cpu", "memory", "timeout"}
        if unknown:
            raise ValueError(
                f"ModalExecutor resources take gpu, cpu, memory, timeout; got {sorted(unknown)}"
            )
        if "gpu" in resources:
            _check_gpu(resources["gpu"])
        return resources

    def _start(
        self,
        rank: int,
        world_size: int,
        command: list[str],
        env: dict[str, str],
        resources: Resources,
        secrets: dict[str, str],
    ) -> ReplicaHandle:
        """The rank's own secrets travel as a Modal Secret of that call's function options
        (``with_options(secrets=...)`` replaces the function's list, so the named ones are
        repeated), never as call arguments."""
        self._ensure_running()  # first spawn, after every check: a bad launch starts nothing
        fn = self._function
        self._redact += list(secrets.values())
        with sdk_errors(self.backend, f"spawning replica {rank}", self._redact):
            options = dict(resources)
            if secrets:
                m = self._modal
                named = [m.Secret.from_name(name) for name in self.secrets]
                options["secrets"] = [*named, m.Secret.from_dict(dict(secrets))]
            if options:
                fn = fn.with_options(**options)
            call = fn.spawn(command, env)
        job_id = str(call.object_id)
        self._calls[job_id] = call
        log_location = f"modal://function-call/{job_id}"
        return self._new_handle(rank, job_id, ReplicaStatus.RUNNING, log_location)

    # ------------------------------------------------------------------ watch
    def _refresh(self, handle: ReplicaHandle) -> None:
        call = self._calls.get(handle.job_id)
        if call is None:  # not ours (another driver) or already settled
            with sdk_errors(self.backend, f"looking up call {handle.job_id}", self._redact):
                call = self._modal.FunctionCall.from_id(handle.job_id)
            self._calls[handle.job_id] = call
        exc_mod = self._modal.exception
        try:
            result = call.get(timeout=0)
        except TimeoutError:  # builtin TimeoutError: the call has no output yet
            handle.status = ReplicaStatus.RUNNING
            return
        except exc_mod.FunctionTimeoutError:
            self._settle(handle)
            self._fail(handle, f"Modal stopped the replica at its {self.timeout}s function timeout")
            return
        except Exception as exc:  # remote crash, expired output, internal failure
            self._settle(handle)
            message = redact(f"{type(exc).__name__}: {exc}", self._redact)
            self._fail(handle, f"Modal call failed: {message}")
            return
        self._settle(handle)
        self._tails[handle.job_id] = str(result.get("log_tail", ""))
        handle.exit_code = int(result["exit_code"])
        handle.end_time = time.time()
        if handle.exit_code == 0:
            handle.status = ReplicaStatus.SUCCEEDED
        else:
            self._fail(handle, f"replica {handle.replica_id} exited with code {handle.exit_code}")

    def _settle(self, handle: ReplicaHandle) -> None:
        call = self._calls.pop(handle.job_id, None)
        if call is not None:
            self._done_calls[handle.job_id] = call

    def poll(self, handles: list[ReplicaHandle]) -> list[ReplicaHandle]:
        super().poll(handles)
        self._stop_app_if_idle()
        return handles

    def _terminate(self, handle: ReplicaHandle) -> None:
        call = self._calls.get(handle.job_id)
        if call is not None:
            with sdk_errors(self.backend, f"cancelling call {handle.job_id}", self._redact):
                call.cancel(terminate_containers=True)
            self._settle(handle)

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        super().cancel(handles)
        self._stop_app_if_idle()

    def _timeout(self, pending: list[ReplicaHandle], timeout: float) -> None:
        super()._timeout(pending, timeout)
        self._stop_app_if_idle()

    def logs(self, handle: ReplicaHandle, tail: int | None = None) -> str:
        """The call's log from Modal; the tail returned by the replica if logs are unavailable."""
        call = self._calls.get(handle.job_id) or self._done_calls.get(handle.job_id)
        text = None
        if call is not None:
            try:
                with sdk_errors(self.backend, f"fetching logs of {handle.job_id}", self._redact):
                    entries = call.logs.tail(entries=tail) if tail else call.logs.fetch()
                    text = "".join(str(e.message) for e in entries)
            except Exception:
                text = None
        if not text:
            text = self._tails.get(handle.job_id, "")
        return tail_lines(text, tail)
