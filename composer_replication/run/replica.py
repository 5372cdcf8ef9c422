"""The module every DiLoCo replica runs (what executors launch for `composer-replication train`).

    python -m composer_replication.run.replica --rendezvous URI

1. Rank from `--rank`, else the variable named by `--rank_env` (the seed recipes' argument),
   else REPLICA_RANK; the run's store URI from `--rendezvous`, else DILOCO_RENDEZVOUS; fsspec
   options from COMPOSER_STORAGE_OPTIONS (JSON; credentials stay in each SDK's usual places).
2. The resolved run configuration from the store (`run_config.json`, written by the driver).
   Launched directly (no driver: an executor, a cluster job, a seed recipe snippet), a replica
   that finds no run config takes it from its own arguments, `--config FILE.toml` (else
   $COMPOSER_CONFIG, else the embedded default) plus `section.key=value` overrides, with
   `backend.n_replicas` = $WORLD_SIZE when set; the first replica to start publishes it with
   put-if-absent and every replica then trains with the stored one, so they all agree.
3. The task, the model (tiny: built locally from the config; else `from_pretrained`), the
   channel-3 teachers (configured endpoints, else the task oracle) and the
   `ComposerReplicationTrainer` with all three loss channels (`assembly/build.py`).
4. The DiLoCo outer loop over the manager `[diloco] manager` names: "object_store" (default),
   `ObjectStoreManager(ObjectStoreAllReduce(URI, world_size, rank))` screening contributions as
   `[diloco] aggregate*` / `screen*` say (run/screening.py) and, with `[security] sign`, signing
   with this rank's key from its environment (run/security.py), or "torchft", a torchft
   Manager dialling the lighthouse `[diloco] lighthouse` (else $TORCHFT_LIGHTHOUSE, which the
   driver sets when it runs one itself) that publishes its outer state to the same store.
   Every replica starts from the run's global weights; a relaunched replica (or a resumed
   run) continues from the latest published round and trains only the remaining inner steps:
   exactly (sync mode) when it finds its own resume state of that round in the store
   (`run/replica_state.py`, written after every committed round), else with fresh inner state.
5. Train; metrics, status, evaluations and checkpoints go to the store (`run/reporter.py`).

Fencing: the driver hands the replica its launch's run generation ($COMPOSER_RUN_GENERATION;
launched by hand: the store's current one). Every write to the store checks it first
(exchange/fencing.py): once a newer launch (`--resume`) has written a higher generation, the
replica stops without writing anything more, at its next write or heartbeat at the latest.

Exit code 0 when the replica finished, 1 on an error (its status document says which), 2 when
the arguments or environment are unusable, 3 when it was fenced by a newer launch of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from composer_replication.assembly.build import build_model, build_task, build_trainer
from composer_replication.exchange import codecs
from composer_replication.exchange.liveness import HEARTBEAT_EVERY_S

if TYPE_CHECKING:
    from composer_replication.config import RunConfig
    from composer_replication.exchange.robust import AggregatePolicy, LossProbe
    from composer_replication.exchange.signing import RunKeys

__all__ = ["main", "run_replica"]

ENV_STORAGE_OPTIONS = "COMPOSER_STORAGE_OPTIONS"
ENV_GENERATION = "COMPOSER_RUN_GENERATION"
CONFIG_KEY = "run_config.json"
EXIT_FENCED = 3


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m composer_replication.run.replica",
        description="Run one DiLoCo replica of a composer-replication run.",
    )
    p.add_argument("--rendezvous", help="the run's store URI (default: $DILOCO_RENDEZVOUS)")
    p.add_argument("--rank", type=int, default=None, help="this replica's rank")
    p.add_argument("--rank_env", "--rank-env", dest="rank_env", default=None,
                   help="environment variable holding the rank (default: REPLICA_RANK)")  # fmt: skip
    p.add_argument("--config-timeout", type=float, default=120.0,
                   help="seconds to wait for the run config to appear in the store when it "
                   "must come from a driver (--wait-for-driver)")  # fmt: skip
    p.add_argument("--config", default=None,
                   help="run config TOML when launched without a driver (default: "
                   "$COMPOSER_CONFIG, else the embedded default)")  # fmt: skip
    p.add_argument("--wait-for-driver", action="store_true",
                   help="never publish a config: wait for `composer-replication train` to")  # fmt: skip
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="overrides of the run config (launched without a driver)")  # fmt: skip
    return p.parse_args(argv)


def _standalone_config(ns: argparse.Namespace) -> dict[str, Any]:
    """The run config of a directly launched replica (no driver): its file or the embedded
    default, its overrides, backend.n_replicas from $WORLD_SIZE; as the driver stores it."""
    from composer_replication.config import load_config, to_dict

    path = ns.config or os.environ.get("COMPOSER_CONFIG") or None
    overrides = list(ns.overrides)
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.isdigit():
        overrides.append(f"backend.n_replicas={int(world)}")
    doc: dict[str, Any] = json.loads(json.dumps(to_dict(load_config(path, overrides))))
    return doc


def _rank(ns: argparse.Namespace) -> int:
    if ns.rank is not None:
        return int(ns.rank)
    name = ns.rank_env or "REPLICA_RANK"
    value = os.environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        raise ValueError(f"no replica rank: set ${name} (or pass --rank); got {value!r}")
    return int(value)


def _resume_round(store: Any) -> int:
    """The round of the newest published global state (0 on a fresh run)."""
    from composer_replication.exchange.state import parse_state_name, state_prefix

    rounds = [parse_state_name(n) for n in store.list(state_prefix("global"))]
    return max((r for r in rounds if r is not None), default=0)


def _build_manager(
    config: Any,
    rank: int,
    store: Any,
    *,
    keys: RunKeys | None = None,
    policy: AggregatePolicy | None = None,
    loss_probe: LossProbe | None = None,
    writer_secret: bytes | None = None,
    fence: Callable[[], None] | None = None,
) -> Any:
    """The outer loop's `Manager` that `[diloco] manager` names, for replica `rank`."""
    d = config.diloco
    n = config.backend.n_replicas
    if d.manager == "torchft":
        import os
        from urllib.parse import urlparse

        from composer_replication.diloco.torchft_path import build_torchft_manager
        from composer_replication.exchange.documents import RunDocuments

        lighthouse = d.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise ValueError(
                "diloco.manager = 'torchft' needs a lighthouse: set diloco.lighthouse = "
                "'http://HOST:PORT' (the driver starts one itself for local runs)"
            )
        # What this replica advertises to its peers: loopback when the run is on this machine.
        host = urlparse(lighthouse).hostname or ""
        local = host in ("127.0.0.1", "localhost", "::1")
        states = RunDocuments(store, world_size=n, codec=d.codec, keep_steps=config.store.keep_rounds,
                              poll_interval_s=0.5)  # fmt: skip
        # init_sync=False: every replica builds the same initial weights (same seed or
        # checkpoint), so the first quorum need not copy them; a replica that is behind (a
        # restart) is still healed from a peer.
        return build_torchft_manager(
            replica_id=f"replica_{rank}", lighthouse_addr=lighthouse,
            min_replicas=d.min_replicas or n, hostname="127.0.0.1" if local else _hostname(),
            init_sync=False, states=states,
        )  # fmt: skip
    from composer_replication.exchange import ObjectStoreAllReduce, ObjectStoreManager

    allreduce = ObjectStoreAllReduce(
        store.uri, world_size=n, rank=rank, timeout_s=d.timeout_s, codec=d.codec,
        min_replicas=d.min_replicas, aggregate=policy or d.aggregate_policy(),
        storage_options=store.storage_options or None, keep_steps=config.store.keep_rounds,
        keys=keys, loss_probe=loss_probe, writer_secret=writer_secret, sparse=d.sparse_spec(),
        fence=fence,
    )  # fmt: skip
    manager = ObjectStoreManager(allreduce=allreduce)
    if codecs.get(d.codec).needs_error_feedback:  # SparseLoCo: the replica's error feedback
        from composer_replication.diloco.sparseloco import ErrorFeedbackManager

        return ErrorFeedbackManager(manager, d.sparse_spec(), decay=d.sparseloco_ef_decay)
    return manager


def _build_learner(config: Any, rank: int, store: Any, model: Any) -> Any:
    """The decoupled learner of replica `rank` (its heartbeat is the replica's, below)."""
    from composer_replication.diloco.decoupled import DecoupledLearner

    d = config.diloco
    return DecoupledLearner(
        store, learner=rank, n_learners=config.backend.n_replicas, sync_every_h=d.sync_every_h,
        num_fragments=d.fragments, model=model, alpha=d.alpha, codec=d.codec,
        poll_interval_s=0.1 if store.is_local else 0.5, drain_timeout_s=d.timeout_s,
        heartbeat_every_s=None,
    )  # fmt: skip


class _Heartbeat:
    """This replica's heartbeat (exchange/liveness.py), written every few seconds from a thread
    from start-up on; ``fields`` (set once the outer loop exists) adds its round and step."""

    def __init__(self, store: Any, role: str, rank: int, every_s: float = HEARTBEAT_EVERY_S
                 ) -> None:  # fmt: skip
        import threading

        self.store, self.role, self.rank, self.every_s = store, role, rank, every_s
        self.fields: Callable[[], dict[str, Any]] = dict
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._thread.start()

    def beat(self, state: str = "running") -> None:
        from composer_replication.exchange.fencing import FencedError
        from composer_replication.exchange.liveness import write_heartbeat

        try:
            write_heartbeat(self.store, self.role, self.rank, state=state, **self.fields())
        except FencedError as exc:  # a newer launch owns the run: stop here, writing nothing
            print(f"replica {self.rank}: {exc}", file=sys.stderr, flush=True)
            os._exit(EXIT_FENCED)
        except (OSError, ValueError) as exc:
            print(f"replica {self.rank}: heartbeat failed: {exc!r}", file=sys.stderr)

    def _loop(self) -> None:
        while True:
            self.beat()
            if self._stop.wait(self.every_s):
                return

    def close(self, state: str | None = None) -> None:
        if self._closed:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        if state is not None:
            self._closed = True
            self.beat(state)


def _hostname() -> str:
    """This machine's address as its peers should dial it ($TORCHFT_HOSTNAME overrides)."""
    import os
    import socket

    return os.environ.get("TORCHFT_HOSTNAME") or socket.getfqdn()


def run_replica(
    config: RunConfig,
    rank: int,
    uri: str,
    storage_options: dict[str, Any],
    keys: RunKeys | None = None,
    writer_secret: bytes | None = None,
    generation: int | None = None,
) -> int:
    """Train this replica of the run (see the module docstring); returns the exit code.

    ``keys``: this rank's signing keys (signed runs); ``writer_secret``: its writer secret
    (unsigned runs; see `run.security.writer_secrets`); ``generation``: the run generation of
    its launch (None: the store's current one), checked before every write."""
    import torch
    from transformers import set_seed

    from composer_replication.diloco import make_diloco_outer_loop
    from composer_replication.diloco.outer_loop import outer_optimizer_factory
    from composer_replication.exchange.fencing import Fence, FencedError, read_generation
    from composer_replication.exchange.liveness import (
        REPLICA_ROLE,
        clear_departure,
        write_departure,
    )
    from composer_replication.exchange.store import ObjectStore
    from composer_replication.run.metrics import ReplicaMetricsWriter
    from composer_replication.run.reporter import ReplicaReporter, ResumeStateWriter

    store = ObjectStore(uri, storage_options)
    fence = Fence(store, read_generation(store) if generation is None else generation)
    store.write_guard = fence
    try:
        fence()
    except FencedError as exc:
        print(f"replica {rank}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FENCED
    writer = ReplicaMetricsWriter(store, rank, flush_every_s=config.logging.flush_every_s)
    writer.status(state="starting", step=0, round=0, max_steps=config.train.max_steps, force=True)
    manager = None
    heartbeat = _Heartbeat(store, "learner" if config.diloco.mode == "decoupled" else "replica",
                           rank)  # fmt: skip
    try:
        if config.train.torch_threads > 0:
            torch.set_num_threads(config.train.torch_threads)
        h = config.diloco.sync_every_h
        task = build_task(config)
        model, tok = build_model(config)
        outer: Any
        if config.diloco.mode == "decoupled":
            outer = _build_learner(config, rank, store, model)
            start_step = outer.start_step
            start_round = 0
        else:
            start_round = _resume_round(store)
            start_step = start_round * h
            if config.diloco.manager == "object_store":
                from composer_replication.run import screening

                probe = screening.loss_probe(
                    config, lambda: outer.global_parameters(), model, tok, task
                )
                manager = _build_manager(
                    config, rank, store, keys=keys, loss_probe=probe,
                    writer_secret=writer_secret, fence=fence,
                    policy=screening.aggregate_policy(config, task, tok),
                )  # fmt: skip
            else:
                manager = _build_manager(config, rank, store)
            d = config.diloco
            if codecs.get(d.codec).needs_error_feedback:  # it replaces the outer momentum
                from composer_replication.diloco.sparseloco import sparseloco_outer_optimizer

                factory = sparseloco_outer_optimizer(d.sparseloco_outer_lr)
            else:
                factory = outer_optimizer_factory(
                    d.outer_optimizer, lr=d.outer_lr, momentum=d.outer_momentum,
                    betas=(d.outer_betas[0], d.outer_betas[1]), eps=d.outer_eps,
                )  # fmt: skip
            outer = make_diloco_outer_loop(None, manager, h, model=model,
                                           outer_optimizer_factory=factory)  # fmt: skip
        if config.diloco.mode == "decoupled":
            heartbeat.fields = lambda: {"round": outer.round, "step": outer.step,
                                        "versions": list(outer.versions)}  # fmt: skip
        else:
            heartbeat.fields = lambda: {"round": outer.round}
        remaining = config.train.max_steps - start_step
        exact = config.diloco.mode == "sync"  # rounds end at step R * H on every replica
        resume_state = None
        if exact and remaining > 0:
            resume_state = _own_resume_state(store, rank, start_round)
        writer.log("event", step=start_step, round=start_round, event="start",
                   resumed_round=start_round, resumed_step=start_step,
                   exact=start_step == 0 or resume_state is not None)  # fmt: skip
        n_eval = min(config.train.eval_max_examples, config.task.n_eval)
        reporter = ReplicaReporter(
            writer=writer, store=store, outer=outer, rank=rank,
            max_steps=config.train.max_steps, tokenizer=tok,
            task=task, eval_examples=task.eval_examples()[:n_eval],
            eval_every_rounds=config.train.eval_every_rounds,
            max_new_tokens=config.train.max_completion_length,
            checkpoint_every_rounds=config.checkpoint.every_rounds,
            keep_last=config.checkpoint.keep_last, save_final=config.checkpoint.save_final,
            last_round=config.n_rounds if config.diloco.mode == "sync" else None,
            ood_examples=task.ood_examples(n_eval) if n_eval and task.has_ood() else None,
        )  # fmt: skip
        if remaining <= 0:
            return _finish_without_training(outer, model, reporter, writer, start_step)
        # Different sampling per replica; a fresh start and an exact resume share one stream
        # (the resume state carries its RNG states). A relaunch without a resume state of its
        # round (a replica restarted mid-run, decoupled mode) continues from the global
        # weights with fresh inner state and a new sampling stream.
        fresh = start_step == 0 or resume_state is not None
        seed = config.run.seed + 1000 * rank + (0 if fresh else start_round + start_step)
        set_seed(seed)
        with tempfile.TemporaryDirectory(prefix=f"composer-replica{rank}-") as scratch:
            trainer = build_trainer(
                config, model=model, tokenizer=tok, task=task, max_steps=config.train.max_steps,
                seed=seed, output_dir=scratch, callbacks=[outer.callback(), reporter], rank=rank,
            )  # fmt: skip
            # what this replica trains on, for the run summary (report.device_lines)
            writer.log("event", step=start_step, round=start_round, event="device",
                       **device_record(trainer, config.train.generation))  # fmt: skip
            if exact:  # after the trainer's own callbacks (TAID, EMA): the step's final state
                trainer.add_callback(
                    ResumeStateWriter(store=store, rank=rank, outer=outer, trainer=trainer,
                                      sync_every_h=h, keep=config.store.keep_rounds,
                                      flush=writer.flush)
                )  # fmt: skip
            if config.diloco.mode == "sync":  # ready: the peers wait for this rank again
                clear_departure(store, REPLICA_ROLE, rank)
            # The trainer counts the run's steps: its step, LR schedule and TAID schedule
            # continue at start_step (exactly, with the resume state).
            if resume_state is not None:
                trainer.resume_train(resume_state)
            else:
                trainer.train_from_step(start_step)
        # The model now holds the global weights (the DiLoCo callback loaded them): their
        # digest lets anyone check that every replica ended on the same model.
        writer.log("event", step=config.train.max_steps, round=outer.round,
                   event="global_weights", sha256=weights_digest(model))  # fmt: skip
        if config.diloco.mode == "sync":  # a peer still behind need not wait for this rank
            write_departure(store, REPLICA_ROLE, rank, reason="finished training")
        heartbeat.close("done")
        return 0
    except FencedError as exc:  # a newer launch owns the run: leave without another write
        heartbeat.close()
        print(f"replica {rank}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FENCED
    except BaseException as exc:
        try:
            writer.status(
                state="failed",
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc()[-4000:],
            )
            writer.flush()
            heartbeat.close("failed")
        except FencedError:  # fenced meanwhile: the failure is reported in the log only
            heartbeat.close()
        raise
    finally:
        if fence.tripped is None:
            writer.flush()
        heartbeat.close()
        if manager is not None:
            manager.close()


def _own_resume_state(store: Any, rank: int, round: int) -> dict[str, Any] | None:
    """This replica's resume state of `round` (None at round 0, or with a one-line warning
    when it is absent or fails its checks: the replica then starts its inner state afresh)."""
    from composer_replication.run.replica_state import ReplicaStateError, load_replica_state

    if round == 0:
        return None
    try:
        return load_replica_state(store, rank=rank, round=round)
    except ReplicaStateError as exc:
        print(f"replica {rank}: {exc}; continuing from the global weights of round {round} "
              "with a fresh inner optimizer, schedule position and sampling stream",
              file=sys.stderr, flush=True)  # fmt: skip
        return None


def device_record(trainer: Any, generation: str) -> dict[str, Any]:
    """What a trainer trains on: the device (and the GPU's name), the parameters' dtype, the
    autocast dtype (TRL's ``bf16`` / ``fp16`` mixed precision, else none), gradient
    checkpointing and the rollout engine (`[train] generation`)."""
    import torch

    param = next(trainer.model.parameters())
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


def weights_digest(model: Any) -> str:
    """sha256 over the model's named parameters (names, dtypes, shapes and bytes, in order)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _finish_without_training(outer: Any, model: Any, reporter: Any, writer: Any, step: int) -> int:
    """Every round is already committed (a resumed run that had finished): load the global
    weights, and let the evaluator write the final evaluation/checkpoint if it is missing."""
    import torch

    from composer_replication.run.checkpoint import committed_checkpoints

    outer.bind(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    has_final = any(name == "final" for name, _ in committed_checkpoints(reporter.store))
    if reporter.is_evaluator and not has_final:
        reporter.evaluate_now(model, step)
        reporter.checkpoint_now(model, step, name="final")
    writer.status(state="done", step=step, round=outer.round, force=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parse(argv)
    try:
        rank = _rank(ns)
        uri = ns.rendezvous or os.environ.get("DILOCO_RENDEZVOUS")
        if not uri:
            raise ValueError("no store URI: pass --rendezvous URI or set $DILOCO_RENDEZVOUS")
        storage_options = json.loads(os.environ.get(ENV_STORAGE_OPTIONS) or "{}")
        if not isinstance(storage_options, dict):
            raise ValueError(f"${ENV_STORAGE_OPTIONS} must be a JSON object")
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"replica: error: {exc}", file=sys.stderr)
        return 2
    from composer_replication.config import ConfigError, from_dict
    from composer_replication.config.schema import RunConfig
    from composer_replication.exchange.store import ObjectStore

    try:
        store = ObjectStore(uri, storage_options)
        doc = store.get_json(CONFIG_KEY)
        if doc is None and not ns.wait_for_driver:
            # launched directly: publish ours unless another replica was first (then use theirs)
            mine = _standalone_config(ns)
            if store.put_json(CONFIG_KEY, mine, exclusive=True):
                print(f"replica: published the run config to {store.uri}", flush=True)
            doc = store.get_json(CONFIG_KEY)
        deadline = time.monotonic() + ns.config_timeout
        while doc is None and time.monotonic() < deadline:
            time.sleep(0.5)
            doc = store.get_json(CONFIG_KEY)
    except (ValueError, ConfigError) as exc:  # a URI without a bucket, a bad config or override
        print(f"replica: error: {exc}", file=sys.stderr)
        return 2
    if doc is None:
        print(f"replica: error: no {CONFIG_KEY} in {store.uri} after {ns.config_timeout:g}s; "
              "start runs with `composer-replication train`", file=sys.stderr)  # fmt: skip
        return 2
    try:
        config = from_dict(RunConfig, doc)
    except (ValueError, ConfigError) as exc:  # a stored config this version cannot read
        print(f"replica: error: {CONFIG_KEY} in {store.uri}: {exc}", file=sys.stderr)
        return 2
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.isdigit() and int(world) != config.backend.n_replicas:
        print(f"replica: error: WORLD_SIZE={world} but the run has backend.n_replicas="
              f"{config.backend.n_replicas}", file=sys.stderr)  # fmt: skip
        return 2
    # Each replica is a single-process trainer: torch.distributed / accelerate variables (which
    # executors set for the seed scripts) would make accelerate try to join a process group.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    if not 0 <= rank < config.backend.n_replicas:
        print(f"replica: error: rank {rank} outside [0, {config.backend.n_replicas})",
              file=sys.stderr)  # fmt: skip
        return 2
    from composer_replication.exchange.protocol import CorruptContributionError
    from composer_replication.exchange.signing import rank_identity
    from composer_replication.run.security import participant_keys, writer_secret_from_env

    try:
        keys = participant_keys(store, rank_identity(rank), doc, required=config.security.sign)
        writer_secret = writer_secret_from_env()
    except (ValueError, CorruptContributionError) as exc:  # missing key, forged config
        print(f"replica: error: {exc}", file=sys.stderr)
        return 2
    generation = os.environ.get(ENV_GENERATION)
    if generation is not None and not generation.isdigit():
        print(f"replica: error: ${ENV_GENERATION}={generation!r} is not an integer >= 0",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"replica {rank}/{config.backend.n_replicas}: run {config.run.name} at {store.uri}",
          flush=True)  # fmt: skip
    return run_replica(
        config, rank, store.uri, storage_options, keys=keys, writer_secret=writer_secret,
        generation=None if generation is None else int(generation),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
