"""Checks that run before anything is written: a bad run fails fast with one clear message.

Every check raises `ConfigError` (the CLI prints it and exits with code 2). Nothing here writes
to the run folder (a `--resume` into a read-only or unwritable folder is found from the file
system's flags and permissions); a remote store is probed with one small object that is deleted
again.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
from pathlib import Path

from composer_replication.assembly.build import build_task
from composer_replication.config import ConfigError, RunConfig
from composer_replication.exchange.schemes import run_store_schemes
from composer_replication.exchange.store import ObjectStore, normalize_uri
from composer_replication.executors import registry
from composer_replication.executors.executor import Releasable
from composer_replication.run.folder import RunFolder, owner_conflict

__all__ = [
    "check_all",
    "check_backend",
    "check_backend_credentials",
    "check_hub_model",
    "check_model",
    "check_backend_options",
    "check_reporting",
    "check_resume_writable",
    "check_run_folder",
    "check_store",
    "check_store_scheme",
    "check_task",
    "check_teachers",
    "hub_offline",
    "resolve_store_uri",
]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set to a true value (huggingface_hub's reading of it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def check_model(config: RunConfig, *, hub: bool = True) -> None:
    """'tiny', an existing local folder with config.json, or something shaped like a hub id;
    with `hub`, a hub id must also be cached or reachable now (`check_hub_model`)."""
    name = config.model.name
    if config.model.is_tiny:
        return
    path = Path(name).expanduser()
    looks_local = name.startswith(("/", "./", "../", "~")) or path.exists()
    if looks_local:
        if not path.is_dir():
            raise ConfigError(
                f"model.name: local model folder {name!r} does not exist; give a folder written "
                "by save_pretrained, a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct', or 'tiny'"
            )
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.name: {name!r} has no config.json; is it a save_pretrained folder?"
            )
        return
    if not _HUB_ID.match(name):
        raise ConfigError(
            f"model.name: {name!r} is neither 'tiny', an existing folder, nor a hub id like "
            "'Qwen/Qwen2.5-0.5B-Instruct'"
        )
    if hub:
        check_hub_model(name)


def check_hub_model(name: str, *, timeout_s: float = 10.0) -> None:
    """A hub model must be in the local cache or reachable now: otherwise every replica fails a
    minute in with a hub error. One metadata request (no download)."""
    try:
        from huggingface_hub import HfApi, constants, try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # cached: from_pretrained works offline
    fix = (
        f"download it where the replicas run (`hf download {name}`), or give a local "
        "save_pretrained folder"
    )
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"model.name: {name!r} is not in the local cache and HF_HUB_OFFLINE is set; {fix}"
        )
    try:
        HfApi().model_info(name, timeout=timeout_s)
    except Exception as exc:  # not found, gated, unauthorised, unreachable: all one message
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            f"model.name: cannot reach hub model {name!r} at {constants.ENDPOINT} "
            f"({type(exc).__name__}: {reason[:160]}); check the id and your network or "
            f"HF_TOKEN, or {fix}"
        ) from None


def check_task(config: RunConfig) -> None:
    try:
        from composer_replication.tasks import TASKS
    except ImportError as exc:
        raise ConfigError(f"task.name: the built-in tasks cannot be imported ({exc})") from None
    # get_task also accepts "reasoning_gym:DATASET"; the registry key is the part before ":".
    registered_name = config.task.name.split(":", 1)[0]
    if registered_name not in TASKS:
        import difflib

        close = difflib.get_close_matches(config.task.name, list(TASKS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"task.name: unknown task {config.task.name!r}{hint}; built-in tasks: "
            f"{', '.join(sorted(TASKS))}"
        )
    try:  # construction is cheap (examples are drawn lazily) and checks the options
        task = build_task(config)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"task.options: {exc}") from None
    try:  # a task served elsewhere (openenv:URL) must answer now, not in every replica later
        task.check_ready()
        # diloco.screen = "loss" scores the task's reference answers of held-out prompts
        unanswered = config.diloco.exchange.screen == "loss" and any(
            not task.oracle(ex)
            for ex in task.eval_examples()[: config.diloco.exchange.screen_examples]
        )
    except (ConnectionError, ValueError, ImportError) as exc:
        raise ConfigError(f"task.name: {config.task.name!r}: {exc}") from None
    finally:
        task.close()  # the session (or container) the check opened; replicas open their own
    if unanswered:
        raise ConfigError(
            f"diloco.screen: 'loss' scores the task's reference answers, and task "
            f"{config.task.name!r} has none (an openenv task needs task.options.answer_field); "
            "use another diloco.screen"
        )


def check_backend(config: RunConfig, store_uri: str) -> None:
    """The backend's SDK is installed, its replicas can see the store, forwarded variables
    exist, and resources are only given to a backend that places replicas (the registry's
    facts: `executors.registry.BACKENDS`)."""
    kind = config.backend.kind
    spec = registry.backend(kind)
    missing = registry.missing_sdk_message(kind)
    if missing is not None:
        raise ConfigError(f"backend.kind: {missing}")
    if spec.remote and store_uri.startswith("file://"):
        raise ConfigError(
            f"store.uri: backend {kind!r} runs replicas on other machines, which cannot see "
            f"{store_uri}; set store.uri to a shared store such as s3://bucket/runs/NAME/"
        )
    missing_env = [name for name in config.backend.forward_env if name not in os.environ]
    if missing_env:
        raise ConfigError(
            f"backend.forward_env: {', '.join('$' + n for n in missing_env)} not set in this "
            "environment; export it or remove it from the list"
        )
    if not spec.takes_resources and config.backend.resources:
        placing = [b.name for b in registry.BACKENDS.values() if b.takes_resources]
        raise ConfigError(
            f"backend.resources: the {kind} backend takes no resources ({spec.summary}); "
            f"remove the [backend.resources] table or use a backend that places replicas "
            f"({', '.join(placing)})"
        )
    check_backend_options(config)


def check_backend_options(config: RunConfig) -> None:
    """`backend.options` names every argument the backend's executor requires (e.g. the image
    of sagemaker, k8s and hf-jobs) and no argument it does not take, as `train` would find when
    it builds the executor; read from the executor's signature, so no backend is listed here."""
    kind = config.backend.kind
    spec = registry.backend(kind)
    try:
        params = inspect.signature(registry.executor_class(kind)).parameters
    except (ImportError, ValueError, TypeError):  # an SDK that imports badly: train will say
        return
    options = config.backend.options
    supplied_by_driver = {"log_dir"} if spec.takes_log_dir else set()
    for name, param in params.items():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            continue
        if param.default is param.empty and name not in supplied_by_driver:
            value = options.get(name)
            if value is None or value == "":
                raise ConfigError(
                    f"backend.options.{name}: the {kind} backend needs it (set "
                    f"backend.options.{name} = ..., see docs/backends.md)"
                )
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if not takes_any:
        import difflib

        for name in options:
            if name not in params:
                close = difflib.get_close_matches(name, list(params), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"backend.options.{name}: not an option of the {kind} backend{hint}; it "
                    f"takes {', '.join(p for p in params if p not in supplied_by_driver)}"
                )


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_store(
    config: RunConfig, store_uri: str, *, overwrite: bool = False, run: RunFolder | None = None
) -> None:
    """The store must be writable and hold no other run (unless overwriting, and then only a
    store of this run folder ``run``: `folder.owner_conflict`).

    Local: checked without writing. Remote: one probe object, written and deleted.
    """
    store = ObjectStore(store_uri, config.store.storage_options)  # connects on first use only
    if overwrite and run is not None:
        try:
            conflict = owner_conflict(store, run)
        except OSError:
            conflict = None  # unreachable: the checks below say so
        if conflict is not None:
            raise ConfigError(
                f"store.uri: {conflict}; --overwrite clears only this run's own store. Give "
                f"run {run.name} its own store.uri (empty: the run folder's store/), or resume "
                "that run"
            )
    folder = store.local_path
    if folder is not None:
        if (folder / "run_config.json").exists() and not overwrite:
            raise ConfigError(
                f"store.uri: {store_uri} already holds a run; use a fresh prefix, `--resume` "
                "that run, or `--overwrite` to clear it"
            )
        anchor = _nearest_existing(folder)
        if not anchor.is_dir():
            raise ConfigError(
                f"store.uri: {store_uri} is not writable: {str(anchor)!r} is a file, not a folder"
            )
        if not os.access(anchor, os.W_OK | os.X_OK):
            raise ConfigError(
                f"store.uri: {store_uri} is not writable (no write permission on {str(anchor)!r})"
            )
        return
    try:
        taken = store.exists("run_config.json")
        if not taken:
            store.probe_writable()
    except ImportError as exc:
        raise ConfigError(
            f"store.uri: {store_uri} needs an fsspec driver that is not installed ({exc}); "
            "`pip install composer-replication[serverless]` adds s3 and gs"
        ) from None
    except Exception as exc:  # any failure to write means the run cannot start
        raise ConfigError(
            f"store.uri: cannot write to {store_uri} ({type(exc).__name__}: {exc}); check the "
            "bucket name, credentials and store.storage_options"
        ) from None
    if taken and not overwrite:
        raise ConfigError(
            f"store.uri: {store_uri} already holds a run; use a fresh prefix, `--resume` that "
            "run, or `--overwrite` to clear it"
        )


def _unwritable(path: Path) -> str | None:
    """Why the driver could not write `path` (a read-only mount, no permission), or None."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return f"{path} is on a read-only file system"
    except (OSError, AttributeError):  # gone meanwhile, or no statvfs (Windows)
        return None
    if not os.access(path, os.W_OK):
        return f"no write permission on {path}"
    return None


def check_resume_writable(folder: RunFolder, store_uri: str) -> None:
    """`--resume` rewrites the run folder (driver.json, config, metrics) and, for a local store,
    the store: all of it must be writable, or the resume stops here with one line."""
    local_store = ObjectStore(store_uri).local_path if store_uri.startswith("file://") else None
    paths = [folder.root, *sorted(folder.root.iterdir())]
    if local_store is not None and local_store.is_dir():
        paths.append(local_store)
    for path in paths:
        reason = _unwritable(path)
        if reason is not None:
            own = local_store is not None and local_store.resolve() == folder.store
            raise ConfigError(
                f"--resume: cannot write the run folder {folder.root} ({reason}); remount it "
                "read-write, or copy the folder somewhere writable and resume the copy"
                + (
                    " (its store/ comes with it; the original is left as it is)"
                    if own
                    else f" (it continues the run in its store, {store_uri})"
                )
            )


def check_run_folder(folder: RunFolder, *, resume: bool, overwrite: bool) -> None:
    if resume:
        if not folder.is_run():
            raise ConfigError(f"--resume: {folder.root} is not a run folder (no config.json)")
        return
    if folder.exists() and not overwrite:
        raise ConfigError(
            f"run folder {folder.root} already exists; choose another run.name, continue it "
            "with `train --resume`, or replace it with `--overwrite`"
        )
    anchor = _nearest_existing(folder.root.parent)
    if not anchor.is_dir() or not os.access(anchor, os.W_OK | os.X_OK):
        raise ConfigError(f"run.runs_dir: cannot create {folder.root} ({anchor} is not writable)")


def check_teachers(config: RunConfig) -> None:
    path = config.teachers.traces_path
    if path and "://" not in path and not Path(path).expanduser().is_file():
        raise ConfigError(f"teachers.traces_path: {path!r} does not exist")


def check_reporting(config: RunConfig) -> None:
    """TensorBoard files and plots need the `report` extra; say so before the run starts."""
    needs = []
    if config.logging.tensorboard:
        needs.append(("tensorboard", "logging.tensorboard"))
    if config.logging.report:
        needs.append(("matplotlib", "logging.report"))
    for module, key in needs:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"{key}: needs {module!r}; install it with "
                f"`pip install composer-replication[report]` or set {key}=false"
            )


def check_store_scheme(uri: str) -> None:
    """`store.uri` names a scheme the exchange supports (a plain path is file://)."""
    if "://" not in uri:
        return
    scheme = uri.partition("://")[0]
    schemes = run_store_schemes()
    if scheme.lower() not in schemes:
        supported = ", ".join(f"{s}://" for s in schemes)
        raise ConfigError(
            f"store.uri: {uri!r}: the scheme {scheme + '://'!r} is not supported; use one of "
            f"{supported} (or a local path, which is file://)"
        )


def resolve_store_uri(config: RunConfig, folder: RunFolder) -> str:
    check_store_scheme(config.store.uri)
    try:
        return normalize_uri(config.store.uri or str(folder.store))
    except ValueError as exc:
        raise ConfigError(f"store.uri: {exc}") from None


def check_backend_credentials(config: RunConfig) -> str:
    """Build the executor of `backend.kind` as `train` does (the same constructor, options and
    secrets), which finds the backend's credentials where its SDK looks for them (kubeconfig or
    a service account, the Modal token, the Hugging Face token, boto3's chain), and let it go
    without launching anything. ConfigError naming what is missing; else the note for the `ok`
    line (the local and Ray backends have no credentials: building them checks the options)."""
    import tempfile

    from composer_replication.assembly.services import build_executor

    with tempfile.TemporaryDirectory(prefix="composer-check-backend-") as tmp:
        executor = build_executor(config, Path(tmp) / "logs")
        if isinstance(executor, Releasable):
            executor.shutdown()
    if registry.backend(config.backend.kind).remote:
        return "backend credentials found"
    return f"executor built; the {config.backend.kind} backend needs no credentials"


def check_all(
    config: RunConfig, folder: RunFolder, *, resume: bool = False, overwrite: bool = False
) -> str:
    """Run every check; return the store URI the run will use."""
    check_run_folder(folder, resume=resume, overwrite=overwrite)
    check_model(config)
    check_task(config)
    check_teachers(config)
    check_reporting(config)
    store_uri = resolve_store_uri(config, folder)
    check_backend(config, store_uri)
    if resume:
        check_resume_writable(folder, store_uri)
    else:
        check_store(config, store_uri, overwrite=overwrite, run=folder)
    return store_uri
