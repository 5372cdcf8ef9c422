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
continue (by default they can: the quorum is all replicas but one); when they then finish,
the run is "finished, N replicas lost" (exit 0). A replica that stops on a round that can never
commit, or whose committed update it refused (run/supervision.py `no_quorum`), is not restarted:
the run stops with exit 3, health `critical` naming the round and the refusals.
Every launch writes the next run generation to the store (exchange/fencing.py) and hands it to
its replicas: replicas of an older launch stop before writing anything. `--resume` refuses to
start while replicas of the run still send fresh heartbeats after being fenced. Ctrl-C cancels
every replica. What the run's outer-loop mode needs beside the replicas, the driver runs for the
run's lifetime: a torchft lighthouse on 127.0.0.1 (``diloco.manager = "torchft"`` without
``diloco.lighthouse``; its address goes to the replicas as $TORCHFT_LIGHTHOUSE), or the
decoupled synchronizer (run/synchronizer_process.py). Everything the driver runs is built in
assembly/ (the executor, the lighthouse, the chaos injector and its S3 proxy); the driver
starts, watches (run/supervision.py) and stops it. With ``[security] sign``
the driver makes the run's keys, publishes the signed key manifest and config signature, and
hands each replica only its own private key through the executor's secret mechanism
(run/security.py); every run hands each replica the run's slot secret the same way (where each
rank's uploads go).
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
from types import FrameType
from typing import TextIO

from composer_replication.assembly.outer import build_lighthouse, outer_loop_mode
from composer_replication.assembly.services import (
    build_chaos,
    build_executor,
    build_proxy,
    forwarded_env,
)
from composer_replication.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    dump_toml,
    from_dict,
    to_dict,
)
from composer_replication.diloco.mode_protocol import Lighthouse, OuterLoopMode
from composer_replication.diloco.replica_state import resume_plan
from composer_replication.exchange.fencing import bump_generation
from composer_replication.exchange.liveness import clear_departure
from composer_replication.exchange.signing import KEY_ENV
from composer_replication.exchange.store import ObjectStore
from composer_replication.executors import registry
from composer_replication.executors.executor import Releasable, ReplicaHandle, ServerlessExecutor
from composer_replication.faults.injector import ChaosInjector, ProcessTargets
from composer_replication.faults.proxy import ThrottleProxy
from composer_replication.json_types import JSONDict, as_dict, as_float, as_int, as_list, as_number
from composer_replication.run import preflight
from composer_replication.run.checkpoint import mirror_checkpoints
from composer_replication.run.expected import expected_lines
from composer_replication.run.folder import RunFolder, claim_store, default_run_name
from composer_replication.run.metrics import (
    MetricsCollector,
    MetricsSink,
    mark_resume,
    read_metrics,
)
from composer_replication.run.processes import pid_alive
from composer_replication.run.progress import Progress, ReplicaRow, choose_mode
from composer_replication.run.replica_env import ENV_GENERATION, ENV_STORAGE_OPTIONS
from composer_replication.run.report import (
    closed_attempts,
    headline_lines,
    run_wall_seconds,
    summarize,
    wall_text,
    write_report,
)
from composer_replication.run.security import (
    SLOT_SECRET_ENV,
    RunSecrets,
    prepare_signing,
    slot_secret,
    writer_secrets,
)
from composer_replication.run.supervision import (
    EXIT_RUN_NO_QUORUM,
    Departures,
    HealthLog,
    RefusalLog,
    Restarter,
    fence_previous_launch,
    final_status,
    no_quorum,
)
from composer_replication.run.synchronizer_process import SynchronizerProcess

__all__ = ["ENTRYPOINT", "TrainResult", "prepare", "prepare_resume", "run"]

ENTRYPOINT = "composer_replication.run.replica"


@dataclass
class TrainResult:
    folder: RunFolder
    exit_code: int
    status: str
    summary: JSONDict


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
        raise ConfigError(
            f"--resume: no run folder {folder.root} (give a run folder or the name "
            "of one under runs/)"
        )
    if not folder.is_run():
        raise ConfigError(f"--resume: {folder.root} is not a run folder (no config.json in it)")
    state = folder.read_driver()
    if state.get("status") == "running" and state.get("host") == socket.gethostname():
        pid = as_int(state.get("pid") or 0)
        if pid > 0 and pid_alive(pid):
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
    uri, note = folder.stored_store_uri(config.store.uri)
    if note is not None:
        print(f"note: {note}", file=sys.stderr, flush=True)
    config = dataclasses.replace(config, store=dataclasses.replace(config.store, uri=uri))
    store_uri = preflight.check_all(config, folder, resume=True)
    config = dataclasses.replace(config, store=dataclasses.replace(config.store, uri=store_uri))
    return config, folder


def _rollback_for_resume(config: RunConfig, store: ObjectStore, mode: OuterLoopMode) -> int | None:
    """The round every replica resumes from exactly, the store rolled back to it, where the
    mode has one (`OuterLoopMode.rollback_for_resume`); None otherwise."""

    def warn(line: str) -> None:
        print(f"warning: {line}", file=sys.stderr, flush=True)

    return mode.rollback_for_resume(store, config.backend.n_replicas, warn)


def _release(executor: ServerlessExecutor) -> None:
    """Shut the executor down if it holds something (a Ray it started): the run is over."""
    if isinstance(executor, Releasable):
        executor.shutdown()


def _rows(
    config: RunConfig, handles: list[ReplicaHandle], statuses: dict[int, JSONDict]
) -> list[ReplicaRow]:
    rows = []
    now = time.time()
    for handle in handles:
        status = statuses.get(handle.replica_id, {})
        state = str(status.get("state", "starting"))
        if handle.status.done:
            state = str(handle.status.value)
        updated = as_number(status.get("updated"))
        rows.append(
            ReplicaRow(
                rank=handle.replica_id,
                state=state,
                step=as_int(status.get("step") or 0),
                max_steps=as_int(status.get("max_steps") or config.train.max_steps),
                round=as_int(status.get("round") or 0),
                reward=as_number(status.get("reward")),
                eval_accuracy=as_number(status.get("eval_accuracy")),
                seconds_since_update=None if updated is None else max(0.0, now - updated),
            )
        )
    return rows


def _handle_json(handle: ReplicaHandle) -> JSONDict:
    out = dataclasses.asdict(handle)
    out["status"] = str(handle.status.value)
    return out


class _Services:
    """What the driver runs beside the replicas for the run's outer-loop mode and its chaos
    schedule (each built in assembly/ or, the synchronizer's process, here)."""

    def __init__(
        self,
        config: RunConfig,
        folder: RunFolder,
        mode: OuterLoopMode,
        env: dict[str, str],
        signing: RunSecrets | None = None,
    ) -> None:
        self.lighthouse: Lighthouse | None = build_lighthouse(config)
        if self.lighthouse is not None:  # the replicas dial it
            env.update(self.lighthouse.env)
        self.proxy: ThrottleProxy | None = build_proxy(config)
        if self.proxy is not None:  # the replicas and the synchronizer go through it
            options = {**config.store.storage_options, "endpoint_url": self.proxy.endpoint}
            env[ENV_STORAGE_OPTIONS] = json.dumps(options)
        self.synchronizer: SynchronizerProcess | None = None
        service = mode.driver_service()
        if service is not None:  # the mode's service, hosted here (its own process)
            log = folder.logs / f"{service.name}.log"
            sync_env = dict(env)
            sync_env.update(slot_secret(folder))  # checks the run generation's MAC (fencing.py)
            if signing is not None:  # its own key, to it only (never in the replicas' env)
                sync_env[KEY_ENV] = signing.private[service.identity]
            self.synchronizer = SynchronizerProcess(config.store.uri, sync_env, log)
            self.synchronizer.start()

    def stop_outer(self) -> None:
        """Stop the synchronizer and the proxy (once)."""
        if self.synchronizer is not None:
            self.synchronizer.stop()
            self.synchronizer = None
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None

    def stop(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None
        self.stop_outer()


@dataclass
class _Launch:
    """One launch of a run, from its replicas' launch to the end: what the driver watches."""

    config: RunConfig
    folder: RunFolder
    store: ObjectStore
    executor: ServerlessExecutor
    mode: OuterLoopMode
    progress: Progress
    sink: MetricsSink
    collector: MetricsCollector
    env: dict[str, str]
    secrets: dict[int, dict[str, str]]
    services: _Services
    stream: TextIO
    signing: RunSecrets | None = None
    handles: list[ReplicaHandle] = dataclasses.field(default_factory=list)


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
    executor = build_executor(config, folder.logs)
    mode = outer_loop_mode(config)
    generation, resumed_at = _claim_store(config, folder, store, mode, resume, overwrite, stream)
    config_doc = _publish_config(config, folder, store)
    signing = prepare_signing(config, folder, store, config_doc)
    t_start = time.monotonic()
    launch = _open(config, folder, store, executor, mode, stream, generation, signing)
    _announce(launch, resume, resumed_at)
    stop, restore_signals = _install_stop_handlers()
    try:
        launch.handles = executor.launch_replicas(
            config.backend.n_replicas,
            ENTRYPOINT,
            {"rendezvous": config.store.uri},
            env=launch.env,
            resources=dict(config.backend.resources) or None,
            secrets=launch.secrets,
        )
    except Exception as exc:  # the executor cancelled whatever it had started
        restore_signals()
        return _launch_failed(launch, exc)
    watch = _Watch(launch)
    status = _watch(launch, watch, stop, poll_interval)
    return _end(launch, watch, status, restore_signals, t_start)


def _claim_store(
    config: RunConfig,
    folder: RunFolder,
    store: ObjectStore,
    mode: OuterLoopMode,
    resume: bool,
    overwrite: bool,
    stream: TextIO,
) -> tuple[int, int | None]:
    """Create the run folder (a fresh run), fence every earlier launch (a new run generation)
    and, on resume, roll the store back to the newest exact resume point: (generation, the
    round resumed at or None)."""
    if not resume:
        folder.create(overwrite=overwrite)
        if overwrite and store.exists(""):  # preflight checked it is not another run's
            store.delete_prefix("")  # a stale run in an explicit store would be resumed otherwise
    claim_store(store, folder)  # whose store this is: `--overwrite` of another run refuses it
    try:
        # replicas of an earlier launch are fenced from now (MACed: a planted one fences none)
        secret = bytes.fromhex(slot_secret(folder)[SLOT_SECRET_ENV])
        generation = bump_generation(store, secret)
    except ValueError as exc:
        raise ConfigError(f"{config.store.uri}: {exc}; delete that object to resume") from None
    if resume:  # fenced and stopped before the rollback rewrites the store under them
        fence_previous_launch(store, generation, lambda m: print(m, file=stream, flush=True))
    resumed_at = _rollback_for_resume(config, store, mode) if resume else None
    for role in mode.departure_roles:  # a new launch: every rank is expected
        for rank in range(config.backend.n_replicas):
            clear_departure(store, role, rank)
    return generation, resumed_at


def _publish_config(config: RunConfig, folder: RunFolder, store: ObjectStore) -> JSONDict:
    """The resolved config in the run folder and, exactly as the replicas will read it, in the
    store; returns that document."""
    # the folder's own store is recorded as "" (a copied folder, or its config.toml loaded for
    # a new run, then names its own store, never this one)
    recorded = folder.recorded_store_uri(config.store.uri)
    config = dataclasses.replace(config, store=dataclasses.replace(config.store, uri=recorded))
    folder.config_toml.write_text(dump_toml(config))
    folder.config_json.write_text(json.dumps(to_dict(config), indent=1))
    config_doc: JSONDict = json.loads(json.dumps(to_dict(config)))
    store.put_json("run_config.json", config_doc)
    return config_doc


def _open(
    config: RunConfig,
    folder: RunFolder,
    store: ObjectStore,
    executor: ServerlessExecutor,
    mode: OuterLoopMode,
    stream: TextIO,
    generation: int,
    signing: RunSecrets | None,
) -> _Launch:
    """The driver's state, display, metrics and the replicas' environment for this launch; the
    services of the run's mode are started."""
    damage = folder.driver_damage()
    state = folder.read_driver()  # damaged: its backup keeps the earlier attempts
    # The earlier attempts' wall times (one killed mid-run counts until its last update).
    folder.update_driver(
        status="running",
        attempt=as_int(state.get("attempt", 0)) + 1,
        attempts=closed_attempts(state),
        started=time.time(),
        ended=None,
        updated=None,
        pid=os.getpid(),
        host=socket.gethostname(),
    )
    # None: the mode has no fixed number of rounds (decoupled mode counts the synchronizer's
    # global versions, one per merge, any number of them per H steps).
    n_rounds = mode.n_rounds(config.train.max_steps)
    progress = Progress(
        choose_mode(config.logging.progress, stream),
        title=f"run {folder.name}",
        n_rounds=n_rounds,
        stream=stream,
    )
    sink = MetricsSink(folder.metrics, folder.tensorboard if config.logging.tensorboard else None)
    for why in (damage, sink.healed):  # said once; the run goes on
        if why:
            print(f"warning: {why}", file=stream, flush=True)
    consumed = {int(k): as_int(v) for k, v in as_dict(state.get("metrics_chunks")).items()}
    collector = MetricsCollector(store, config.backend.n_replicas, sink, consumed)
    env = {
        ENV_STORAGE_OPTIONS: json.dumps(config.store.storage_options),
        ENV_GENERATION: str(generation),
        "TOKENIZERS_PARALLELISM": "false",
        **config.backend.env,
    }
    if not registry.backend(config.backend.kind).forward_env_as_secrets:
        env.update(forwarded_env(config))
    if config.train.torch_threads > 0:
        env.setdefault("OMP_NUM_THREADS", str(config.train.torch_threads))
    if signing is not None:  # every replica: the driver's public key; rank r: its own key only
        env.update(signing.env)
        secrets = signing.per_rank(config.backend.n_replicas)
    else:  # rank r: its own writer secret (a restarted replica recognises its earlier upload)
        secrets = writer_secrets(folder, config.backend.n_replicas)
    slot = slot_secret(folder)  # every rank: where each rank's uploads go (security.py)
    secrets = {r: {**s, **slot} for r, s in secrets.items()}
    services = _Services(config, folder, mode, env, signing)
    return _Launch(
        config,
        folder,
        store,
        executor,
        mode,
        progress,
        sink,
        collector,
        env,
        secrets,
        services,
        stream,
        signing,
    )


def _announce(launch: _Launch, resume: bool, resumed_at: int | None) -> None:
    config, progress = launch.config, launch.progress
    progress.message(
        f"{'Resuming' if resume else 'Starting'} run {launch.folder.root} "
        f"({config.backend.n_replicas} x {config.backend.kind} replicas, model "
        f"{config.model.name}, task {config.task.name}, {config.train.max_steps} inner steps, "
        f"sync every {config.diloco.sync_every_h})"
    )
    if resumed_at is not None:
        plan = resume_plan(resumed_at)
        progress.message(plan[:1].upper() + plan[1:])
        # the crashed launch's last metric chunks, then its redone steps flagged
        launch.collector.poll()
        mark_resume(
            launch.folder.metrics,
            launch.sink,
            resumed_round=resumed_at,
            redo_after_step=resumed_at * config.diloco.sync_every_h,
            n_replicas=config.backend.n_replicas,
        )
    if not resume:
        for line in expected_lines(config):  # the embedded default's measured ranges
            progress.message(line)


def _launch_failed(launch: _Launch, exc: Exception) -> TrainResult:
    _release(launch.executor)
    launch.services.stop()
    launch.progress.close()
    launch.sink.close()
    message = f"launching the replicas failed: {type(exc).__name__}: {exc}"
    launch.folder.update_driver(status="failed", ended=time.time(), error=message)
    print(message, file=launch.stream, flush=True)
    return TrainResult(folder=launch.folder, exit_code=1, status="failed", summary={})


def _watch(launch: _Launch, watch: _Watch, stop: threading.Event, poll_interval: float) -> str:
    """Poll until every replica ended, one failed (where the mode stops on a loss), the user
    stopped the run or ``backend.timeout_s`` passed; the run's status."""
    config, handles, executor = launch.config, launch.handles, launch.executor
    deadline = time.monotonic() + config.backend.timeout_s
    try:
        while True:
            status = watch.tick(stop.is_set())
            if status is None and stop.is_set():
                executor.cancel(handles)
                status = "interrupted"
            if status is None and time.monotonic() > deadline:
                executor.cancel(handles)
                status = "timeout"
                launch.progress.message(f"backend.timeout_s={config.backend.timeout_s:g} reached")
            if status is not None:
                return status
            stop.wait(poll_interval)
    except KeyboardInterrupt:
        executor.cancel(handles)
        return "interrupted"
    finally:
        launch.progress.close()


class _Watch:
    """What watches the replicas of a launch (restarts, departures, health, the chaos
    schedule), one poll at a time (`tick`)."""

    def __init__(self, launch: _Launch) -> None:
        config, mode, store = launch.config, launch.mode, launch.store
        n = config.backend.n_replicas
        sync = launch.services.synchronizer
        targets = ProcessTargets(launch.executor, launch.handles, sync)
        self.launch = launch
        self.injector = build_chaos(
            config,
            targets,
            store,
            launch.services.proxy,
            (lambda: sync.pid) if sync is not None else None,
        )
        self.restarter = Restarter(config, launch.executor, ENTRYPOINT, launch.env, launch.secrets)
        slot = bytes.fromhex(slot_secret(launch.folder)[SLOT_SECRET_ENV])
        self.departures = Departures(config, mode, store, secret=slot)
        self.health = HealthLog(mode, n, store, launch.sink)
        keys = launch.signing.keys if launch.signing is not None else None
        self.refusals = RefusalLog(
            mode.refusal_sources(store, keys), launch.sink, launch.folder.metrics
        )
        self.after_loss = mode.after_loss(n)
        self.last_mirror = 0.0
        self.no_quorum: JSONDict | None = None  # the round that can never commit

    def tick(self, stopping: bool) -> str | None:
        """Poll once; the run's final status once it is decided, else None."""
        launch, handles = self.launch, self.launch.handles
        launch.executor.poll(handles)
        stuck = no_quorum(handles, launch.collector.statuses)
        if stuck is not None:  # neither restarted nor trained on: the run stops, saying why
            self.no_quorum = stuck
            launch.executor.cancel(handles)
            reason = str(stuck["reason"])
            launch.folder.update_driver(no_quorum=stuck, error=reason)
            self.health.critical(reason)
            launch.progress.message(f"stopping the run: {stuck['reason']}")
            return "failed"
        if not stopping:
            for message in (
                *self.departures.note(handles, self.restarter),
                *self.departures.note_silent(handles),
                *self.restarter.restart_failed(handles),
            ):
                launch.progress.message(message)
        self._services()
        self.health.poll()
        self.refusals.poll()
        launch.collector.poll()
        statuses = launch.collector.statuses()
        if _chaos_due(self.injector, statuses, len(handles)):
            assert self.injector is not None
            self.injector.start()
            launch.progress.message(
                f"chaos: {len(launch.config.chaos.events)} events scheduled from now"
            )
        launch.progress.update(_rows(launch.config, handles, statuses))
        self._record()
        failed = [h for h in handles if h.status.value == "failed"]
        if failed and self.after_loss == "stop":
            launch.executor.cancel(handles)
            for h in failed:
                launch.progress.message(f"replica {h.replica_id} failed: {h.error}")
            return "failed"
        if all(h.status.done for h in handles):
            return final_status(launch.mode, handles, launch.config.backend.n_replicas)
        return None

    def _services(self) -> None:
        """Keep the synchronizer running; replicas that failed for good are released."""
        launch = self.launch
        if launch.services.synchronizer is None:
            return
        launch.services.synchronizer.ensure_running()
        failed = {
            h.replica_id: str(h.error or "") for h in launch.handles if h.status.value == "failed"
        }
        keys = launch.signing.keys if launch.signing is not None else None
        launch.mode.release_failed(launch.store, failed, launch.config.train.max_steps, keys)

    def _record(self) -> None:
        """Mirror checkpoints (a local store: a disk copy; a remote store's are downloaded once,
        at the end) and save the driver's view of the replicas."""
        launch = self.launch
        if launch.store.is_local and time.monotonic() - self.last_mirror > 5.0:
            mirror_checkpoints(launch.store, launch.folder.checkpoints)
            self.last_mirror = time.monotonic()
        launch.folder.update_driver(
            replicas=[_handle_json(h) for h in launch.handles],
            metrics_chunks={str(k): v for k, v in launch.collector.consumed.items()},
            updated=time.time(),
        )


def _end(
    launch: _Launch, watch: _Watch, status: str, restore_signals: Callable[[], None], t_start: float
) -> TrainResult:
    """After the replicas ended: stop the services, check the chaos run, gather everything."""
    config, folder = launch.config, launch.folder
    if watch.injector is not None:
        watch.injector.stop()
    chaos = _chaos_report(launch, watch.injector, status)
    launch.services.stop_outer()
    if status == "finished":
        status = _check_end(launch, watch)
    watch.health.poll(force=True)
    watch.refusals.poll(force=True)
    try:
        summary = _finish(launch, status)
    except KeyboardInterrupt:  # a second Ctrl-C while gathering: keep what is there
        status = "interrupted"
        folder.update_driver(status=status, ended=time.time())
        summary = {}
    finally:
        restore_signals()
        launch.services.stop()
        _release(launch.executor)
    if chaos is not None:
        summary["chaos_ok"] = chaos["ok"]
        if not chaos["ok"] and status == "finished":
            status = "failed"
            folder.update_driver(status=status, error="chaos check failed: see chaos.json")
    exit_code = {"finished": 0, "interrupted": 130}.get(status, 1)
    if status == "failed" and watch.no_quorum is not None:
        exit_code = EXIT_RUN_NO_QUORUM
    # one wall time everywhere: driver start to end of training, summed over the run's attempts
    # (a resumed run's earlier launches count), as summary.md shows it
    attempts = closed_attempts(folder.read_driver())
    folder.update_driver(attempts=attempts)
    wall = run_wall_seconds(folder.read_driver())
    if wall is None:
        wall = time.monotonic() - t_start
    folder.update_driver(wall_seconds=wall)
    restarts = sum(h.restarts for h in launch.handles)
    lost = [h.replica_id for h in launch.handles if h.status.value == "failed"]
    folder.update_driver(lost=lost)
    print(
        summary_text(
            folder,
            status,
            summary,
            config,
            wall,
            restarts,
            lost=len(lost),
            attempts=[as_float(a["seconds"]) for a in attempts],
        ),
        file=launch.stream,
        flush=True,
    )
    return TrainResult(folder=folder, exit_code=exit_code, status=status, summary=summary)


def _check_end(launch: _Launch, watch: _Watch) -> str:
    """Before a run reports success: its last round must be in the store (the mode's
    `end_of_run_problem`); otherwise the run fails with the reason in driver.json, `status`
    (critical) and metrics.jsonl (an "incomplete" event and a health record)."""
    config, mode = launch.config, launch.mode
    problem = mode.end_of_run_problem(
        launch.store, config.backend.n_replicas, config.train.max_steps
    )
    if problem is None:
        return "finished"
    last = mode.n_rounds(config.train.max_steps)
    launch.folder.update_driver(
        no_quorum={"round": last, "rejected": {}, "reason": problem}, error=problem
    )
    record: JSONDict = {
        "time": time.time(),
        "replica": -1,
        "kind": "event",
        "step": 0,
        "round": last or 0,
    }
    launch.sink.write([{**record, "event": "incomplete", "reason": problem}])
    watch.health.critical(problem)
    launch.progress.message(f"the run is not complete: {problem}")
    return "failed"


def _chaos_due(injector: ChaosInjector | None, statuses: dict[int, JSONDict], n: int) -> bool:
    """The schedule starts once every replica reports it trains (times count from then)."""
    if injector is None or injector.started:
        return False
    return len(statuses) == n and all(
        s.get("state") not in (None, "starting") for s in statuses.values()
    )


def _chaos_report(launch: _Launch, injector: ChaosInjector | None, status: str) -> JSONDict | None:
    """After a chaos run: the mode's checks over the store (`OuterLoopMode.check_chaos`, when
    the run finished) and <run>/chaos.json."""
    if injector is None:
        return None
    report: JSONDict = {"events": injector.log, "ok": status == "finished"}
    kills = [e for e in injector.log if e.get("action") == "kill"]
    check = launch.mode.check_chaos(launch.store, kills) if status == "finished" else None
    if check is not None:
        report["check"] = check
        report["ok"] = bool(check["ok"])
    (launch.folder.root / "chaos.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def _install_stop_handlers() -> tuple[threading.Event, Callable[[], None]]:
    """Ctrl-C / SIGTERM set a flag the monitoring loop acts on (cancel every replica, then
    gather what there is); a second one raises KeyboardInterrupt. A flag rather than an
    exception at an arbitrary point: an exception in the middle of an import would leave a
    half-initialised module behind. Returns (flag, restore)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop, lambda: None

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return stop, restore


def _finish(launch: _Launch, status: str) -> JSONDict:
    """After the replicas ended: last metrics, checkpoints, logs, driver state, report."""
    folder = launch.folder
    launch.collector.poll()
    mirror_checkpoints(launch.store, folder.checkpoints)
    _save_remote_logs(launch.executor, launch.handles, folder)
    launch.sink.close()
    folder.update_driver(
        status=status,
        ended=time.time(),
        replicas=[_handle_json(h) for h in launch.handles],
        metrics_chunks={str(k): v for k, v in launch.collector.consumed.items()},
    )
    if launch.config.logging.report:
        summary, _ = write_report(folder)
        return summary
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
    summary: JSONDict,
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
    lines[1:1] = [f"  device           {line}" for line in as_list(summary.get("devices"))]
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
