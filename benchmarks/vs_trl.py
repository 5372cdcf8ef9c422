"""Our trainer against TRL's on the embedded default's task, at an equal time budget (issue 14).

    python benchmarks/vs_trl.py [--quick] [--budget-s S] [--clock wall|cpu] [--seeds K]
                                [--first-seed N] [--trainers a,b] [--channels] [--jobs N]
                                [section.key=value ...]

Setting: the embedded default (`composer-replication config show`): sums of three digits, the
tiny Qwen2 (hidden 64, 2 layers, char-level tokenizer, random init), 700 training prompts, 256
held-out prompts (disjoint from training), 16 prompts x 2 completions per step, lr 3e-3, the
task's shaped reward. Per seed every trainer starts from the bit-identical initial model (the
seed fixes the model init and the train/held-out split) and samples from the same training
prompts. ONE process, one replica (no DiLoCo: it would add the same averaging to every
trainer), `train.torch_threads` (1) torch threads as a replica. Each run trains until its time
budget (`--budget-s`, from the trainer's `on_train_begin`) is spent, then its final model
answers every held-out prompt greedily and is scored by exact match. The budget counts the
run's own CPU seconds (`--clock cpu`, the default: the same work whatever other jobs load the
machine meanwhile; with one thread it is the wall time on a free core) or wall seconds
(`--clock wall`; runs go one after another with `--jobs 1`, so they share the machine alike).
The default budget, 220 s, is the embedded default run's own compute: its 2 replicas used 108
and 110 CPU seconds for their 900 steps each (docs/benchmarks.md, "The embedded default"), so
every trainer here gets what `composer-replication train` spends, on one core.

Trainers (names as in the output):

- ``trl_grpo``: TRL's ``GRPOTrainer``, plain: the task's shaped reward (without feedback), the
  run's `[train]` settings (`assembly.build.trl_training_args`: lr, batch, G, completion
  length, temperature, grad clipping) and channel 1 of `[loss]` (dapo, epsilon, no KL).
- ``trl_sdpo``: TRL's ``trl.experimental.sdpo.SDPOTrainer`` on the same settings, configured
  like our channel 2: ``distillation_weight = alpha/(1+alpha)`` (TRL mixes
  ``(1-w) * policy + w * distill``; ours adds ``grpo + alpha * sdpo``, the same ratio),
  ``distillation_mode="full_logits"`` (``"topk_logits"`` with ``loss.sdpo_top_k``),
  ``distillation_alpha = loss.sdpo_jsd_beta`` (the same generalised JSD: TRL's mixture
  ``(1-a) student + a teacher`` is ours), no importance-sampling clip (ours:
  ``sdpo_token_clip`` unset), ``teacher_model_kind="live"`` (ours: ``sdpo_teacher="policy"``),
  ``success_reward_threshold`` = our 0.5, the same reprompt wording (ours follows TRL's). What
  it cannot use: the oracle (neither TRL trainer has a trace-replay channel, so channel 3's
  oracle traces of the training prompts are ours alone), and the verifier's per-rollout
  feedback ("7 is too small": TRL's SDPO reads feedback only from a per-prompt dataset
  column, so it runs with ``include_environment_feedback=False`` and learns from successful
  siblings only). Other differences: TRL normalises the distillation loss per sequence then
  over all rows; ours by the selected tokens of the batch; TRL also distils rollouts that
  succeeded when a sibling succeeded too, ours only failed ones.
- ``composer``: our ``ComposerReplicationTrainer`` with the default's loss (GRPO + 0.1 x
  channel 2 + 1.0 x channel 3 against the task's oracle), as `assembly.build_trainer` builds it.
- with ``--channels`` also ``composer_grpo`` (channel 1 only), ``composer_sdpo`` (1 + 2) and
  ``composer_replay`` (1 + 3), same budget.

Measured per run: held-out exact-match accuracy, mean held-out reward, the largest share of one
answer among the held-out answers (1.0 = a constant answer, a collapsed policy), steps done in
the budget, the last-10 mean training reward. For the composer runs with channel 2 on,
``channel2_loss_share``: every ``--probe-every`` training micro-batches (default 5), the
gradient norms of ``alpha * sdpo`` and of the total loss are taken separately with
``torch.autograd.grad`` on the trainer's loss terms (`set_loss_probe`), and the share is
``|grad(alpha * sdpo)| / |grad(total)|`` (0 on a sampled micro-batch where channel 2 has no
hinted rollout), averaged over the sampled micro-batches; the probe's time is not charged to the
run's budget. The same is reported for channel 3 (``channel3_loss_share``).

Prints one line per run, a table, and as the LAST line one JSON object: the medians over seeds
``composer_heldout_acc``, ``trl_grpo_heldout_acc``, ``trl_sdpo_heldout_acc``,
``composer_constant_answer_share``, ``channel2_loss_share``; ``per_seed`` (every run's figures
by trainer); ``targets`` (composer >= 0.5, >= 0.1 above both TRL trainers, constant share
<= 0.2, each true/false); ``budget_s``, ``seeds``, ``n_heldout``, ``seconds``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

TRAINERS = ("trl_grpo", "trl_sdpo", "composer")
# Our trainer with one channel set per variant ([loss] overrides; "composer" is the default's).
CHANNEL_VARIANTS: dict[str, list[str]] = {
    "composer_grpo": ["loss.alpha_sdpo=0.0", "loss.beta_replay=0.0"],
    "composer_sdpo": ["loss.beta_replay=0.0"],
    "composer_replay": ["loss.alpha_sdpo=0.0"],
}
MAX_STEPS = 100_000  # a cap the time budget always reaches first
# The embedded default run's compute: 2 replicas x 108-110 CPU s (docs/benchmarks.md).
DEFAULT_BUDGET_S = 220.0
TARGET_ACC, TARGET_MARGIN, TARGET_CONSTANT = 0.5, 0.1, 0.2


class GradShare:
    """A loss probe (`ComposerReplicationTrainer.set_loss_probe`): on every `every`-th training
    micro-batch, the gradient norm of each channel's term relative to the total's."""

    def __init__(self, params: list[Any], every: int, budget: Any) -> None:
        self.params = params
        self.every = every
        self.budget = budget
        self.calls = 0
        self.shares: dict[str, list[float]] = {"sdpo": [], "replay": []}

    def _norm(self, term: Any) -> float:
        import torch

        grads = torch.autograd.grad(term, self.params, retain_graph=True, allow_unused=True)
        return math.sqrt(sum(float(g.pow(2).sum()) for g in grads if g is not None))

    def __call__(self, terms: dict[str, Any]) -> None:
        self.calls += 1
        if (self.calls - 1) % self.every:
            return
        with self.budget.excluded():
            total = self._norm(terms["total"])
            for key, shares in self.shares.items():
                term = terms[key]
                part = 0.0 if term is None else self._norm(term)
                shares.append(part / total if total > 0 else 0.0)

    def mean(self, key: str) -> float | None:
        values = self.shares[key]
        return statistics.fmean(values) if values else None


def _overrides(trainer: str, extra: list[str]) -> list[str]:
    return [*CHANNEL_VARIANTS.get(trainer, []), *extra]


def _trl_sdpo_args(config: Any, common: dict[str, Any]) -> Any:
    from trl.experimental.sdpo import SDPOConfig

    from composer_replication.assembly.build import channel1_args
    from composer_replication.trainer.config import ComposerSettings

    loss = config.loss
    channel1 = channel1_args(config)
    if channel1.pop("delta") is not None:
        raise ValueError("TRL's SDPOTrainer has no `delta` (two-sided clipping): unset loss.delta")
    if loss.sdpo_token_clip is not None or loss.sdpo_wrapper != "none":
        raise ValueError(
            "TRL's SDPOTrainer has no per-token clip or TAID/entropy wrapper: leave "
            "loss.sdpo_token_clip unset and loss.sdpo_wrapper = 'none' for this comparison"
        )
    alpha = loss.alpha_sdpo
    top_k = loss.sdpo_top_k
    return SDPOConfig(
        **common,
        **channel1,
        distillation_weight=alpha / (1.0 + alpha),
        distillation_mode="full_logits" if top_k is None else "topk_logits",
        distillation_topk=top_k,
        distillation_add_tail=loss.sdpo_add_tail if top_k is not None else False,
        distillation_alpha=loss.sdpo_jsd_beta,
        distillation_is_clip=None,
        teacher_model_kind="live",
        use_successful_as_teacher=True,
        success_reward_threshold=ComposerSettings().sdpo_success_threshold,
        include_environment_feedback=False,
        disable_dropout=False,  # as TRL's GRPOConfig (the tiny model has no dropout anyway)
        diagnostics_warning_interval=100,  # its "no successful rollout" warning, not every 10
    )


def build_runner(trainer: str, config: Any, model: Any, tok: Any, task: Any, scratch: str,
                 callbacks: list[Any]) -> Any:  # fmt: skip
    """The trainer named `trainer` on `config`'s settings, with `callbacks`."""
    from transformers.trainer_callback import PrinterCallback

    from composer_replication.assembly.build import (
        build_trainer,
        channel1_args,
        train_split,
        trl_training_args,
    )

    seed = config.run.seed
    if trainer.startswith("composer"):
        return build_trainer(config, model=model, tokenizer=tok, task=task, max_steps=MAX_STEPS,
                             seed=seed, output_dir=scratch, callbacks=callbacks)  # fmt: skip
    common = trl_training_args(config, scratch, MAX_STEPS, seed)
    dataset = train_split(config, task, rank=0)
    reward = [task.reward_func(with_feedback=False)]  # plain floats for a stock trainer
    if trainer == "trl_grpo":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common, **channel1_args(config))
        runner = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                             processing_class=tok, callbacks=callbacks)  # fmt: skip
    elif trainer == "trl_sdpo":
        from trl.experimental.sdpo import SDPOTrainer

        args = _trl_sdpo_args(config, common)
        runner = SDPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                             processing_class=tok, callbacks=callbacks)  # fmt: skip
    else:
        raise ValueError(f"unknown trainer {trainer!r}")
    runner.remove_callback(PrinterCallback)
    return runner


def run_one(trainer: str, seed: int, budget_s: float, clock: str, probe_every: int,
            extra: list[str]) -> dict[str, Any]:  # fmt: skip
    import torch
    from _inprocess import RewardLog, WallBudget, build_parts, held_out, run_config

    config = run_config(seed, MAX_STEPS, _overrides(trainer, extra))
    if config.train.torch_threads > 0:  # as a replica of the run does
        torch.set_num_threads(config.train.torch_threads)
    task, model, tok = build_parts(config)  # bit-identical per seed for every trainer
    log, budget = RewardLog(), WallBudget(budget_s, clock)
    probe = None
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as scratch:
        runner = build_runner(trainer, config, model, tok, task, scratch, [log, budget])
        if trainer.startswith("composer") and config.loss.alpha_sdpo != 0:
            params = [p for p in runner.model.parameters() if p.requires_grad]
            probe = GradShare(params, probe_every, budget)
            runner.set_loss_probe(probe)
        runner.train()
    wall = time.monotonic() - t0
    metrics = held_out(model, tok, task, config)
    rewards = log.rewards
    return {
        "trainer": trainer,
        "seed": seed,
        "heldout_acc": metrics["accuracy"],
        "heldout_reward": metrics["reward"],
        "constant_answer_share": metrics["constant_answer_share"],
        "top_answer": metrics["top_answer"],
        "n_heldout": metrics["n"],
        "steps": budget.steps,
        "train_seconds": round(budget.seconds, 1),
        "clock": clock,
        "wall_seconds": round(wall, 1),
        "last10_train_reward": statistics.fmean(rewards[-10:]) if rewards else None,
        "channel2_loss_share": None if probe is None else probe.mean("sdpo"),
        "channel3_loss_share": None if probe is None else probe.mean("replay"),
        "probed_micro_batches": 0 if probe is None else len(probe.shares["sdpo"]),
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(results: list[dict[str, Any]], trainers: list[str]) -> dict[str, Any]:
    per_seed = {t: [r for r in results if r["trainer"] == t] for t in trainers}
    med = {
        t: {key: _median([r[key] for r in runs])
            for key in ("heldout_acc", "constant_answer_share", "steps", "channel2_loss_share",
                        "channel3_loss_share", "last10_train_reward")}
        for t, runs in per_seed.items()
    }  # fmt: skip
    none: dict[str, Any] = {"heldout_acc": None, "constant_answer_share": None,
                            "channel2_loss_share": None}  # fmt: skip
    comp, grpo, sdpo = (med.get(t, none) for t in ("composer", "trl_grpo", "trl_sdpo"))
    acc = comp["heldout_acc"]
    trl = [m["heldout_acc"] for m in (grpo, sdpo) if m["heldout_acc"] is not None]
    share = comp["constant_answer_share"]
    return {
        "composer_heldout_acc": acc,
        "trl_grpo_heldout_acc": grpo["heldout_acc"],
        "trl_sdpo_heldout_acc": sdpo["heldout_acc"],
        "composer_constant_answer_share": share,
        "channel2_loss_share": comp["channel2_loss_share"],
        "targets": {  # None: not measured in this run
            "composer_acc_ge_0.5": None if acc is None else acc >= TARGET_ACC,
            "composer_ahead_by_0.1": None
            if acc is None or len(trl) < 2
            else acc - TARGET_MARGIN >= max(trl) - 1e-12,
            "constant_share_le_0.2": None if share is None else share <= TARGET_CONSTANT,
        },
        "medians": med,
        "per_seed": {
            t: [{k: v for k, v in r.items() if k != "trainer"} for r in runs]
            for t, runs in per_seed.items()
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 seed, 12 s per run (the figures mean nothing)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=None,
                   help="training seconds per run, counted by --clock (default 220, the "
                        "embedded default run's CPU seconds; --quick: 12)")  # fmt: skip
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds are first-seed .. first-seed+K-1 (default 0)")  # fmt: skip
    p.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                   help="what the budget counts: the run's CPU seconds (default: the same "
                        "work whatever the machine's load) or wall seconds")  # fmt: skip
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..K-1 (default 3; --quick 1)")
    p.add_argument("--channels", action="store_true",
                   help="also our trainer with each channel set (grpo, +ch2, +ch3)")  # fmt: skip
    p.add_argument("--trainers", default=None,
                   help="comma-separated subset of the trainers to run (default: all; the "
                        "summary keys of a trainer not run are null)")  # fmt: skip
    p.add_argument("--probe-every", type=int, default=5,
                   help="measure channel 2's gradient share every N micro-batches (default 5)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1,
                   help="runs in parallel processes (default 1: runs "
                        "one after another, the fair setting on a shared machine)")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="extra section.key=value config overrides")
    args = p.parse_args()
    budget = args.budget_s or (12.0 if args.quick else DEFAULT_BUDGET_S)
    seeds = args.seeds or (1 if args.quick else 3)
    if budget <= 0 or seeds < 1 or args.probe_every < 1 or args.jobs < 1:
        p.error("--budget-s must be > 0, --seeds, --probe-every and --jobs >= 1")
    trainers = [*TRAINERS, *(CHANNEL_VARIANTS if args.channels else ())]
    if args.trainers:
        chosen = [t.strip() for t in args.trainers.split(",") if t.strip()]
        unknown = sorted(set(chosen) - {*TRAINERS, *CHANNEL_VARIANTS})
        if unknown or not chosen:
            p.error(f"--trainers: unknown {unknown}; choose from "
                    f"{', '.join([*TRAINERS, *CHANNEL_VARIANTS])}")  # fmt: skip
        trainers = chosen
    jobs = [(t, s) for s in range(args.first_seed, args.first_seed + seeds) for t in trainers]
    t0 = time.monotonic()
    if args.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
        with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            futures = [pool.submit(run_one, t, s, budget, args.clock, args.probe_every,
                                   args.overrides) for t, s in jobs]  # fmt: skip
            results = [f.result() for f in futures]
            for r in results:
                _print_run(r)
    else:
        results = []
        for t, s in jobs:
            results.append(run_one(t, s, budget, args.clock, args.probe_every, args.overrides))
            _print_run(results[-1])
    summary = summarize(results, trainers)
    n = results[0]["n_heldout"]
    print(f"\nembedded default's task, {budget:.0f} {args.clock} s of training per run, {seeds} seed(s), "
          f"{n} held-out prompts (greedy exact match); medians over seeds")  # fmt: skip
    print(f"{'trainer':16s} | held-out acc | constant share | steps | ch2 share | ch3 share")
    for t in trainers:
        m = summary["medians"][t]
        print(f"{t:16s} | {m['heldout_acc']:12.3f} | {m['constant_answer_share']:14.3f} | "
              f"{m['steps']:5.0f} | {_fmt(m['channel2_loss_share']):>9s} | "
              f"{_fmt(m['channel3_loss_share']):>9s}")  # fmt: skip
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    print("targets: " + ", ".join(f"{k} {verdict[v]}"
                                  for k, v in summary["targets"].items()))  # fmt: skip
    summary.update(budget_s=budget, clock=args.clock, seeds=seeds, n_heldout=n,
                   seconds=round(time.monotonic() - t0, 1))  # fmt: skip
    print(json.dumps(summary))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _print_run(r: dict[str, Any]) -> None:
    share = (
        ""
        if r["channel2_loss_share"] is None
        else (
            f", ch2 grad share {r['channel2_loss_share']:.4f}, ch3 {r['channel3_loss_share']:.4f}"
        )
    )
    print(f"{r['trainer']:16s} seed {r['seed']}: held-out acc {r['heldout_acc']:.3f}, constant "
          f"share {r['constant_answer_share']:.3f} (top answer {r['top_answer']!r}), "
          f"{r['steps']} steps in {r['train_seconds']:.0f} s, last-10 train reward "
          f"{_fmt(r['last10_train_reward'])}{share}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
