"""Build the run's processes and services from the run config: the executor, a replica's
heartbeat, the throttling S3 proxy and the chaos injector.

- `build_executor(config, log_dir)`: the executor of `backend.kind` (from the registry) with
  `backend.options`; a missing SDK, bad option or missing credentials is a `ConfigError`;
- `build_heartbeat(config, store, rank, on_fenced)`: the replica's `HeartbeatWriter` in the
  role its outer-loop mode gives its replicas;
- `build_proxy(config)`: a `ThrottleProxy` in front of the S3 endpoint when a chaos event
  throttles the store or kills during an upload, else None;
- `build_chaos(config, targets, store, proxy, synchronizer_pid)`: the `ChaosInjector` of
  `[chaos]`, or None without events.

run/ starts, watches and stops what these return.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from composer_replication.assembly.outer import outer_loop_mode
from composer_replication.config import ConfigError
from composer_replication.diloco.heartbeat import HeartbeatWriter
from composer_replication.exchange.fencing import FencedError
from composer_replication.exchange.store import ObjectStore
from composer_replication.executors import registry
from composer_replication.executors.executor import ServerlessExecutor
from composer_replication.faults.events import PROXY_ACTIONS
from composer_replication.faults.injector import ChaosInjector, Targets
from composer_replication.faults.proxy import ThrottleProxy

if TYPE_CHECKING:
    from composer_replication.config import RunConfig

__all__ = [
    "build_chaos",
    "build_executor",
    "build_heartbeat",
    "build_proxy",
    "forwarded_env",
]


def forwarded_env(config: RunConfig) -> dict[str, str]:
    """The driver's variables that `backend.forward_env` names (those that are set)."""
    return {name: os.environ[name] for name in config.backend.forward_env if name in os.environ}


def build_executor(config: RunConfig, log_dir: Path) -> ServerlessExecutor:
    """The executor of `backend.kind`, built from `backend.options` (see the module docstring)."""
    spec = registry.backend(config.backend.kind)
    options = dict(config.backend.options)
    if spec.takes_log_dir:
        options.setdefault("log_dir", str(log_dir))
    if spec.forward_env_as_secrets and config.backend.forward_env:
        # A job's env is visible in its spec; secrets are stored encrypted by the service.
        options["secrets"] = {**dict(options.get("secrets") or {}), **forwarded_env(config)}
    try:
        return registry.executor_class(spec.name)(**options)
    except TypeError as exc:
        raise ConfigError(f"backend.options: {exc}") from None
    except (ValueError, ImportError, RuntimeError) as exc:  # bad option, SDK, credentials
        raise ConfigError(f"backend ({spec.name}): {exc}") from None


def build_heartbeat(
    config: RunConfig,
    store: ObjectStore,
    rank: int,
    on_fenced: Callable[[FencedError], None],
) -> HeartbeatWriter:
    """Replica ``rank``'s heartbeat, in the role its outer-loop mode gives it."""
    return HeartbeatWriter(store, outer_loop_mode(config).worker_role, rank, on_fenced=on_fenced)


def build_proxy(config: RunConfig) -> ThrottleProxy | None:
    """A proxy in front of the S3 endpoint when a chaos event throttles the store, makes it
    read-only or kills during an upload (the replicas and the synchronizer are pointed at it); else None."""
    needs = any(
        e.action in PROXY_ACTIONS or (e.action == "kill" and e.during == "upload")
        for e in config.chaos.events
    )
    endpoint = config.store.storage_options.get("endpoint_url")
    if not needs or not config.store.uri.startswith(("s3://", "s3a://")) or not endpoint:
        return None
    return ThrottleProxy(str(endpoint))


def build_chaos(
    config: RunConfig,
    targets: Targets,
    store: ObjectStore,
    proxy: ThrottleProxy | None,
    synchronizer_pid: Callable[[], int | None] | None,
) -> ChaosInjector | None:
    """The injector of `[chaos]` (not started), or None when it has no events."""
    if not config.chaos.events:
        return None
    return ChaosInjector(
        config.chaos.events,
        targets,
        store,
        proxy=proxy,
        synchronizer_pid=synchronizer_pid,
        upload_wait_s=config.chaos.upload_wait_s,
        seed=config.run.seed,
    )
