"""What a replica does once its arguments check out (run/replica.py): read the run config from
the store, build its parts from it (assembly/), train inside the outer loop of the run's mode,
report to the store.

`start` loads the run configuration (the driver's ``run_config.json``; launched directly, its
own from ``--config`` and overrides, published put-if-absent), this rank's signing keys or
writer secret and its launch's run generation (any of them unusable: exit code 2), then calls
`run_replica`, which sequences what `assembly.build_*` built: fence, status, heartbeat, task,
model, outer loop, trainer, reporter.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import torch
from torch import nn
from transformers import set_seed

from composer_replication.assembly.build import build_model, build_task, build_trainer
from composer_replication.assembly.outer import build_outer_loop, outer_loop_mode
from composer_replication.assembly.services import build_heartbeat
from composer_replication.config import ConfigError, RunConfig, from_dict, load_config, to_dict
from composer_replication.diloco.heartbeat import HeartbeatWriter
from composer_replication.diloco.mode_protocol import OuterLoop, ReplicaLoop
from composer_replication.exchange.fencing import Fence, FencedError, read_generation
from composer_replication.exchange.liveness import clear_departure, write_departure
from composer_replication.exchange.protocol import CorruptContributionError
from composer_replication.exchange.signing import RunKeys, rank_identity
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.vocabulary import RoundStoppedError
from composer_replication.json_types import JSONDict
from composer_replication.run.checkpoint import committed_checkpoints
from composer_replication.run.metrics import ReplicaMetricsWriter
from composer_replication.run.replica_env import (
    CONFIG_KEY,
    ENV_GENERATION,
    EXIT_FENCED,
    EXIT_NO_QUORUM,
    EXIT_UNUSABLE,
)
from composer_replication.run.reporter import ReplicaReporter
from composer_replication.run.security import (
    participant_keys,
    slot_secret_from_env,
    writer_secret_from_env,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer

    from composer_replication.tasks import Task
    from composer_replication.trainer import ComposerReplicationTrainer

__all__ = ["run_replica", "start", "weights_digest"]


def _exit_fenced(rank: int, exc: FencedError) -> NoReturn:
    """A newer launch owns the run (seen by the heartbeat thread): stop at once, writing
    nothing more."""
    print(f"replica {rank}: {exc}", file=sys.stderr, flush=True)
    os._exit(EXIT_FENCED)


def run_replica(
    config: RunConfig,
    rank: int,
    uri: str,
    storage_options: JSONDict,
    keys: RunKeys | None = None,
    writer_secret: bytes | None = None,
    generation: int | None = None,
    slot_secret: bytes | None = None,
) -> int:
    """Train this replica of the run (see the module docstring); returns the exit code.

    ``keys``: this rank's signing keys (signed runs); ``writer_secret``: its writer secret
    (unsigned runs; see `run.security.writer_secrets`); ``slot_secret``: the run's slot secret
    (`run.security.slot_secret`); ``generation``: the run generation of
    its launch (None: the store's current one), checked before every write."""
    store = ObjectStore(uri, storage_options)
    fence = Fence(
        store,
        read_generation(store) if generation is None else generation,
        secret=slot_secret,  # a planted run_generation.json cannot fence the run's replicas
    )
    store.write_guard = fence
    try:
        fence()
    except FencedError as exc:
        print(f"replica {rank}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FENCED
    writer = ReplicaMetricsWriter(store, rank, flush_every_s=config.logging.flush_every_s)
    writer.status(state="starting", step=0, round=0, max_steps=config.train.max_steps, force=True)
    heartbeat = build_heartbeat(config, store, rank, lambda exc: _exit_fenced(rank, exc))
    loop: ReplicaLoop | None = None
    try:
        if config.train.torch_threads > 0:
            torch.set_num_threads(config.train.torch_threads)
        task = build_task(config)
        model, tok = build_model(config)
        loop = build_outer_loop(
            config,
            rank,
            store,
            model,
            tok,
            task,
            keys=keys,
            writer_secret=writer_secret,
            slot_secret=slot_secret,
            fence=fence,
        )
        heartbeat.fields = loop.heartbeat
        if _train(_Replica(config, rank, store, loop, task, model, tok, writer)):
            heartbeat.close("done")
        return 0
    except FencedError as exc:  # a newer launch owns the run: leave without another write
        heartbeat.close()
        print(f"replica {rank}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FENCED
    except RoundStoppedError as exc:  # a round that cannot commit or be applied: the run stops
        refused = {str(r): why for r, why in sorted(exc.rejected.items())}
        writer.status(stopped_round=exc.step, stopped_refusals=refused)
        _report_failure(writer, heartbeat, exc)
        print(f"replica {rank}: round {exc.step} stops the run: {exc}", file=sys.stderr, flush=True)
        return EXIT_NO_QUORUM
    except BaseException as exc:
        _report_failure(writer, heartbeat, exc)
        raise
    finally:
        if fence.tripped is None:
            writer.flush()
        heartbeat.close()
        if loop is not None:
            loop.close()


def _report_failure(
    writer: ReplicaMetricsWriter, heartbeat: HeartbeatWriter, exc: BaseException
) -> None:
    """The replica's status and heartbeat say it failed, and why (not once fenced meanwhile:
    the failure is then reported in the log only)."""
    try:
        writer.status(
            state="failed",
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc()[-4000:],
        )
        writer.flush()
        heartbeat.close("failed")
    except FencedError:
        heartbeat.close()


@dataclass
class _Replica:
    """What a built replica is made of (the parts `_train` sequences)."""

    config: RunConfig
    rank: int
    store: ObjectStore
    loop: ReplicaLoop
    task: Task
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    writer: ReplicaMetricsWriter


def _train(r: _Replica) -> bool:
    """Train the remaining inner steps inside the outer loop; False when there were none (a
    resumed run that had finished)."""
    config, rank, store, loop, writer = r.config, r.rank, r.store, r.loop, r.writer
    mode = outer_loop_mode(config)
    start_round = loop.start_round
    start = loop.resume(config.train.max_steps)  # the mode's resume state, if it has one
    start_step, resume_state = start.step, start.state
    remaining = config.train.max_steps - start_step
    writer.log(
        "event",
        step=start_step,
        round=start_round,
        event="start",
        resumed_round=start_round,
        resumed_step=start_step,
        exact=start_step == 0 or resume_state is not None,
        **start.fields,
    )
    reporter = _reporter(r, last_round=mode.n_rounds(config.train.max_steps))
    if remaining <= 0:
        _finish_without_training(loop.outer, r.model, reporter, writer, start_step)
        return False
    # Different sampling per replica; a fresh start and an exact resume share one stream
    # (the resume state carries its RNG states). A relaunch without a resume state (of its
    # round; a decoupled learner: of a push) continues from the global weights with fresh
    # inner state and a new sampling stream.
    fresh = start_step == 0 or resume_state is not None
    seed = config.run.seed + 1000 * rank + (0 if fresh else start_round + start_step)
    set_seed(seed)
    with tempfile.TemporaryDirectory(prefix=f"composer-replica{rank}-") as scratch:
        trainer = build_trainer(
            config,
            model=r.model,
            tokenizer=r.tokenizer,
            task=r.task,
            seed=seed,
            max_steps=config.train.max_steps,
            output_dir=scratch,
            rank=rank,
            callbacks=[loop.outer.callback(), reporter],
        )
        # what this replica trains on, for the run summary (report.device_lines)
        device = device_record(trainer, config.train.generation)
        writer.log("event", step=start_step, round=start_round, event="device", **device)
        # after the trainer's own callbacks (TAID, EMA), so it sees the step's final state
        trainer.add_callback(loop.state_writer(trainer, writer.flush))
        for role in mode.departure_roles:  # ready: the peers wait for this rank again
            clear_departure(store, role, rank)
        # The trainer counts the run's steps: its step, LR schedule and TAID schedule
        # continue at start_step (exactly, with the resume state).
        _run_trainer(trainer, reporter, resume_state, start_step)
    # The model now holds the global weights (the DiLoCo callback loaded them): their
    # digest lets anyone check that every replica ended on the same model.
    writer.log(
        "event",
        step=config.train.max_steps,
        round=loop.outer.round,
        event="global_weights",
        sha256=weights_digest(r.model),
    )
    for role in mode.departure_roles:  # a peer still behind need not wait for this rank
        write_departure(
            store, role, rank, reason="finished training", secret=slot_secret_from_env()
        )
    return True


def _run_trainer(
    trainer: ComposerReplicationTrainer,
    reporter: ReplicaReporter,
    resume_state: dict[str, object] | None,
    start_step: int,
) -> None:
    """Train from the resume state (exact) or from ``start_step``; a round that stops the run
    has its record and refusals logged before the replica stops."""
    try:
        if resume_state is not None:
            trainer.resume_train(resume_state)
        else:
            trainer.train_from_step(start_step)
    except RoundStoppedError:
        reporter.log_new_rounds(int(trainer.state.global_step))
        raise


def _reporter(r: _Replica, *, last_round: int | None) -> ReplicaReporter:
    """The replica's metrics, evaluations and checkpoints (`run/reporter.py`)."""
    config = r.config
    n_eval = min(config.train.eval_max_examples, config.task.n_eval)
    return ReplicaReporter(
        writer=r.writer,
        store=r.store,
        outer=r.loop.outer,
        begin_fields=r.loop.begin_fields,
        rank=r.rank,
        max_steps=config.train.max_steps,
        tokenizer=r.tokenizer,
        task=r.task,
        eval_examples=r.task.eval_examples()[:n_eval],
        eval_every_rounds=config.train.eval_every_rounds,
        max_new_tokens=config.train.max_completion_length,
        checkpoint_every_rounds=config.checkpoint.every_rounds,
        keep_last=config.checkpoint.keep_last,
        save_final=config.checkpoint.save_final,
        last_round=last_round,
        ood_examples=r.task.ood_examples(n_eval) if n_eval and r.task.has_ood() else None,
    )


def device_record(trainer: Trainer, generation: str) -> JSONDict:
    """What a trainer trains on: the device (and the GPU's name), the parameters' dtype, the
    autocast dtype (TRL's ``bf16`` / ``fp16`` mixed precision, else none), gradient
    checkpointing and the rollout engine (`[train] generation`)."""
    model = trainer.model
    if model is None:
        raise ValueError("device_record needs a trainer with its model")
    param = next(model.parameters())
    device = param.device
    name = ""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    args = trainer.args
    autocast = "bfloat16" if args.bf16 else "float16" if args.fp16 else "none"
    return {
        "device": str(device),
        "device_name": name,
        "param_dtype": str(param.dtype).removeprefix("torch."),
        "autocast": autocast,
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "generation": generation,
    }


def weights_digest(model: nn.Module) -> str:
    """sha256 over the model's named parameters (names, dtypes, shapes and bytes, in order)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _finish_without_training(
    outer: OuterLoop,
    model: PreTrainedModel,
    reporter: ReplicaReporter,
    writer: ReplicaMetricsWriter,
    step: int,
) -> None:
    """Every round is already committed (a resumed run that had finished): load the global
    weights, and let the evaluator write the final evaluation/checkpoint if it is missing."""
    outer.bind(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    has_final = any(name == "final" for name, _ in committed_checkpoints(reporter.store))
    if reporter.is_evaluator and not has_final:
        reporter.evaluate_now(model, step)
        reporter.checkpoint_now(model, step, name="final")
    writer.status(state="done", step=step, round=outer.round, force=True)


class _Unusable(Exception):
    """The arguments, the environment or the stored config cannot run a replica (exit 2)."""


def start(ns: argparse.Namespace, rank: int, uri: str, storage_options: JSONDict) -> int:
    """Load what replica ``rank`` needs from the store and its environment, then train; the
    exit code (2 when the stored config, the keys or the run generation are unusable)."""
    try:
        store = _open_store(uri, storage_options)
        doc = _config_doc(ns, store)
        config = _replica_config(doc, store, rank)
        keys, writer_secret, slot_secret = _identity(store, rank, doc, config)
        generation = _generation()
    except _Unusable as exc:
        print(f"replica: error: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    print(
        f"replica {rank}/{config.backend.n_replicas}: run {config.run.name} at {store.uri}",
        flush=True,
    )
    return run_replica(
        config,
        rank,
        store.uri,
        storage_options,
        keys=keys,
        writer_secret=writer_secret,
        generation=generation,
        slot_secret=slot_secret,
    )


def _open_store(uri: str, storage_options: JSONDict) -> ObjectStore:
    try:
        return ObjectStore(uri, storage_options)
    except ValueError as exc:  # a URI without a bucket
        raise _Unusable(str(exc)) from None


def _standalone_config(ns: argparse.Namespace) -> JSONDict:
    """The run config of a directly launched replica (no driver): its file or the embedded
    default, its overrides, backend.n_replicas from $WORLD_SIZE; as the driver stores it."""
    path = ns.config or os.environ.get("COMPOSER_CONFIG") or None
    overrides = list(ns.overrides)
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.isdigit():
        overrides.append(f"backend.n_replicas={int(world)}")
    doc: JSONDict = json.loads(json.dumps(to_dict(load_config(path, overrides))))
    return doc


def _config_doc(ns: argparse.Namespace, store: ObjectStore) -> JSONDict:
    """The stored run config; launched directly, this replica's own is published first unless
    another replica was first (then theirs is used). Waits ``--config-timeout`` for it."""
    try:
        doc = store.get_json(CONFIG_KEY)
        if doc is None and not ns.wait_for_driver:
            if store.put_json(CONFIG_KEY, _standalone_config(ns), exclusive=True):
                print(f"replica: published the run config to {store.uri}", flush=True)
            doc = store.get_json(CONFIG_KEY)
        deadline = time.monotonic() + ns.config_timeout
        while doc is None and time.monotonic() < deadline:
            time.sleep(0.5)
            doc = store.get_json(CONFIG_KEY)
    except (ValueError, ConfigError) as exc:  # a bad config or override
        raise _Unusable(str(exc)) from None
    if doc is None:
        raise _Unusable(
            f"no {CONFIG_KEY} in {store.uri} after {ns.config_timeout:g}s; start "
            "runs with `composer-replication train`"
        )
    if not isinstance(doc, dict):
        raise _Unusable(f"{CONFIG_KEY} in {store.uri} is not a JSON object")
    return dict(doc)


def _replica_config(doc: JSONDict, store: ObjectStore, rank: int) -> RunConfig:
    """The run config this replica trains with, checked against its rank and $WORLD_SIZE."""
    try:
        config = from_dict(RunConfig, doc)
    except (ValueError, ConfigError) as exc:  # a stored config this version cannot read
        raise _Unusable(f"{CONFIG_KEY} in {store.uri}: {exc}") from None
    n = config.backend.n_replicas
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.isdigit() and int(world) != n:
        raise _Unusable(f"WORLD_SIZE={world} but the run has backend.n_replicas={n}")
    # Each replica is a single-process trainer: torch.distributed / accelerate variables (which
    # executors set for the seed scripts) would make accelerate try to join a process group.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    if not 0 <= rank < n:
        raise _Unusable(f"rank {rank} outside [0, {n})")
    return config


def _identity(
    store: ObjectStore, rank: int, doc: JSONDict, config: RunConfig
) -> tuple[RunKeys | None, bytes | None, bytes | None]:
    """This rank's signing keys (signed runs), writer secret and the run's slot secret, from
    its environment."""
    try:
        keys = participant_keys(store, rank_identity(rank), doc, required=config.security.sign)
        return keys, writer_secret_from_env(), slot_secret_from_env()
    except (ValueError, CorruptContributionError) as exc:  # missing key, forged config
        raise _Unusable(str(exc)) from None


def _generation() -> int | None:
    """The run generation of this launch ($COMPOSER_RUN_GENERATION; None: launched by hand)."""
    generation = os.environ.get(ENV_GENERATION)
    if generation is None:
        return None
    if not generation.isdigit():
        raise _Unusable(f"${ENV_GENERATION}={generation!r} is not an integer >= 0")
    return int(generation)
