"""The driver of `composer-replication train`: launch N replicas, watch them, gather everything.

    prepare()  -> resolved config + run folder + store URI (all checks, nothing written yet)
    run()      -> create the run folder, publish the config to the store, launch the replicas
                  with an executor, then loop: poll the replicas, pull their metrics and status
                  from the store into metrics.jsonl / TensorBoard, mirror committed checkpoints,
                  redraw the progress display. At the end: report + summary.

The replicas (composer_replication.run.replica) read the resolved
config from the store, so a replica on Modal and one on this machine run the same thing. A
replica that fails is relaunched up to `backend.max_restarts` times; the moment its process
exits the driver declares it departed in the store (exchange/liveness.py), so the others stop
waiting for it in the next rounds (the relaunched incarnation takes the record back when it
rejoins). One that fails for good stops the run unless diloco.min_replicas lets the others
continue; when they then finish, the run is "finished, N replicas lost" (exit 0).
Every launch writes the next run generation to the store (exchange/fencing.py) and hands it to
its replicas: replicas of an older launch stop before writing anything. `--resume` refuses to
start while replicas of the run still send fresh heartbeats after being fenced. Ctrl-C cancels
every replica. With ``diloco.manager = "torchft"`` and
no ``diloco.lighthouse`` the driver runs a torchft lighthouse on 127.0.0.1 for the run's
lifetime and hands its address to the replicas as $TORCHFT_LIGHTHOUSE. With ``[security] sign``
the driver makes the run's keys, publishes the signed key manifest and config signature, and
hands each replica only its own private key through the executor's secret mechanism
(run/security.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from composer_replication.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    dump_toml,
    from_dict,
    to_dict,
)
from composer_replication.exchange.fencing import bump_generation
from composer_replication.exchange.liveness import (
    HEARTBEAT_EVERY_S,
    REPLICA_ROLE,
    STALE_AFTER_S,
    clear_departure,
    read_liveness,
    write_departure,
)
from composer_replication.exchange.store import ObjectStore
from composer_replication.executors import registry
from composer_replication.executors.base import ReplicaHandle, ServerlessExecutor
from composer_replication.run import preflight
from composer_replication.run.checkpoint import mirror_checkpoints
from composer_replication.run.expected import expected_lines
from composer_replication.run.folder import RunFolder, default_run_name
from composer_replication.run.metrics import MetricsCollector, MetricsSink, mark_resume
from composer_replication.run.processes import pid_alive as _alive
from composer_replication.run.progress import Progress, ReplicaRow, choose_mode
from composer_replication.run.replica import ENV_GENERATION, ENV_STORAGE_OPTIONS
from composer_replication.run.replica_state import resume_plan
from composer_replication.run.report import (
    closed_attempts,
    headline_lines,
    run_wall_seconds,
    summarize,
    wall_text,
    write_report,
)
from composer_replication.run.security import prepare_signing, writer_secrets

__all__ = ["ENTRYPOINT", "TrainResult", "prepare", "prepare_resume", "run"]

ENTRYPOINT = "composer_replication.run.replica"


@dataclass
class TrainResult:
    folder: RunFolder
    exit_code: int
    status: str
    summary: dict[str, Any]


def prepare(
    config: RunConfig, *, overwrite: bool = False, name: str | None = None
) -> tuple[RunConfig, RunFolder]:
    """Resolve the run name and store URI and run every check (nothing is written)."""
    run_name = name or config.run.name or default_run_name()
    folder = RunFolder.at(Path(config.run.runs_dir) / run_name)
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, name=run_name))
    store_uri = preflight.check_all(config, folder, overwrite=overwrite)
    config = dataclasses.replace(config, store=dataclasses.replace(config.store, uri=store_uri))
    return config, folder


def resolve_run_folder(run: str, runs_dir: str = "runs") -> RunFolder:
    """RUN given as a path to a run folder, or as a name under runs_dir."""
    path = Path(run)
    if path.is_dir() or len(path.parts) > 1 or path.is_absolute():  # a path, existing or not
        return RunFolder.at(path)
    return RunFolder.at(Path(runs_dir) / run)


def finished_already(run: str, overrides: list[str]) -> str | None:
    """What `train --resume RUN` says, and then exits 0 without launching anything, when RUN
    has finished and the overrides ask for no more inner steps than it trained; None otherwise
    (not finished, or a larger `train.max_steps`: the run trains on)."""
    folder = resolve_run_folder(run)
    if not folder.is_run():
        return None
    state = folder.read_driver()
    if state.get("status") != "finished":
        return None
    tree = json.loads(folder.config_json.read_text())
    trained = int(tree.get("train", {}).get("max_steps", 0))
    if from_dict(RunConfig, apply_overrides(tree, overrides)).train.max_steps > trained:
        return None
    wall = wall_text(state)
    return (
        f"Run {folder.name} has already finished ({trained} inner steps"
        + (f", {wall}" if wall else "")
        + f"): nothing to resume. Report: {folder.summary}; final checkpoint: "
        f"{folder.checkpoints / 'final'}. To train it longer: composer-replication train "
        f"--resume {folder.root} train.max_steps=N (N > {trained})."
    )


def prepare_resume(run: str, overrides: list[str]) -> tuple[RunConfig, RunFolder]:
    """The stored config of RUN (plus overrides, e.g. a larger train.max_steps), checked."""
    folder = resolve_run_folder(run)
    if not folder.exists():
        raise ConfigError(f"--resume: no run folder {folder.root} (give a run folder or the name "
                          "of one under runs/)")  # fmt: skip
    if not folder.is_run():
        raise ConfigError(f"--resume: {folder.root} is not a run folder (no config.json in it)")
    state = folder.read_driver()
    if state.get("status") == "running" and state.get("host") == socket.gethostname():
        pid = int(state.get("pid") or 0)
        if pid > 0 and _alive(pid):
            raise ConfigError(
                f"--resume: run {folder.name} is still running (driver pid {pid}); stop it first "
                "(Ctrl-C or kill, which cancels its replicas)"
            )
    tree = json.loads(folder.config_json.read_text())
    fixed = {"run.name", "run.runs_dir", "store.uri", "backend.n_replicas"}
    for text in overrides:
        if text.partition("=")[0].strip() in fixed:
            raise ConfigError(f"--resume: {text.partition('=')[0]} cannot change on resume")
    config = from_dict(RunConfig, apply_overrides(tree, overrides))
    preflight.check_all(config, folder, resume=True)
    return config, folder


def _forwarded_env(config: RunConfig) -> dict[str, str]:
    return {name: os.environ[name] for name in config.backend.forward_env if name in os.environ}


def _rollback_for_resume(config: RunConfig, store: ObjectStore) -> int | None:
    """Sync mode: the newest round every replica can resume from exactly; the store forgets
    the rounds after it (run/replica_state.py). None in decoupled mode."""
    if config.diloco.mode != "sync":
        return None
    from composer_replication.run.replica_state import resume_point, rollback_to

    def warn(line: str) -> None:
        print(f"warning: {line}", file=sys.stderr, flush=True)

    round_ = resume_point(store, config.backend.n_replicas, warn=warn)
    rollback_to(store, round_, config.backend.n_replicas)
    return round_


FENCE_WAIT_S = 4 * HEARTBEAT_EVERY_S  # how long --resume waits for fenced replicas to stop


def _live_replicas(store: ObjectStore) -> dict[str, Any]:
    """The run's replicas/learners whose heartbeats are fresh and whose process may still run
    (a heartbeat from this machine whose pid is gone is not alive), keyed role/id."""
    here = socket.gethostname()
    out = {}
    for key, member in read_liveness(store, roles=[REPLICA_ROLE, "learner"]).items():
        hb = member.heartbeat
        if member.status != "alive" or hb is None:
            continue
        if hb.host == here and hb.pid is not None and not _alive(hb.pid):
            continue
        out[key] = member
    return out


def _fence_previous_launch(store: ObjectStore, generation: int, say: Callable[[str], None],
                           wait_s: float | None = None) -> None:  # fmt: skip
    """--resume, after writing ``generation``: wait until the replicas of the earlier launch
    that still send heartbeats stop (they check the generation at their next heartbeat and
    write); ConfigError naming them when they do not within ``wait_s``."""
    wait_s = FENCE_WAIT_S if wait_s is None else wait_s
    live = _live_replicas(store)
    if not live:
        return
    names = ", ".join(f"{k} (pid {m.heartbeat.pid} on {m.heartbeat.host})" for k, m in live.items())
    say(f"--resume: replicas of the earlier launch still run: {names}; fenced them "
        f"(run generation {generation}), waiting up to {wait_s:g} s for them to stop")  # fmt: skip
    fenced_at = time.time()
    deadline = time.monotonic() + wait_s
    while True:
        # alive = a heartbeat written well after the fence (a fenced replica writes none), or
        # a process of this machine that still runs
        here = socket.gethostname()
        still = {k: m for k, m in _live_replicas(store).items()
                 if m.heartbeat.host == here or m.heartbeat.time > fenced_at - 1.0}  # fmt: skip
        if not still or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if still:
        names = ", ".join(f"{k} (pid {m.heartbeat.pid} on {m.heartbeat.host}, heartbeat "
                          f"{m.age_s:.0f} s ago)" for k, m in still.items())  # fmt: skip
        raise ConfigError(
            f"--resume: replicas of this run are still alive after being fenced: {names}. Stop "
            "them first (kill the pid, or cancel the job on its backend), then resume again"
        )


class _Restarter:
    """Relaunch a failed replica (same rank) up to `backend.max_restarts` times: it reads the
    run config from the store and rejoins from the newest global state, as at a resume. The new
    handle takes the old one's place in the driver's list (the chaos harness sees it too)."""

    def __init__(self, config: RunConfig, executor: ServerlessExecutor, env: dict[str, str],
                 secrets: dict[int, dict[str, str]] | None) -> None:  # fmt: skip
        self.config, self.executor, self.env, self.secrets = config, executor, env, secrets
        self.used = [0] * config.backend.n_replicas
        self._refused = False

    def will_restart(self, rank: int) -> bool:
        from composer_replication.executors.base import RankLauncher

        limit = self.config.backend.max_restarts
        return isinstance(self.executor, RankLauncher) and self.used[rank] < limit

    def restart_failed(self, handles: list[ReplicaHandle]) -> list[str]:
        from composer_replication.executors.base import RankLauncher

        messages = []
        limit = self.config.backend.max_restarts
        for i, handle in enumerate(handles):
            rank = handle.replica_id
            if handle.status.value != "failed" or self.used[rank] >= limit:
                continue
            if not isinstance(self.executor, RankLauncher):
                if not self._refused:
                    self._refused = True
                    messages.append(f"the {type(self.executor).__name__} executor cannot "
                                    "relaunch one rank: failed replicas stay failed")  # fmt: skip
                continue
            self.used[rank] += 1
            why = _failure_reason(handle)
            try:
                (new,) = self.executor.launch_ranks(
                    [rank], self.config.backend.n_replicas, ENTRYPOINT,
                    {"rendezvous": self.config.store.uri}, env=self.env,
                    resources=dict(self.config.backend.resources) or None,
                    secrets={rank: self.secrets[rank]} if self.secrets else None,
                )  # fmt: skip
            except Exception as exc:  # the old handle stays failed; the run decides as before
                messages.append(f"replica {rank} failed ({why}); relaunching it failed: "
                                f"{type(exc).__name__}: {exc}")  # fmt: skip
                continue
            new.restarts = handle.restarts + 1
            handles[i] = new
            messages.append(f"replica {rank} failed ({why}); restarted "
                            f"({self.used[rank]} of {limit}), it rejoins from the store")  # fmt: skip
        return messages


SILENT_AFTER_S = STALE_AFTER_S  # a running replica without a heartbeat this long is departed


def _failure_reason(handle: ReplicaHandle) -> str:
    """The one-line reason a replica failed, without the log tail that follows it in `error`
    (shown by `status` and kept in driver.json)."""
    why = str(handle.error or f"exit code {handle.exit_code}").splitlines()[0]
    return why.split("; last log lines")[0][:200]


def _without_it(config: RunConfig, gone: int) -> str:
    """What the other replicas do once `gone` replicas have departed, by `diloco.min_replicas`
    (unset: every replica): go on, or wait up to `diloco.timeout_s` and fail the round."""
    n = config.backend.n_replicas
    quorum = config.diloco.min_replicas or n
    if n - gone >= quorum:
        return "the others go on without waiting for it"
    return (f"the others cannot go on without it: diloco.min_replicas = {quorum} of {n} "
            f"replicas (they wait up to diloco.timeout_s = {config.diloco.timeout_s:g} s, then "
            f"the round fails; set diloco.min_replicas below {n} to go on without a replica)")  # fmt: skip


class _Departures:
    """Sync mode: declare a replica departed in the store the moment its process is seen to
    have failed (before a relaunch, or for good), or when a replica the executor still reports
    running has sent no heartbeat for SILENT_AFTER_S (stopped, hung, partitioned), so that its
    peers stop waiting for it; a silent one that beats again is taken back."""

    def __init__(self, config: RunConfig, store: ObjectStore, every_s: float = 2.0) -> None:
        self.config = config
        self.store = store
        self.enabled = config.diloco.mode == "sync" and config.diloco.manager == "object_store"
        self.every_s = every_s
        self._noted: set[str] = set()  # job ids already declared
        self._silent: set[int] = set()  # ranks declared for want of heartbeats
        self._lost: set[int] = set()  # ranks that failed with no restart left
        self._last = 0.0

    def note_silent(self, handles: list[ReplicaHandle]) -> list[str]:
        """Every few seconds: departures for running replicas whose heartbeats stopped, and
        their withdrawal when the heartbeats come back."""
        now_m = time.monotonic()
        if not self.enabled or now_m - self._last < self.every_s:
            return []
        self._last = now_m
        try:
            members = read_liveness(self.store, roles=[REPLICA_ROLE])
        except (OSError, ValueError):  # the store is unreachable for a moment: next time
            return []
        messages, now = [], time.time()
        for h in handles:
            if h.status.value != "running":
                continue
            rank = h.replica_id
            member = members.get(f"{REPLICA_ROLE}/{rank}")
            hb = member.heartbeat if member is not None else None
            # silence counts from this incarnation's first heartbeat (start-up may be long; a
            # crash before it is a process exit, which `note` sees)
            if hb is None or hb.state != "running" or hb.time < (h.start_time or 0.0):
                continue
            silent = now - hb.time
            try:
                if silent > SILENT_AFTER_S and rank not in self._silent:
                    write_departure(self.store, REPLICA_ROLE, rank,
                                    reason=f"no heartbeat for {silent:.0f} s")  # fmt: skip
                    self._silent.add(rank)
                    gone = len(self._silent | self._lost)
                    messages.append(f"replica {rank} sent no heartbeat for {silent:.0f} s: "
                                    f"{_without_it(self.config, gone)}")  # fmt: skip
                elif silent <= SILENT_AFTER_S and rank in self._silent:
                    clear_departure(self.store, REPLICA_ROLE, rank)
                    self._silent.discard(rank)
                    messages.append(f"replica {rank} sends heartbeats again: it is waited for")
            except OSError as exc:  # the next poll tries again
                messages.append(f"could not update replica {rank}'s departure: {exc!r}")
        return messages

    def note(self, handles: list[ReplicaHandle], restarter: _Restarter) -> list[str]:
        messages = []
        for h in handles:
            if not self.enabled or h.status.value != "failed" or h.job_id in self._noted:
                continue
            self._noted.add(h.job_id)
            self._silent.discard(h.replica_id)  # its process is gone: no longer just silent
            why = _failure_reason(h)
            again = restarter.will_restart(h.replica_id)
            reason = f"{why}; {'being restarted' if again else 'no restarts left'}"
            try:
                write_departure(self.store, REPLICA_ROLE, h.replica_id, reason=reason)
            except OSError as exc:  # the peers then wait for it as before (timeout_s)
                messages.append(f"could not declare replica {h.replica_id} departed: {exc!r}")
                continue
            if not again:
                self._lost.add(h.replica_id)
                gone = len(self._silent | self._lost)
                messages.append(f"replica {h.replica_id} is lost ({why}); "
                                f"{_without_it(self.config, gone)}")  # fmt: skip
        return messages


def _release(executor: ServerlessExecutor) -> None:
    """Shut the executor down if it holds something (a Ray it started): the run is over."""
    from composer_replication.executors.base import Releasable

    if isinstance(executor, Releasable):
        executor.shutdown()


def _make_executor(config: RunConfig, folder: RunFolder) -> ServerlessExecutor:
    """The executor of `backend.kind` (from the registry), built from `backend.options`."""
    spec = registry.backend(config.backend.kind)
    options = dict(config.backend.options)
    if spec.takes_log_dir:
        options.setdefault("log_dir", str(folder.logs))
    if spec.forward_env_as_secrets and config.backend.forward_env:
        # A job's env is visible in its spec; secrets are stored encrypted by the service.
        options["secrets"] = {**dict(options.get("secrets") or {}), **_forwarded_env(config)}
    try:
        return registry.executor_class(spec.name)(**options)
    except TypeError as exc:
        raise ConfigError(f"backend.options: {exc}") from None
    except (ValueError, ImportError, RuntimeError) as exc:  # bad option, SDK, credentials
        raise ConfigError(f"backend ({spec.name}): {exc}") from None


def _rows(
    config: RunConfig, handles: list[ReplicaHandle], statuses: dict[int, dict[str, Any]]
) -> list[ReplicaRow]:
    rows = []
    now = time.time()
    for handle in handles:
        status = statuses.get(handle.replica_id, {})
        state = str(status.get("state", "starting"))
        if handle.status.done:
            state = str(handle.status.value)
        updated = status.get("updated")
        rows.append(
            ReplicaRow(
                rank=handle.replica_id,
                state=state,
                step=int(status.get("step") or 0),
                max_steps=int(status.get("max_steps") or config.train.max_steps),
                round=int(status.get("round") or 0),
                reward=status.get("reward"),
                eval_accuracy=status.get("eval_accuracy"),
                seconds_since_update=None if updated is None else max(0.0, now - updated),
            )
        )
    return rows


def _handle_json(handle: ReplicaHandle) -> dict[str, Any]:
    out = dataclasses.asdict(handle)
    out["status"] = str(handle.status.value)
    return out


def run(
    config: RunConfig,
    folder: RunFolder,
    *,
    resume: bool = False,
    overwrite: bool = False,
    stream: TextIO | None = None,
    poll_interval: float = 1.0,
) -> TrainResult:
    """Train; see the module docstring. `config` must come from prepare/prepare_resume."""
    stream = stream if stream is not None else sys.stdout
    store = ObjectStore(config.store.uri, config.store.storage_options)
    # Before anything is written: a missing SDK, missing credentials or a bad option of the
    # backend is a configuration error (exit 2), not a half-created run folder.
    executor = _make_executor(config, folder)
    if not resume:
        folder.create(overwrite=overwrite)
        if overwrite and store.exists(""):
            store.delete_prefix("")  # a stale run in an explicit store would be resumed otherwise
    try:
        generation = bump_generation(store)  # replicas of an earlier launch are fenced from now
    except ValueError as exc:
        raise ConfigError(f"{config.store.uri}: {exc}; delete that object to resume") from None
    if resume:  # fenced and stopped before the rollback rewrites the store under them
        _fence_previous_launch(store, generation, lambda m: print(m, file=stream, flush=True))
    resumed_at = _rollback_for_resume(config, store) if resume else None
    for rank in range(config.backend.n_replicas):  # a new launch: every rank is expected
        clear_departure(store, REPLICA_ROLE, rank)
    folder.config_toml.write_text(dump_toml(config))
    folder.config_json.write_text(json.dumps(to_dict(config), indent=1))
    config_doc = json.loads(json.dumps(to_dict(config)))  # exactly what replicas will read
    store.put_json("run_config.json", config_doc)
    signing = prepare_signing(config, folder, store, config_doc)
    t_start = time.monotonic()
    state = folder.read_driver()
    attempt = int(state.get("attempt", 0)) + 1
    # The earlier attempts' wall times (one killed mid-run counts until its last update).
    folder.update_driver(
        status="running", attempt=attempt, attempts=closed_attempts(state), started=time.time(),
        ended=None, updated=None, pid=os.getpid(), host=socket.gethostname(),
    )  # fmt: skip

    mode = choose_mode(config.logging.progress, stream)
    # Decoupled mode counts the synchronizer's global versions (one per merge, any number of
    # them per H steps), not a fixed number of rounds.
    n_rounds = config.n_rounds if config.diloco.mode == "sync" else None
    progress = Progress(mode, title=f"run {folder.name}", n_rounds=n_rounds, stream=stream)
    progress.message(
        f"{'Resuming' if resume else 'Starting'} run {folder.root} ({config.backend.n_replicas} "
        f"x {config.backend.kind} replicas, model {config.model.name}, task {config.task.name}, "
        f"{config.train.max_steps} inner steps, sync every {config.diloco.sync_every_h})"
    )
    if resumed_at is not None:
        plan = resume_plan(resumed_at)
        progress.message(plan[:1].upper() + plan[1:])
    if not resume:
        for line in expected_lines(config):  # the embedded default's measured ranges
            progress.message(line)
    sink = MetricsSink(folder.metrics, folder.tensorboard if config.logging.tensorboard else None)
    consumed = {int(k): int(v) for k, v in (state.get("metrics_chunks") or {}).items()}
    collector = MetricsCollector(store, config.backend.n_replicas, sink, consumed)
    if resumed_at is not None:  # the crashed launch's last chunks, then its redone steps flagged
        collector.poll()
        mark_resume(folder.metrics, sink, resumed_round=resumed_at,
                    redo_after_step=resumed_at * config.diloco.sync_every_h,
                    n_replicas=config.backend.n_replicas)  # fmt: skip

    env = {
        ENV_STORAGE_OPTIONS: json.dumps(config.store.storage_options),
        ENV_GENERATION: str(generation),
        "TOKENIZERS_PARALLELISM": "false",
        **config.backend.env,
    }
    if not registry.backend(config.backend.kind).forward_env_as_secrets:
        env.update(_forwarded_env(config))
    if config.train.torch_threads > 0:
        env.setdefault("OMP_NUM_THREADS", str(config.train.torch_threads))
    secrets: dict[str, Any] = {}
    if signing is not None:  # every replica: the driver's public key; rank r: its own key only
        env.update(signing.env)
        secrets["secrets"] = signing.per_rank(config.backend.n_replicas)
    else:  # rank r: its own writer secret (a restarted replica recognises its earlier upload)
        secrets["secrets"] = writer_secrets(folder, config.backend.n_replicas)
    lighthouse = _start_lighthouse(config, env)
    proxy = _start_proxy(config, env)
    synchronizer = _start_synchronizer(config, folder, env)
    stop, restore_signals = _install_stop_handlers()
    try:
        handles = executor.launch_replicas(
            config.backend.n_replicas,
            ENTRYPOINT,
            {"rendezvous": config.store.uri},
            env=env,
            resources=dict(config.backend.resources) or None,
            **secrets,
        )
    except Exception as exc:  # the executor cancelled whatever it had started
        restore_signals()
        _release(executor)
        _stop_lighthouse(lighthouse)
        _stop_decoupled(synchronizer, proxy)
        progress.close()
        sink.close()
        message = f"launching the replicas failed: {type(exc).__name__}: {exc}"
        folder.update_driver(status="failed", ended=time.time(), error=message)
        print(message, file=stream, flush=True)
        return TrainResult(folder=folder, exit_code=1, status="failed", summary={})
    status = "running"
    deadline = time.monotonic() + config.backend.timeout_s
    decoupled = config.diloco.mode == "decoupled"
    elastic = decoupled or (config.diloco.min_replicas or config.backend.n_replicas) < len(handles)
    last_mirror = 0.0
    health = _HealthLog(config, store, sink)
    injector = _start_chaos(config, executor, handles, synchronizer, store, proxy)
    restarter = _Restarter(config, executor, env, secrets.get("secrets"))
    departures = _Departures(config, store)
    try:
        while True:
            executor.poll(handles)
            if not stop.is_set():
                for message in departures.note(handles, restarter):
                    progress.message(message)
                for message in departures.note_silent(handles):
                    progress.message(message)
                for message in restarter.restart_failed(handles):
                    progress.message(message)
            if synchronizer is not None:
                synchronizer.ensure_running()
                _release_failed_learners(config, store, handles)
            health.poll()
            collector.poll()
            statuses = collector.statuses()
            if _chaos_due(injector, statuses, len(handles)):
                injector.start()
                progress.message(f"chaos: {len(config.chaos.events)} events scheduled from now")
            progress.update(_rows(config, handles, statuses))
            # Mid-run mirroring only for a local store (a disk copy); a remote store's
            # checkpoints (GBs for a real model) are downloaded once, at the end.
            if store.is_local and time.monotonic() - last_mirror > 5.0:
                mirror_checkpoints(store, folder.checkpoints)
                last_mirror = time.monotonic()
            folder.update_driver(
                replicas=[_handle_json(h) for h in handles],
                metrics_chunks={str(k): v for k, v in collector.consumed.items()},
                updated=time.time(),
            )
            failed = [h for h in handles if h.status.value == "failed"]
            if failed and not elastic:
                executor.cancel(handles)
                status = "failed"
                for h in failed:
                    progress.message(f"replica {h.replica_id} failed: {h.error}")
                break
            if all(h.status.done for h in handles):
                status = _final_status(config, handles, elastic)
                break
            if stop.is_set():
                executor.cancel(handles)
                status = "interrupted"
                break
            if time.monotonic() > deadline:
                executor.cancel(handles)
                status = "timeout"
                progress.message(f"backend.timeout_s={config.backend.timeout_s:g} reached")
                break
            stop.wait(poll_interval)
    except KeyboardInterrupt:
        executor.cancel(handles)
        status = "interrupted"
    finally:
        progress.close()
    if injector is not None:
        injector.stop()
    chaos = _chaos_report(config, folder, store, injector, status)
    _stop_decoupled(synchronizer, proxy)
    health.poll(force=True)
    try:
        summary = _finish(config, folder, store, executor, handles, collector, sink, status)
    except KeyboardInterrupt:  # a second Ctrl-C while gathering: keep what is there
        status = "interrupted"
        folder.update_driver(status=status, ended=time.time())
        summary = {}
    finally:
        restore_signals()
        _stop_lighthouse(lighthouse)
        _stop_decoupled(synchronizer, proxy)
        _release(executor)
    if chaos is not None:
        summary["chaos_ok"] = chaos["ok"]
        if not chaos["ok"] and status == "finished":
            status = "failed"
            folder.update_driver(status=status, error="chaos check failed: see chaos.json")
    exit_code = {"finished": 0, "interrupted": 130}.get(status, 1)
    # one wall time everywhere: driver start to end of training, summed over the run's attempts
    # (a resumed run's earlier launches count), as summary.md shows it
    attempts = closed_attempts(folder.read_driver())
    folder.update_driver(attempts=attempts)
    wall = run_wall_seconds(folder.read_driver())
    if wall is None:
        wall = time.monotonic() - t_start
    folder.update_driver(wall_seconds=wall)
    restarts = sum(h.restarts for h in handles)
    lost = [h.replica_id for h in handles if h.status.value == "failed"]
    folder.update_driver(lost=lost)
    print(summary_text(folder, status, summary, config, wall, restarts, lost=len(lost),
                       attempts=[a["seconds"] for a in attempts]),
          file=stream, flush=True)  # fmt: skip
    return TrainResult(folder=folder, exit_code=exit_code, status=status, summary=summary)


def _final_status(config: RunConfig, handles: list[ReplicaHandle], elastic: bool) -> str:
    """Every replica has ended: "finished" when all succeeded, or (sync mode, elastic) when the
    ones that failed for good left at least diloco.min_replicas that completed training."""
    failed = [h for h in handles if h.status.value != "succeeded"]
    if not failed:
        return "finished"
    survivors = len(handles) - len(failed)
    need = config.diloco.min_replicas or config.backend.n_replicas
    lost_only = all(h.status.value == "failed" for h in failed)
    if elastic and config.diloco.mode == "sync" and lost_only and survivors >= need:
        return "finished"
    return "failed"


def _start_lighthouse(config: RunConfig, env: dict[str, str]) -> Any:
    """A torchft lighthouse on 127.0.0.1 when the run uses torchft without one of its own
    (its address goes into the replicas' `env`); None otherwise."""
    if config.diloco.manager != "torchft" or config.diloco.lighthouse:
        return None
    if "torchft" not in sys.modules and "RUST_LOG" not in os.environ:
        # torchft's Rust logger reads RUST_LOG once, at import: keep the lighthouse's per-quorum
        # INFO lines out of the progress display (the replicas' own logs keep theirs).
        os.environ["RUST_LOG"] = "warn"
        try:
            import torchft  # noqa: F401
        finally:
            del os.environ["RUST_LOG"]
    from composer_replication.diloco.torchft_path import lighthouse_address, start_lighthouse

    n = config.backend.n_replicas
    lighthouse = start_lighthouse(config.diloco.min_replicas or n, bind="127.0.0.1:0")
    env["TORCHFT_LIGHTHOUSE"] = lighthouse_address(lighthouse)
    return lighthouse


def _stop_lighthouse(lighthouse: Any) -> None:
    if lighthouse is not None:
        lighthouse.shutdown()


# --------------------------------------------------------------------- decoupled mode and chaos


def _start_proxy(config: RunConfig, env: dict[str, str]) -> Any:
    """A throttling proxy in front of the S3 endpoint when chaos throttles the store or kills
    during an upload (the replicas and the synchronizer are pointed at it); None otherwise."""
    needs = any(e.action == "throttle" or (e.action == "kill" and e.during == "upload")
                for e in config.chaos.events)  # fmt: skip
    endpoint = config.store.storage_options.get("endpoint_url")
    if not needs or not config.store.uri.startswith(("s3://", "s3a://")) or not endpoint:
        return None
    from composer_replication.run.chaos import ThrottleProxy

    proxy = ThrottleProxy(str(endpoint))
    env[ENV_STORAGE_OPTIONS] = json.dumps({**config.store.storage_options,
                                           "endpoint_url": proxy.endpoint})  # fmt: skip
    return proxy


def _start_synchronizer(config: RunConfig, folder: RunFolder, env: dict[str, str]) -> Any:
    """The driver's synchronizer process (decoupled mode, diloco.synchronizer = "driver")."""
    if config.diloco.mode != "decoupled" or config.diloco.synchronizer != "driver":
        return None
    from composer_replication.run.synchronizer import SynchronizerProcess

    proc = SynchronizerProcess(config.store.uri, dict(env), folder.logs / "synchronizer.log")
    proc.start()
    return proc


def _stop_decoupled(synchronizer: Any, proxy: Any) -> None:
    if synchronizer is not None:
        synchronizer.stop()
    if proxy is not None:
        proxy.close()


def _release_failed_learners(
    config: RunConfig, store: ObjectStore, handles: list[ReplicaHandle]
) -> None:
    """A learner that failed for good will not push again: mark it done (abandoned) so the
    synchronizer neither waits for it in a quorum nor before the final merge."""
    from composer_replication.exchange.push_store import DecoupledStore

    docs = DecoupledStore(store)
    for h in handles:
        if h.status.value == "failed":
            doc = docs.read_progress(h.replica_id)
            if doc is None or not doc.get("abandoned"):
                docs.write_progress(h.replica_id, step=config.train.max_steps, done=True,
                                    abandoned=True, error=str(h.error or "")[:500])  # fmt: skip


def _start_chaos(config: RunConfig, executor: Any, handles: list[ReplicaHandle], synchronizer: Any,
                 store: ObjectStore, proxy: Any) -> Any:  # fmt: skip
    if not config.chaos.events:
        return None
    from composer_replication.run.chaos import ChaosInjector, ProcessTargets

    return ChaosInjector(
        config.chaos.events, ProcessTargets(executor, handles, synchronizer), store, proxy=proxy,
        synchronizer_pid=(lambda: synchronizer.pid) if synchronizer is not None else None,
        upload_wait_s=config.chaos.upload_wait_s, seed=config.run.seed,
    )  # fmt: skip


def _chaos_due(injector: Any, statuses: dict[int, dict[str, Any]], n: int) -> bool:
    """The schedule starts once every replica reports it trains (times count from then)."""
    if injector is None or injector.started:
        return False
    return len(statuses) == n and all(
        s.get("state") not in (None, "starting") for s in statuses.values()
    )


def _chaos_report(config: RunConfig, folder: RunFolder, store: ObjectStore, injector: Any,
                  status: str) -> dict[str, Any] | None:  # fmt: skip
    """After a chaos run: check the store (decoupled mode) and write <run>/chaos.json."""
    if injector is None:
        return None
    report: dict[str, Any] = {"events": injector.log, "ok": status == "finished"}
    if config.diloco.mode == "decoupled" and status == "finished":
        from composer_replication.run.chaos import check_decoupled_run

        kills = [e for e in injector.log if e.get("action") == "kill"]
        report["check"] = check_decoupled_run(store, None, kills)
        report["ok"] = bool(report["check"]["ok"])
    (folder.root / "chaos.json").write_text(json.dumps(report, indent=1, default=str))
    return report


class _HealthLog:
    """Every few seconds: the run state from the store's heartbeats (run/status.py); a
    "health" metric record whenever it changes (and every minute)."""

    def __init__(self, config: RunConfig, store: ObjectStore, sink: MetricsSink,
                 every_s: float = 5.0) -> None:  # fmt: skip
        d = config.diloco
        self.store, self.sink, self.every_s = store, sink, every_s
        self.mode, self.n = d.mode, config.backend.n_replicas
        self.quorum = config.quorum if d.mode == "decoupled" else (d.min_replicas or self.n)
        self.started = time.time()  # built as the replicas are launched: the start-up window
        self._last = 0.0
        self._last_written = 0.0
        self._state: str | None = None

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        from composer_replication.run.status import health_now

        try:
            h = health_now(self.store, mode=self.mode, n_replicas=self.n, quorum=self.quorum,
                           started=self.started)  # fmt: skip
        except Exception:  # the store is unreachable for a moment: the next poll retries
            return
        if h["state"] != self._state or force or now - self._last_written > 60:
            self._state = h["state"]
            self._last_written = now
            sync = h.get("synchronizer") or {}
            versions = sync.get("versions")
            self.sink.write([{
                "time": time.time(), "replica": -1, "kind": "health", "step": 0, "round": 0,
                "health/state": h["state"], "health/level": h["level"],
                "health/reasons": "; ".join(h["reasons"]),
                "health/alive": h["alive_workers"],
                "health/merges": sync.get("merges"),
                "health/versions": sum(versions) if isinstance(versions, list) else None,
            }])  # fmt: skip


def _install_stop_handlers() -> tuple[threading.Event, Callable[[], None]]:
    """Ctrl-C / SIGTERM set a flag the monitoring loop acts on (cancel every replica, then
    gather what there is); a second one raises KeyboardInterrupt. A flag rather than an
    exception at an arbitrary point: an exception in the middle of an import would leave a
    half-initialised module behind. Returns (flag, restore)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop, lambda: None

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return stop, restore


def _finish(
    config: RunConfig,
    folder: RunFolder,
    store: ObjectStore,
    executor: ServerlessExecutor,
    handles: list[ReplicaHandle],
    collector: MetricsCollector,
    sink: MetricsSink,
    status: str,
) -> dict[str, Any]:
    """After the replicas ended: last metrics, checkpoints, logs, driver state, report."""
    collector.poll()
    mirror_checkpoints(store, folder.checkpoints)
    _save_remote_logs(executor, handles, folder)
    sink.close()
    folder.update_driver(
        status=status,
        ended=time.time(),
        replicas=[_handle_json(h) for h in handles],
        metrics_chunks={str(k): v for k, v in collector.consumed.items()},
    )
    if config.logging.report:
        summary, _ = write_report(folder)
        return summary
    from composer_replication.run.metrics import read_metrics

    return summarize(read_metrics(folder.metrics))


def _save_remote_logs(
    executor: ServerlessExecutor, handles: list[ReplicaHandle], folder: RunFolder
) -> None:
    """Remote backends keep logs elsewhere: fetch each replica's log into logs/."""
    for handle in handles:
        location = handle.log_location or ""
        if location and Path(location).is_file() and folder.logs in Path(location).parents:
            continue
        try:
            text = executor.logs(handle)
        except Exception as exc:  # a log that cannot be fetched must not hide the run's result
            text = f"<log unavailable: {type(exc).__name__}: {exc}>\n"
        folder.logs.mkdir(parents=True, exist_ok=True)
        (folder.logs / f"replica-{handle.replica_id}-{handle.job_id}.log").write_text(text)


def summary_text(
    folder: RunFolder,
    status: str,
    summary: dict[str, Any],
    config: RunConfig,
    wall: float | None = None,
    restarts: int = 0,
    *,
    lost: int = 0,
    attempts: list[float] | None = None,
) -> str:
    """The lines `train` prints at the end (headline numbers and where to look). `attempts`:
    the wall seconds of each launch of a resumed run (`wall` is their sum)."""
    per_attempt = ""
    if attempts and len(attempts) > 1:
        per_attempt = (
            f" over {len(attempts)} attempts ({' + '.join(f'{a:.1f}' for a in attempts)} s)"
        )
    lines = [
        f"Run {folder.name}: {status}"
        + (f", {lost} replica{'s' if lost != 1 else ''} lost" if lost else "")
        + (f" after {wall:.1f} s{per_attempt}" if wall is not None else "")
        + f" ({config.backend.n_replicas} replicas, {summary.get('rounds', 0)} outer rounds, "
        f"{summary.get('steps', 0)} inner steps each"
        + (f", {restarts} replica restart{'s' if restarts != 1 else ''}" if restarts else "")
        + ")",
    ]
    lines += headline_lines(summary, eval_n=min(config.train.eval_max_examples, config.task.n_eval))
    # what the replicas trained on, right under the headline (report.device_lines)
    lines[1:1] = [f"  device           {line}" for line in summary.get("devices") or []]
    final = folder.checkpoints / "final"
    if final.is_dir():
        lines.append(f"  checkpoint       {final}")
    if folder.summary.is_file():
        lines.append(f"  report           {folder.summary}  (plots in {folder.plots}/)")
    lines.append(f"  metrics          {folder.metrics}  (tensorboard --logdir {folder.root})")
    if status != "finished":
        lines.append(f"  logs             {folder.logs}/")
        lines.append(f"  continue with    composer-replication train --resume {folder.root}")
    return "\n".join(lines)
