"""The module every DiLoCo replica runs (what executors launch for `composer-replication train`).

    python -m composer_replication.run.replica --rendezvous URI

1. Rank from `--rank`, else the variable named by `--rank_env` (the seed recipes' argument),
   else REPLICA_RANK; the run's store URI from `--rendezvous`, else DILOCO_RENDEZVOUS; fsspec
   options from COMPOSER_STORAGE_OPTIONS (JSON; credentials stay in each SDK's usual places).
2. The resolved run configuration from the store (`run_config.json`, written by the driver).
3. The task, the model (tiny: built locally from the config; else `from_pretrained`), the
   channel-3 teachers (configured endpoints, else the task oracle) and the
   `ComposerReplicationTrainer` with all three loss channels.
4. The DiLoCo outer loop over `ObjectStoreManager(ObjectStoreAllReduce(URI, world_size, rank))`:
   every replica starts from the store's global weights; a relaunched replica (or a resumed
   run) continues from the latest committed round and trains only the remaining inner steps.
5. Train; metrics, status, evaluations and checkpoints go to the store (`run/reporter.py`).

Exit code 0 when the replica finished, 1 on an error (its status document says which), 2 when
the arguments or environment are unusable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

__all__ = ["build_model", "build_trainer", "main", "run_replica"]

ENV_STORAGE_OPTIONS = "COMPOSER_STORAGE_OPTIONS"
CONFIG_KEY = "run_config.json"


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
                   help="seconds to wait for the run config to appear in the store")  # fmt: skip
    return p.parse_args(argv)


def _rank(ns: argparse.Namespace) -> int:
    if ns.rank is not None:
        return int(ns.rank)
    name = ns.rank_env or "REPLICA_RANK"
    value = os.environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        raise ValueError(f"no replica rank: set ${name} (or pass --rank); got {value!r}")
    return int(value)


def build_model(config: Any) -> tuple[Any, Any]:
    """(model, tokenizer) for config.model: the tiny Qwen2 or a hub/local checkpoint."""
    m = config.model
    if m.is_tiny:
        from composer_replication.models import build_tiny_model, build_tokenizer

        if m.tokenizer == "bpe":
            from composer_replication.models import build_bpe_tokenizer
            from composer_replication.run.bake import build_task

            # Trained on the TRAIN split's text only (deterministic: every replica gets the same
            # vocabulary), cached on disk.
            tok = build_bpe_tokenizer(build_task(config).text_corpus("train"),
                                      vocab_size=m.vocab_size)  # fmt: skip
        else:
            tok = build_tokenizer()
        model = build_tiny_model(
            tok, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads, seed=config.run.seed,
        )  # fmt: skip
        return model, tok
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(m.name, trust_remote_code=m.trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = "auto" if m.dtype == "auto" else getattr(torch, m.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        m.name, dtype=dtype, trust_remote_code=m.trust_remote_code
    )
    return model, tok


def _trainer_args(config: Any, output_dir: str, max_steps: int, seed: int) -> Any:
    import torch

    from composer_replication.trainer import ComposerConfig

    t, loss = config.train, config.loss
    cuda = torch.cuda.is_available()
    return ComposerConfig(
        output_dir=output_dir,
        max_steps=max_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        num_generations=t.num_generations,
        max_completion_length=t.max_completion_length,
        temperature=t.temperature,
        logging_steps=config.logging.log_every,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not cuda,
        bf16=cuda and config.model.dtype == "bfloat16",
        seed=seed,
        loss_type=loss.loss_type,
        epsilon=loss.epsilon_low,
        epsilon_high=loss.epsilon_high,
        beta=loss.kl_beta,
    )


def _composer_kwargs(config: Any) -> dict[str, Any]:
    kw = config.loss.compose_kwargs()
    for key in ("loss_type", "epsilon_low", "epsilon_high", "kl_beta"):
        kw.pop(key, None)  # channel 1 is configured through TRL's own arguments
    return kw


def _resume_round(store: Any) -> int:
    """The round of the newest published global state (0 on a fresh run)."""
    from composer_replication.exchange.state import parse_state_name, state_prefix

    rounds = [parse_state_name(n) for n in store.list(state_prefix("global").rstrip("/"))]
    return max((r for r in rounds if r is not None), default=0)


def _teacher_pool(config: Any, task: Any) -> tuple[Any, Any]:
    """(trace_store, teacher_pool) for channel 3."""
    from composer_replication.data.teachers import TeacherPool
    from composer_replication.data.traces import TraceStore, prompt_key
    from composer_replication.run.bake import build_teachers, task_index

    trace_store = TraceStore()
    if config.teachers.traces_path:
        trace_store = TraceStore.load([config.teachers.traces_path])
    teachers = build_teachers(config, task)
    if not teachers:
        return trace_store, None
    index = task_index(task)

    def verifier(prompt: Any, completion: str) -> float | None:
        example = index.get(prompt_key(prompt))
        return None if example is None else float(task.verify(example, completion).reward)

    return trace_store, TeacherPool(teachers, store=trace_store, verifier=verifier)


def build_trainer(
    config: Any,
    *,
    model: Any,
    tokenizer: Any,
    task: Any,
    max_steps: int,
    seed: int,
    output_dir: str,
    callbacks: list[Any] | None = None,
) -> Any:
    """The `ComposerReplicationTrainer` of a run: the task's reward (with feedback) and train
    split, TRL settings from [train]/[loss], channel-3 teachers from [teachers]."""
    from transformers.trainer_callback import PrinterCallback

    from composer_replication.trainer import ComposerReplicationTrainer

    trace_store, pool = _teacher_pool(config, task)
    trainer = ComposerReplicationTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[task.reward_func()],
        train_dataset=task.to_dataset("train"),
        args=_trainer_args(config, output_dir, max_steps, seed),
        callbacks=callbacks,
        trace_store=trace_store,
        teacher_pool=pool,
        **_composer_kwargs(config),
    )
    # Every log line already goes to the store as a metric record; printing each one too
    # would only bloat the replica's log file.
    trainer.remove_callback(PrinterCallback)
    return trainer


def run_replica(config: Any, rank: int, uri: str, storage_options: dict[str, Any]) -> int:
    """Train this replica of the run (see the module docstring); returns the exit code."""
    import torch
    from transformers import set_seed

    from composer_replication.diloco import make_diloco_outer_loop
    from composer_replication.exchange import ObjectStoreAllReduce, ObjectStoreManager
    from composer_replication.run.bake import build_task
    from composer_replication.run.metrics import ReplicaMetricsWriter
    from composer_replication.run.reporter import ReplicaReporter
    from composer_replication.run.storeio import StoreIO

    store = StoreIO(uri, storage_options)
    writer = ReplicaMetricsWriter(store, rank, flush_every_s=config.logging.flush_every_s)
    writer.status(state="starting", step=0, round=0, max_steps=config.train.max_steps, force=True)
    try:
        if config.train.torch_threads > 0:
            torch.set_num_threads(config.train.torch_threads)
        h = config.diloco.sync_every_h
        start_round = _resume_round(store)
        remaining = config.train.max_steps - start_round * h
        writer.log("event", step=start_round * h, round=start_round, event="start",
                   resumed_round=start_round)  # fmt: skip
        task = build_task(config)
        model, tok = build_model(config)
        allreduce = ObjectStoreAllReduce(
            store.uri,
            world_size=config.backend.n_replicas,
            rank=rank,
            timeout_s=config.diloco.timeout_s,
            codec=config.diloco.codec,
            min_replicas=config.diloco.min_replicas,
            weighting=config.diloco.weighting,
            storage_options=storage_options or None,
            keep_steps=config.store.keep_rounds,
        )
        manager = ObjectStoreManager(allreduce=allreduce)
        outer = make_diloco_outer_loop(
            None, manager, h, model=model, outer_lr=config.diloco.outer_lr,
            outer_momentum=config.diloco.outer_momentum, nesterov=config.diloco.nesterov,
        )  # fmt: skip
        n_eval = min(config.train.eval_max_examples, config.task.n_eval)
        reporter = ReplicaReporter(
            writer=writer, store=store, outer=outer, rank=rank,
            max_steps=config.train.max_steps, step_offset=start_round * h, tokenizer=tok,
            task=task, eval_examples=task.eval_examples()[:n_eval],
            eval_every_rounds=config.train.eval_every_rounds,
            max_new_tokens=config.train.max_completion_length,
            checkpoint_every_rounds=config.checkpoint.every_rounds,
            keep_last=config.checkpoint.keep_last, save_final=config.checkpoint.save_final,
        )  # fmt: skip
        if remaining <= 0:
            return _finish_without_training(outer, model, reporter, writer, start_round * h)
        # Different sampling per replica and per relaunch; the weights come from the store.
        seed = config.run.seed + 1000 * rank + start_round
        set_seed(seed)
        with tempfile.TemporaryDirectory(prefix=f"composer-replica{rank}-") as scratch:
            trainer = build_trainer(
                config, model=model, tokenizer=tok, task=task, max_steps=remaining,
                seed=seed, output_dir=scratch, callbacks=[outer.callback(), reporter],
            )  # fmt: skip
            trainer.train()
        return 0
    except BaseException as exc:
        writer.status(
            state="failed",
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc()[-4000:],
        )
        writer.flush()
        raise
    finally:
        writer.flush()


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
    from composer_replication.config import from_dict
    from composer_replication.config.schema import RunConfig
    from composer_replication.run.storeio import StoreIO

    store = StoreIO(uri, storage_options)
    deadline = time.monotonic() + ns.config_timeout
    doc = store.read_json(CONFIG_KEY)
    while doc is None and time.monotonic() < deadline:
        time.sleep(0.5)
        doc = store.read_json(CONFIG_KEY)
    if doc is None:
        print(f"replica: error: no {CONFIG_KEY} in {store.uri} after {ns.config_timeout:g}s; "
              "start runs with `composer-replication train`", file=sys.stderr)  # fmt: skip
        return 2
    config = from_dict(RunConfig, doc)
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
    print(f"replica {rank}/{config.backend.n_replicas}: run {config.run.name} at {store.uri}",
          flush=True)  # fmt: skip
    return run_replica(config, rank, store.uri, storage_options)


if __name__ == "__main__":
    sys.exit(main())
