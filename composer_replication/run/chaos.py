"""The chaos harness: inject real faults into a running run, then check that nothing was lost.

Usable from tests, benchmarks and `composer-replication train` (``[chaos]`` on the local
backend). Faults are real signals and real bytes, never simulated inside the replicas; the
fault kinds (kill, stop, slow, corrupt, kill_synchronizer, throttle, read_only) are listed, with what each
does, in `composer_replication.faults.injector`'s docstring.

The injector and the proxy live in `composer_replication.faults` (built from the run config
in assembly/services.py; their names are re-exported here). This module runs a whole local run
under faults (`run_local`); what a mode checks in the store afterwards is the mode's
(`OuterLoopMode.check_chaos`; Decoupled DiLoCo's `check_decoupled_run`, in
diloco/decoupled/decoupled_check.py, is re-exported here).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from composer_replication.diloco.decoupled.decoupled_check import check_decoupled_run
from composer_replication.exchange.store import ObjectStore
from composer_replication.faults.events import ChaosEventConfig
from composer_replication.faults.injector import (
    ChaosInjector,
    ProcessTargets,
    Targets,
    corrupt_object,
    uploading_file,
)
from composer_replication.faults.proxy import ThrottleProxy
from composer_replication.json_types import JSONDict, JSONValue

if TYPE_CHECKING:
    from composer_replication.executors.executor import ReplicaHandle
    from composer_replication.executors.local import LocalProcessExecutor
    from composer_replication.run.synchronizer_process import SynchronizerProcess

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


# ----------------------------------------------------------------------------- a whole run


@dataclass
class LocalRunResult:
    """What `run_local` saw: the injector's log, restarts (and how many a warm spare took),
    exit codes, the run's duration."""

    log: list[JSONDict]
    restarts: list[int]
    exit_codes: list[int | None]
    synchronizer_restarts: int
    synchronizer_exit: int | None
    seconds: float
    logs: str
    spare_takeovers: int = 0


def run_local(
    *,
    n: int,
    entrypoint: str,
    args: Sequence[JSONValue],
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
    warm_spares: int = 0,
    preload: Sequence[str] = (),
) -> LocalRunResult:
    """Launch ``n`` replica processes (`LocalProcessExecutor`, restarted when they die) and, with
    ``synchronizer``, the run's synchronizer (`SynchronizerProcess` on ``store``, configured by
    the run_config.json the caller put there); once ``ready()`` holds, call ``on_ready`` and
    start the chaos schedule; supervise until every replica ended; stop the synchronizer.
    ``env`` reaches every process (put the storage options in $COMPOSER_STORAGE_OPTIONS).
    ``warm_spares`` spares with ``preload`` imported take the restarts (`LocalProcessExecutor`)."""
    from composer_replication.executors.local import LocalProcessExecutor
    from composer_replication.run.synchronizer_process import SynchronizerProcess

    log_path = Path(log_dir)
    sync = (
        SynchronizerProcess(store.uri, env, log_path / "synchronizer.log") if synchronizer else None
    )
    executor = LocalProcessExecutor(
        log_dir=log_path,
        max_restarts=max_restarts,
        grace_period=2,
        warm_spares=warm_spares,
        preload=preload,
    )
    t0 = time.monotonic()
    if sync is not None:
        sync.start()
    handles = executor.launch_replicas(n, entrypoint, list(args), env=env)
    injector = ChaosInjector(
        events,
        ProcessTargets(executor, handles, sync),
        store,
        proxy=proxy,
        synchronizer_pid=(lambda: sync.pid) if sync else None,
        upload_wait_s=upload_wait_s,
        seed=seed,
    )
    sync_exit = _supervise(executor, handles, sync, injector, t0 + timeout_s, ready, on_ready)
    return LocalRunResult(
        log=list(injector.log),
        restarts=[h.restarts for h in handles],
        exit_codes=[h.exit_code for h in handles],
        synchronizer_restarts=sync.restarts if sync else 0,
        synchronizer_exit=sync_exit,
        seconds=time.monotonic() - t0,
        spare_takeovers=executor.spare_takeovers,
        logs=_tails(log_path),
    )


def _supervise(
    executor: LocalProcessExecutor,
    handles: list[ReplicaHandle],
    sync: SynchronizerProcess | None,
    injector: ChaosInjector,
    deadline: float,
    ready: Callable[[], bool] | None,
    on_ready: Callable[[], None] | None,
) -> int | None:
    """`run_local`'s loop: poll (restarting), keep the synchronizer up, start the chaos once
    ready; then stop everything (warm spares too); the synchronizer's exit code."""
    sync_exit: int | None = None
    try:
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
        if sync is not None:
            sync_exit = _await_synchronizer(sync)
    finally:
        injector.stop()
        executor.cancel([h for h in handles if not h.status.done])
        executor.shutdown()
        if sync is not None:
            sync.stop(grace_s=2)
    return sync_exit


def _tails(log_dir: Path) -> str:
    """The last 4000 characters of every non-empty log in log_dir (an unused spare's is
    empty)."""
    return "\n".join(
        f"--- {p.name}\n{text[-4000:]}"
        for p in sorted(log_dir.glob("*.log"))
        if (text := p.read_text(errors="replace"))
    )


def _await_synchronizer(sync: SynchronizerProcess) -> int | None:
    """Wait (up to 60 s) for the synchronizer to finish by itself, as it does once every learner
    is done, restarting it if it died meanwhile; then stop it and return its exit code."""
    end = time.monotonic() + 60
    while sync.pid is not None and time.monotonic() < end:
        sync.ensure_running()
        time.sleep(0.1)
    return sync.stop()


def read_json_lines(path: str) -> list[JSONDict]:
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
