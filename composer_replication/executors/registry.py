"""The backend registry: the one place that names the executors `backend.kind` can choose.

Adding a backend: its executor module, one `Backend` entry in ``_ALL`` below (``BACKENDS`` is
keyed from it; ``backend.kind`` accepts every registered name), its tests and its row in
docs/backends.md. Each `Backend` says where its executor class lives, which pip extra installs its SDK, and the
few facts the driver and the preflight checks need (do its replicas run on other machines, does
it take a log folder, per-replica resources, forwarded variables as secrets). Everything else
that names backends derives from `BACKENDS`: the run schema's `backend.kind` choices
(config/schema.py), the preflight checks and the driver's executor construction (run/), and
the table in docs/backends.md (checked by tests/executors/test_registry.py).

This module holds strings only, so importing it imports no SDK; `executor_class` imports the
one adapter asked for.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, cast

from composer_replication.executors.executor import ServerlessExecutor
from composer_replication.fields import OneOf, require, setting

__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "Backend",
    "BackendConfig",
    "BackendName",
    "backend",
    "executor_class",
    "missing_sdk_message",
    "names",
    "pip_extra",
]


@dataclass(frozen=True)
class Backend:
    """One executor backend, as `backend.kind` names it.

    module, cls: where the executor class lives (imported only by `executor_class`).
    extra, sdk: the pip extra that installs the backend's SDK and the top-level module that SDK
      provides (None for the local backend, which needs nothing).
    remote: replicas run on other machines, so a `file://` store on this disk is invisible to
      them (Ray is not remote: a private local Ray shares this disk; on a cluster the user picks
      a shared store).
    takes_log_dir: the constructor accepts `log_dir=` (the driver points it at `<run>/logs/`).
    takes_resources: `launch_replicas(resources=...)` means something (local replicas share
      this machine, so the local backend takes none).
    forward_env_as_secrets: `backend.forward_env` reaches the replicas through the constructor's
      `secrets=` option (stored encrypted by the service) instead of their plain environment.
    summary: one line for the docs table.
    """

    name: str
    module: str
    cls: str
    extra: str | None
    sdk: str | None
    remote: bool
    takes_log_dir: bool
    takes_resources: bool
    forward_env_as_secrets: bool
    summary: str


_ALL = (
    Backend(
        name="local",
        module="composer_replication.executors.local",
        cls="LocalProcessExecutor",
        extra=None,
        sdk=None,
        remote=False,
        takes_log_dir=True,
        takes_resources=False,
        forward_env_as_secrets=False,
        summary="subprocesses of this machine, one process group each",
    ),
    Backend(
        name="modal",
        module="composer_replication.executors.modal",
        cls="ModalExecutor",
        extra="modal",
        sdk="modal",
        remote=True,
        takes_log_dir=False,
        takes_resources=True,
        forward_env_as_secrets=False,
        summary="one Modal function call per replica, in your image",
    ),
    Backend(
        name="hf-jobs",
        module="composer_replication.executors.hf_jobs",
        cls="HFJobsExecutor",
        extra="hf-jobs",
        sdk="huggingface_hub",
        remote=True,
        takes_log_dir=False,
        takes_resources=True,
        forward_env_as_secrets=True,
        summary="one Hugging Face Job per replica, in your image",
    ),
    Backend(
        name="k8s",
        module="composer_replication.executors.k8s",
        cls="K8sExecutor",
        extra="k8s",
        sdk="kubernetes",
        remote=True,
        takes_log_dir=False,
        takes_resources=True,
        forward_env_as_secrets=False,
        summary="one Kubernetes Indexed Job, one pod per replica",
    ),
    Backend(
        name="ray",
        module="composer_replication.executors.ray",
        cls="RayExecutor",
        extra="ray",
        sdk="ray",
        remote=False,
        takes_log_dir=True,
        takes_resources=True,
        forward_env_as_secrets=False,
        summary="one Ray actor per replica (a private local Ray or a cluster)",
    ),
    Backend(
        name="sagemaker",
        module="composer_replication.executors.sagemaker",
        cls="SageMakerExecutor",
        extra="sagemaker",
        sdk="boto3",
        remote=True,
        takes_log_dir=False,
        takes_resources=True,
        forward_env_as_secrets=False,
        summary="one single-instance SageMaker training job per replica",
    ),
)

BACKENDS: dict[str, Backend] = {b.name: b for b in _ALL}
"""name -> its `Backend`: the registry everything that names backends reads."""


def names() -> tuple[str, ...]:
    """Every registered backend's name, in registration order (what ``backend.kind`` accepts)."""
    return tuple(BACKENDS)


BackendName = Annotated[str, OneOf(names, "an executor backend (docs/backends.md)")]
"""A registered backend's name (the run config's ``backend.kind``; the loader checks it)."""
BACKEND_NAMES: tuple[str, ...] = names()
"""The backends registered when this module was imported (code asks `names`)."""


def backend(name: str) -> Backend:
    """The registry entry of `name`; ValueError listing the known names (with a did-you-mean)."""
    try:
        return BACKENDS[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown backend {name!r}{hint}; known backends: {', '.join(names())}"
        ) from None


def pip_extra(name: str) -> str:
    """The pip extra that installs backend `name`'s SDK (ValueError if it needs none)."""
    extra = backend(name).extra
    if extra is None:
        raise ValueError(f"backend {name!r} needs no extra")
    return extra


def missing_sdk_message(name: str) -> str | None:
    """None when backend `name`'s SDK is importable, else what to install (no import is done)."""
    spec = backend(name)
    if spec.sdk is None or importlib.util.find_spec(spec.sdk) is not None:
        return None
    return (
        f"backend {name!r} needs the {spec.sdk!r} package; install it with "
        f"`pip install 'composer-replication[{spec.extra}]'`"
    )


def executor_class(name: str) -> Callable[..., ServerlessExecutor]:
    """Import backend `name`'s executor class (its SDK is imported by the constructor)."""
    spec = backend(name)
    cls = getattr(importlib.import_module(spec.module), spec.cls)
    return cast("Callable[..., ServerlessExecutor]", cls)


@dataclass(frozen=True)
class BackendConfig:
    """Where the replicas run (an executor from the registry in composer_replication.executors)."""

    kind: BackendName = setting("local", "executor backend (docs/backends.md)")
    n_replicas: int = setting(2, "number of DiLoCo replicas")
    timeout_s: float = setting(
        3600.0, "wall-clock limit for the whole run (replicas then cancelled)"
    )
    max_restarts: int = setting(
        2,
        "the driver relaunches a replica that fails (killed, crashed) up to this many times per "
        "rank; it rejoins from the newest global state (0 = a failure is final)",
    )
    options: dict[str, Any] = setting(
        {}, "executor constructor arguments (image, gpu, namespace, ...)"
    )
    resources: dict[str, Any] = setting({}, "per-replica resources passed to launch_replicas")
    env: dict[str, str] = setting({}, "extra environment variables for every replica")
    forward_env: list[str] = setting(
        [],
        "names of driver environment variables (e.g. AWS_ACCESS_KEY_ID) copied to every "
        "replica; hf-jobs receives them as encrypted job secrets",
    )

    def __post_init__(self) -> None:
        require(self.n_replicas >= 1, "backend.n_replicas", f"{self.n_replicas} must be >= 1")
        require(self.timeout_s > 0, "backend.timeout_s", "must be > 0")
        require(self.max_restarts >= 0, "backend.max_restarts", "must be >= 0")
