"""Our trainer against TRL's, every arm given the same information and the same tuning (issue 23).

    python benchmarks/vs_trl.py [--quick] [--budget-s S] [--clock cpu|wall] [--seeds K]
                                [--first-seed N] [--arms a,b] [--jobs N] [--log PATH]
                                [--ablation] [--warm-start-steps N] [--starts S] [section.key=value ...]

Setting: the embedded default's task (`composer-replication config show`): sums of three digits,
700 training prompts, 256 held-out prompts that share no operand multiset with a training prompt
(whole equivalence classes held out, tasks/task.py), the tiny Qwen2 (hidden 64, 2 layers,
char-level tokenizer, random init), 16 prompts per step, the task's shaped reward. Per seed every
arm starts from the bit-identical initial model (the seed fixes the init and the split). ONE
process, one replica (no DiLoCo), `train.torch_threads` (1) torch threads. Each run trains until
its budget (`--budget-s`, default 220: the embedded default run's own compute, 2 replicas x
~110 CPU s) is spent, counted in the run's CPU seconds from `on_train_begin` (`--clock cpu`, the
default: the time a run waits for a core is not charged; a loaded machine still does up to
less work per CPU second, so the arms of one comparison run side by side, see below),
then its final model answers every held-out prompt greedily, scored by exact match, and every
out-of-distribution prompt (sums of four digits: a second row, how far the learning reaches; a
figure, not a target).

Arms (each may use the task's oracle answers for the TRAINING prompts, as ours does; none ever
sees a held-out answer):

- ``composer``: our ``ComposerReplicationTrainer`` with the default's loss (GRPO + 0.1 x
  channel 2, hint self-distillation + 1.0 x channel 3, replay of the oracle traces, SimPO).
- ``trl_grpo``: TRL's ``GRPOTrainer`` on the shaped reward alone (it has no use for an oracle).
- ``trl_sft``: TRL's ``SFTTrainer`` on the oracle traces (prompt -> oracle answer, loss on the
  answer), 16 traces per step, the whole budget.
- ``trl_sft_grpo``: the standard pipeline: ``SFTTrainer`` on the oracle traces for a share of the
  budget (tuned: 0.25 / 0.5 / 0.75), then ``GRPOTrainer`` for the rest, on the same model.
- ``trl_sdpo``: TRL's ``trl.experimental.sdpo.SDPOTrainer`` (TRL 1.16; ``SDFTTrainer`` and
  ``CPOTrainer`` are in ``trl.experimental`` too, ``DPOTrainer`` in ``trl``) with the oracle
  answer of each training prompt as its ``privileged_context`` column and
  ``include_environment_feedback=True``: its teacher (the live policy, as our channel 2's)
  reads "Correct solution: <oracle answer>" for EVERY rollout, failed or not, and the
  distillation weight is the share of our loss weight that carries the oracle or a hint,
  ``(alpha + beta) / (1 + alpha + beta)`` = 0.52; the rest as our channel 2 (full-logit
  generalised JSD with beta 0.5, no importance-sampling clip, success threshold 0.5).

Tuning (the same for every arm, ours included): the learning rate from ``GRID_LR`` (1e-3, 3e-3,
1e-2) and the completions per prompt from ``GRID_G`` (2, 4; 16 prompts per step either way), by
coordinate search: every learning rate at G = 2, then G = 4 at the best one (SFT alone has no
completions: its search is the learning rates); for ``trl_sft_grpo`` also its budget split
(``SFT_SHARES``: 0.5 during the search, then 0.25 and 0.75 at its best lr and G). Each point is
scored by exact match on a VALIDATION split carved from the training prompts
(`Task.validation_view`: whole operand multisets, >= 128 prompts; those runs train on the
rest), with ONE seed (``--tune-seed``, 0). The held-out prompts are
used only by the final runs. Then every arm runs ``--seeds`` (5) seeds at its chosen settings
on the full training split.

Reported per arm: the median over seeds of held-out exact match with a 95% bootstrap interval
(resampling seeds, and within each seed the held-out operand multisets: the prompts of one
class are not independent), the largest share of one answer among the greedy answers (1.0 = a
constant answer), steps, and for ours the gradient share of channels 2 and 3 (every
``--probe-every`` micro-batches: ``|grad(alpha * sdpo)| / |grad(total)|`` and the same for
``beta * replay``, taken with ``torch.autograd.grad`` on the loss terms (`set_loss_probe`);
the probe's time is not charged to the budget).

``--ablation`` instead runs our channel variants (``composer_grpo`` channel 1 only,
``composer_sdpo`` 1 + 2, ``composer_replay`` 1 + 3, ``composer`` all) at ours' tuned settings,
``--seeds`` seeds, from scratch and from an SFT warm start (``--warm-start-steps`` steps of
TRL's ``SFTTrainer`` on the oracle traces of half the training prompts, the same start for every
variant of a seed, not charged to the budget), where a hint can change what the teacher
predicts (``--starts scratch`` or ``warm`` runs one of the two). The warm start itself is a row
too (``warm_start``, evaluated without training: ``warm_start_heldout_acc``), so that each
variant's figure reads as what its channels add to the same start.

Runs compared with each other run at the same time (``--jobs``, default 5: one process and
session per run; the arms of one seed together, the arms at one grid point together), because
under load a CPU second does less work (up to ~4x on the loaded 2-core machine,
docs/benchmarks-notebook.md): the budget is equal CPU seconds, and side by side the load affects every
arm of a comparison alike. Each record has the load average at its start and end.

Every finished run is appended to ``--log`` (JSON lines; default
``benchmarks/results/vs_trl.jsonl``); a rerun skips the runs already there (same settings,
budget and clock), so an interrupted measurement resumes. Prints one line per run, the tuning
table, the final table, and as the LAST line one JSON object: ``composer_heldout_acc``,
``trl_best_heldout_acc`` (the best TRL arm's median), ``trl_best_arm``,
``composer_minus_best_trl`` (with ``..._ci``, paired bootstrap), ``composer_constant_answer_share``,
one ``<arm>_heldout_acc`` (and ``<arm>_heldout_acc_ci``, ``<arm>_ood_acc``) per arm,
``intervals_overlap``, ``targets``, ``tuned`` (each arm's choice and its grid), ``per_seed``,
``budget_s``, ``clock``, ``seeds``, ``n_heldout``, ``heldout_classes``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from composer_replication.data.hints import HintTemplate

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

HERE = Path(__file__).resolve().parent
ARMS = ("composer", "trl_sft", "trl_sft_grpo", "trl_sdpo", "trl_grpo")  # in the order they run
TRL_ARMS = tuple(a for a in ARMS if a.startswith("trl_"))
# Our trainer with one channel set per variant ([loss] overrides; "composer" is the default's).
CHANNEL_VARIANTS: dict[str, list[str]] = {
    "composer_grpo": ["loss.alpha_sdpo=0.0", "loss.beta_replay=0.0"],
    "composer_sdpo": ["loss.beta_replay=0.0"],
    "composer_replay": ["loss.alpha_sdpo=0.0"],
}
# The ablation's row for the SFT warm start itself, before any variant trains (budget 0).
WARM_START = "warm_start"
GRID_LR = (1e-3, 3e-3, 1e-2)
GRID_G = (2, 4)
SFT_SHARES = (0.25, 0.5, 0.75)
PROMPTS_PER_STEP = 16
N_VAL = 128  # validation prompts carved from training (whole classes)
N_OOD = 256
MAX_STEPS = 100_000  # a cap the time budget always reaches first
# The embedded default run's compute: 2 replicas x 108-110 CPU s (docs/benchmarks-notebook.md).
DEFAULT_BUDGET_S = 220.0
SIGNAL_VERSION = 3  # see Spec.key
DEFAULT_SEEDS = 5
WARM_START_LR = 3e-3
# Channel 2's hints in our arms and the warm start's hinted examples: the SDPO reference runs'
# choice (`environment_feedback_only_without_solution`): a failed rollout whose sibling succeeded
# is shown that solution alone, the verifier's feedback only when no sibling succeeded.
HINTS = HintTemplate(feedback_with_solution=False)
TARGET_MARGIN = 0.05
BOOTSTRAP_REPS = 10_000


@dataclass(frozen=True)
class Spec:
    """One run: an arm at one grid point, one seed, on the validation or the held-out split."""

    arm: str
    seed: int
    lr: float
    g: int
    share: float | None  # trl_sft_grpo: the SFT share of the budget
    split: str  # "val" (tuning) or "heldout"
    warm: int  # SFT warm-start steps (0: from the random init)
    budget: float
    clock: str
    rpo: float = 0.0  # our arms: channel 3's NLL weight (loss.rpo_alpha); 0 for the others

    def key(self) -> str:
        fields = asdict(self)
        if not fields["rpo"]:  # the runs logged before the field existed trained without it
            del fields["rpo"]
        # The learning signal's version: runs logged before the reward judged what evaluation
        # judges (and before the hinted warm start and channel 2's gate; 3: the warm start's
        # hints as channel 2 writes them, `HINTS`) never match a new run.
        fields["signal"] = SIGNAL_VERSION
        return json.dumps(fields, sort_keys=True)


def rpo_alpha(arm: str, extra: list[str]) -> float:
    """Channel 3's NLL weight a run of `arm` trains with: the embedded default's
    (`loss.rpo_alpha`) after the user's overrides; 0 for an arm that does not train our loss."""
    if not arm.startswith("composer"):
        return 0.0
    from composer_replication.config import load_config

    return float(load_config(overrides=[*CHANNEL_VARIANTS.get(arm, []), *extra]).loss.rpo_alpha)


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


# --------------------------------------------------------------------------- building the arms


def arm_overrides(spec: Spec, extra: list[str]) -> list[str]:
    """The run-config overrides of a spec: its grid point (16 prompts x g completions per step),
    the channel variant, then the user's extra overrides."""
    return [
        f"train.learning_rate={spec.lr}",
        f"train.num_generations={spec.g}",
        f"train.batch_size={PROMPTS_PER_STEP * spec.g}",
        *CHANNEL_VARIANTS.get(spec.arm, []),
        *([f"loss.rpo_alpha={spec.rpo}"] if spec.arm.startswith("composer") else []),
        *extra,
    ]


def _trl_sdpo_args(config: Any, common: dict[str, Any]) -> Any:
    """TRL's SDPOConfig for the ``trl_sdpo`` arm (module docstring): our channel 2's divergence
    and teacher, the oracle answer as every rollout's privileged context."""
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
    oracle_weight = loss.alpha_sdpo + loss.beta_replay
    top_k = loss.sdpo_top_k
    return SDPOConfig(
        **common,
        **channel1,
        distillation_weight=oracle_weight / (1.0 + oracle_weight),
        distillation_mode="full_logits" if top_k is None else "topk_logits",
        distillation_topk=top_k,
        distillation_add_tail=loss.sdpo_add_tail if top_k is not None else False,
        distillation_alpha=loss.sdpo_jsd_beta,
        distillation_is_clip=None,
        teacher_model_kind="live",
        use_successful_as_teacher=True,
        success_reward_threshold=ComposerSettings().sdpo_success_threshold,
        include_environment_feedback=True,
        # the privileged context is the oracle answer: shown as a correct solution
        feedback_template="\nCorrect solution:\n\n{feedback_raw}\n\n",
        disable_dropout=False,  # as TRL's GRPOConfig (the tiny model has no dropout anyway)
        diagnostics_warning_interval=100,
    )


def sft_dataset(task: Any, examples: list[Any] | None = None, *, hinted: bool = False) -> Any:
    """The oracle traces of the task's training prompts in TRL's prompt-completion chat format
    (`SFTTrainer` then takes the loss on the answer only). With `hinted`, each also a second
    time under channel 2's hinted prompt (`Task.hinted_examples`: the solution, the solution and
    a wrong attempt's feedback, or the feedback alone, as channel 2's teacher is shown them), so
    the model learns to read the hint its teacher will be shown."""
    import datasets

    from composer_replication.tasks.task import chat_prompt

    plain = task.train_examples() if examples is None else examples
    shown = [*plain, *(task.hinted_examples(1.0, plain, HINTS) if hinted else [])]
    rows = [
        {
            "prompt": chat_prompt(ex.prompt),
            "completion": [{"role": "assistant", "content": task.oracle(ex)}],
        }
        for ex in shown
    ]
    return datasets.Dataset.from_list(rows)


def sft_runner(
    config: Any,
    model: Any,
    tok: Any,
    dataset: Any,
    scratch: str,
    lr: float,
    max_steps: int,
    callbacks: list[Any],
) -> Any:
    """TRL's SFTTrainer with the run's optimizer settings, 16 traces per step."""
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    from composer_replication.assembly.build import trl_training_args

    common = trl_training_args(config, scratch, max_steps, config.run.seed)
    for key in ("num_generations", "max_completion_length", "temperature"):
        common.pop(key)
    common.update(learning_rate=lr, per_device_train_batch_size=PROMPTS_PER_STEP)
    args = SFTConfig(**common, completion_only_loss=True)
    runner = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tok, callbacks=callbacks
    )
    runner.remove_callback(PrinterCallback)
    return runner


def rl_runner(
    arm: str, config: Any, model: Any, tok: Any, task: Any, scratch: str, callbacks: list[Any]
) -> Any:
    """The RL trainer of an arm (ours, TRL's GRPO or TRL's SDPO) on `config`'s settings."""
    from transformers.trainer_callback import PrinterCallback

    from composer_replication.assembly.build import (
        build_trainer,
        channel1_args,
        task_reward,
        train_split,
        trl_training_args,
    )

    seed = config.run.seed
    if arm.startswith("composer"):
        return build_trainer(
            config,
            model=model,
            tokenizer=tok,
            task=task,
            max_steps=MAX_STEPS,
            seed=seed,
            output_dir=scratch,
            callbacks=callbacks,
            settings={"hint_template": HINTS},
        )
    common = trl_training_args(config, scratch, MAX_STEPS, seed)
    dataset = train_split(config, task, rank=0)
    # plain floats for a stock trainer, judged on the text evaluation judges (assembly.task_reward)
    reward = [task_reward(task, tok, model, with_feedback=False)]
    if arm == "trl_sdpo":
        from trl.experimental.sdpo import SDPOTrainer as trainer_class

        oracle = {ex.id: task.oracle(ex) for ex in task.train_examples()}
        dataset = dataset.add_column(
            "privileged_context", [oracle[i] for i in dataset["example_id"]]
        )
        args = _trl_sdpo_args(config, common)
    else:
        from trl import GRPOConfig
        from trl import GRPOTrainer as trainer_class

        args = GRPOConfig(**common, **channel1_args(config))
    runner = trainer_class(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=callbacks,
    )
    runner.remove_callback(PrinterCallback)
    return runner


def warm_start(config: Any, model: Any, tok: Any, task: Any, steps: int, cache: Path) -> None:
    """SFT the seed's initial model for `steps` steps on the oracle traces of the first half of
    the distinct training prompts, each plain and under channel 2's hinted prompt (so that the
    hinted teacher can read its hint; `sft_dataset`), lr `WARM_START_LR`, 16 per step; cached
    per seed and steps: the same start for every variant of the seed."""
    import torch
    from safetensors.torch import load_model, save_model

    name = f"warm-seed{config.run.seed}-steps{steps}-{task.seed}-{task.n_train}-hinted3"
    path = cache / f"{name}.safetensors"
    if path.exists():
        load_model(model, str(path))  # tied embeddings: stored once, tied again
        torch.manual_seed(config.run.seed)
        return
    distinct = list({ex.prompt: ex for ex in task.train_examples()}.values())
    with tempfile.TemporaryDirectory(prefix="vs-trl-warm-") as scratch:
        sft_runner(
            config,
            model,
            tok,
            sft_dataset(task, distinct[: len(distinct) // 2], hinted=True),
            scratch,
            WARM_START_LR,
            steps,
            [],
        ).train()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_model(model, str(tmp))  # handles the tied input/output embeddings
    os.replace(tmp, path)
    torch.manual_seed(config.run.seed)  # the run starts from the same RNG state either way


def prepare_warm_start(seed: int, steps: int, extra: list[str], cache: str) -> None:
    """Build (and cache) seed's SFT warm start in this process (see `warm_start`)."""
    import torch
    from _inprocess import build_parts, run_config

    config = run_config(seed, MAX_STEPS, extra)
    if config.train.torch_threads > 0:
        torch.set_num_threads(config.train.torch_threads)
    task, model, tok = build_parts(config)
    warm_start(config, model, tok, task, steps, Path(cache))


def run_one(spec: Spec, probe_every: int, extra: list[str], cache: str) -> dict[str, Any]:
    import torch
    from _inprocess import RewardLog, WallBudget, build_parts, held_out, run_config

    load_start = round(os.getloadavg()[0], 1)
    config = run_config(spec.seed, MAX_STEPS, arm_overrides(spec, extra))
    if config.train.torch_threads > 0:  # as a replica of the run does
        torch.set_num_threads(config.train.torch_threads)
    task, model, tok = build_parts(config)  # bit-identical per seed for every arm
    if spec.split == "val":
        task = task.validation_view(N_VAL)
    if spec.warm:
        warm_start(config, model, tok, task, spec.warm, Path(cache))
    log = RewardLog()
    budgets: list[Any] = []
    probe = None
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as scratch:
        phases: list[tuple[str, float]] = [(spec.arm, spec.budget)]
        if spec.arm == WARM_START:  # the ablation's starting point: evaluated, not trained
            if not spec.warm:
                raise ValueError(f"arm {WARM_START!r} needs a warm start (Spec.warm > 0)")
            phases = []
        elif spec.arm == "trl_sft_grpo":
            share = 0.5 if spec.share is None else spec.share
            phases = [("sft", share * spec.budget), ("trl_grpo", (1 - share) * spec.budget)]
        elif spec.arm == "trl_sft":
            phases = [("sft", spec.budget)]
        for phase, seconds in phases:
            budget = WallBudget(seconds, spec.clock)
            budgets.append(budget)
            if phase == "sft":
                runner = sft_runner(
                    config, model, tok, sft_dataset(task), scratch, spec.lr, MAX_STEPS, [budget]
                )
            else:
                runner = rl_runner(phase, config, model, tok, task, scratch, [log, budget])
            loss = config.loss
            if phase.startswith("composer") and (loss.alpha_sdpo or loss.beta_replay):
                params = [p for p in runner.model.parameters() if p.requires_grad]
                probe = GradShare(params, probe_every, budget)
                runner.set_loss_probe(probe)
            runner.train()
    wall = time.monotonic() - t0
    examples = task.eval_examples()
    metrics = held_out(model, tok, task, config, examples=examples)
    ood = held_out(model, tok, task, config, examples=task.ood_examples(N_OOD))
    rewards = log.rewards
    return {
        **asdict(spec),
        "key": spec.key(),
        "acc": metrics["accuracy"],
        "reward": metrics["reward"],
        "constant_answer_share": metrics["constant_answer_share"],
        "top_answer": metrics["top_answer"],
        "n": metrics["n"],
        "correct": metrics["correct"],
        "classes": [task.canonical(ex) for ex in examples],
        "prompts": [ex.prompt for ex in examples],
        "ood_acc": ood["accuracy"],
        "steps": sum(b.steps for b in budgets),
        "phase_steps": [b.steps for b in budgets],
        "train_seconds": round(sum(b.seconds for b in budgets), 1),
        "wall_seconds": round(wall, 1),
        "last10_train_reward": statistics.fmean(rewards[-10:]) if rewards else None,
        "teacher_advantage": log.mean("sdpo/teacher_advantage"),
        "teacher_advantage_last10": log.mean("sdpo/teacher_advantage", 10),
        "gate_open_share": log.mean("sdpo/gate_open"),
        "entropy_last10": log.mean("entropy", 10),
        "zero_std_share_last10": log.mean("frac_reward_zero_std", 10),
        "channel2_loss_share": None if probe is None else probe.mean("sdpo"),
        "channel3_loss_share": None if probe is None else probe.mean("replay"),
        "probed_micro_batches": 0 if probe is None else len(probe.shares["sdpo"]),
        "torch_threads": torch.get_num_threads(),
        "load_start": load_start,
        **provenance(),
    }


def provenance() -> dict[str, Any]:
    """Where and when a run was measured: commit, date, CPU model, load average."""
    import platform
    import subprocess

    try:
        commit = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except OSError:
        commit = ""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        "load": round(os.getloadavg()[0], 1),
    }


# --------------------------------------------------------------------------- plans


def tuning_specs(
    arm: str,
    seed: int,
    budget: float,
    clock: str,
    quick: bool,
    done: dict[str, dict[str, Any]],
    rpo: float = 0.0,
) -> list[Spec]:
    """The validation runs of an arm's coordinate search, as far as the finished runs (`done`,
    by key) decide them: (A) every learning rate of the grid at the first G (trl_sft_grpo at
    SFT share 0.5); (B) the other G at A's best learning rate (not for trl_sft, which has no
    completions); (C) trl_sft_grpo only: the other SFT shares at the best (lr, G) so far. The
    same search for every arm. `--quick`: one point."""
    lrs, gs = ((3e-3,), (2,)) if quick else (GRID_LR, GRID_G)
    share = 0.5 if arm == "trl_sft_grpo" else None
    base = Spec(arm, seed, lrs[0], gs[0], share, "val", 0, budget, clock, rpo)
    specs = [replace(base, lr=lr) for lr in lrs]
    if not all(s.key() in done for s in specs):
        return specs
    best = choose([done[s.key()] for s in specs])
    if arm != "trl_sft":
        specs += [replace(base, lr=best["lr"], g=g) for g in gs[1:]]
    if arm != "trl_sft_grpo" or quick or not all(s.key() in done for s in specs):
        return specs
    best = choose([done[s.key()] for s in specs])
    return specs + [
        replace(base, lr=best["lr"], g=best["g"], share=x) for x in SFT_SHARES if x != 0.5
    ]


def choose(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The best validation run: highest exact match, then highest mean reward, then the first
    (lower lr, fewer completions)."""
    best = max(range(len(runs)), key=lambda i: (runs[i]["acc"], runs[i]["reward"], -i))
    r = runs[best]
    return {"lr": r["lr"], "g": r["g"], "share": r["share"], "val_acc": r["acc"]}


# --------------------------------------------------------------------------- statistics


def bootstrap(
    per_arm: dict[str, list[dict[str, Any]]], reps: int = BOOTSTRAP_REPS, seed: int = 0
) -> dict[str, Any]:
    """Medians over seeds and their 95% percentile intervals, resampling seeds and, within each
    seed, its held-out classes (the same resample for every arm: paired). Returns
    {arm: (lo, hi)} and the per-replicate medians {arm: array}."""
    import numpy as np

    rng = np.random.default_rng(seed)
    arms = [a for a, runs in per_arm.items() if runs]
    seeds = sorted({r["seed"] for a in arms for r in per_arm[a]})
    seeds = [s for s in seeds if all(any(r["seed"] == s for r in per_arm[a]) for a in arms)]
    # per seed: class index of every prompt, and per arm the correct count per class
    tables = []
    for s in seeds:
        runs = {a: next(r for r in per_arm[a] if r["seed"] == s) for a in arms}
        ref = runs[arms[0]]
        names = sorted(set(ref["classes"]))
        index = {c: i for i, c in enumerate(names)}
        sizes = np.bincount([index[c] for c in ref["classes"]], minlength=len(names)).astype(float)
        correct = {}
        for a in arms:  # per class, aligned by prompt (the same held-out set for every arm)
            if sorted(runs[a]["prompts"]) != sorted(ref["prompts"]):
                raise ValueError(f"seed {s}: arm {a} was evaluated on other held-out prompts")
            idx = [index[c] for c in runs[a]["classes"]]
            correct[a] = np.bincount(
                idx, weights=np.array(runs[a]["correct"], dtype=float), minlength=len(names)
            )
        tables.append((sizes, correct))
    k = len(seeds)
    meds = {a: np.empty(reps) for a in arms}
    for b in range(reps):
        pick = rng.integers(0, k, size=k)
        accs: dict[str, list[float]] = {a: [] for a in arms}
        for j in pick:
            sizes, correct = tables[j]
            take = rng.integers(0, len(sizes), size=len(sizes))
            n = sizes[take].sum()
            for a in arms:
                accs[a].append(correct[a][take].sum() / n)
        for a in arms:
            meds[a][b] = np.median(accs[a])
    intervals = {
        a: (float(np.percentile(meds[a], 2.5)), float(np.percentile(meds[a], 97.5))) for a in arms
    }
    return {"intervals": intervals, "replicates": meds, "seeds": seeds}


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (mid - half, mid + half)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(final: list[dict[str, Any]], arms: list[str], reps: int) -> dict[str, Any]:
    import numpy as np

    per_arm = {
        a: sorted((r for r in final if r["arm"] == a), key=lambda r: r["seed"]) for a in arms
    }
    med = {
        a: {
            key: _median([r[key] for r in runs])
            for key in (
                "acc",
                "ood_acc",
                "constant_answer_share",
                "steps",
                "channel2_loss_share",
                "channel3_loss_share",
                "last10_train_reward",
            )
        }
        for a, runs in per_arm.items()
    }
    boot = bootstrap(per_arm, reps) if all(per_arm.values()) else None
    out: dict[str, Any] = {}
    for a in arms:
        out[f"{a}_heldout_acc"] = med[a]["acc"]
        out[f"{a}_heldout_acc_ci"] = None if boot is None else _r2(boot["intervals"][a])
        out[f"{a}_ood_acc"] = med[a]["ood_acc"]
    trl = [a for a in arms if a in TRL_ARMS and med[a]["acc"] is not None]
    best = max(trl, key=lambda a: med[a]["acc"]) if trl else None
    comp = med.get("composer", {}).get("acc")
    out["composer_heldout_acc"] = comp
    out["trl_best_arm"] = best
    out["trl_best_heldout_acc"] = None if best is None else med[best]["acc"]
    diff = None if comp is None or best is None else comp - med[best]["acc"]
    out["composer_minus_best_trl"] = diff
    diff_ci = overlap = None
    if diff is not None and boot is not None:
        d = boot["replicates"]["composer"] - boot["replicates"][best]
        diff_ci = (float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5)))
        lo_c, hi_c = boot["intervals"]["composer"]
        lo_t, hi_t = boot["intervals"][best]
        overlap = not (lo_c > hi_t or lo_t > hi_c)
    out["composer_minus_best_trl_ci"] = None if diff_ci is None else _r2(diff_ci)
    out["intervals_overlap"] = overlap
    out["composer_constant_answer_share"] = med.get("composer", {}).get("constant_answer_share")
    out["channel2_loss_share"] = med.get("composer", {}).get("channel2_loss_share")
    out["channel3_loss_share"] = med.get("composer", {}).get("channel3_loss_share")
    out["targets"] = {
        "composer_ahead_by_0.05": None if diff is None else diff >= TARGET_MARGIN - 1e-12,
        "intervals_apart": None if overlap is None else not overlap,
    }
    out["medians"] = med
    out["per_seed"] = {a: [_brief(r) for r in runs] for a, runs in per_arm.items()}
    return out


def _r2(pair: tuple[float, float]) -> list[float]:
    return [round(pair[0], 4), round(pair[1], 4)]


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    skip = {"correct", "classes", "prompts", "key", "arm"}
    return {k: v for k, v in r.items() if k not in skip}


# --------------------------------------------------------------------------- running


class Log:
    """The finished runs (JSON lines at `path`), keyed by `Spec.key()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line
                self.done[r["key"]] = r

    def add(self, r: dict[str, Any]) -> None:
        self.done[r["key"]] = r
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(r) + "\n")


def execute(
    batches: list[list[Spec]], log: Log, jobs: int, probe_every: int, extra: list[str], cache: str
) -> list[dict[str, Any]]:
    """Run every spec not in the log, a batch at a time: the specs of one batch run CONCURRENTLY
    (up to `jobs` at once; a larger batch is split), each in a process and a session of its own
    (as the run's replica processes are), so that the machine's load affects the runs compared
    with each other alike: under load a CPU second does less work. Returns every spec's record.
    """
    for batch in batches:
        todo = [s for s in dict.fromkeys(batch) if s.key() not in log.done]
        for i in range(0, len(todo), jobs):
            chunk = todo[i : i + jobs]
            if len(chunk) == 1 and jobs == 1:
                r = run_one(chunk[0], probe_every, extra, cache)
                log.add(r)
                _print_run(r)
                continue
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads
            with ProcessPoolExecutor(len(chunk), mp_context=ctx, initializer=os.setsid) as pool:
                futures = [pool.submit(run_one, s, probe_every, extra, cache) for s in chunk]
                for f in futures:  # every run of the chunk finishes before the next starts
                    r = f.result()
                    log.add(r)
                    _print_run(r)
    return [log.done[s.key()] for batch in batches for s in batch]


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _print_run(r: dict[str, Any]) -> None:
    share = "" if r["share"] is None else f" sft share {r['share']}"
    ch = (
        ""
        if r["channel2_loss_share"] is None
        else f", ch2/ch3 grad share {r['channel2_loss_share']:.4f}/"
        f"{_fmt(r['channel3_loss_share'], 4)}"
    )
    warm = f" warm {r['warm']}" if r["warm"] else ""
    print(
        f"{r['arm']:16s} seed {r['seed']} {r['split']:7s} lr {r['lr']:g} G {r['g']}{share}{warm}:"
        f" acc {r['acc']:.3f} (ood {r['ood_acc']:.3f}), constant share "
        f"{r['constant_answer_share']:.3f} ({r['top_answer']!r}), {r['steps']} steps in "
        f"{r['train_seconds']:.0f} {r['clock']} s, last-10 reward "
        f"{_fmt(r['last10_train_reward'])}{ch}",
        flush=True,
    )


def tune(arms: list[str], a: argparse.Namespace, log: Log, budget: float) -> dict[str, Any]:
    """Every arm's coordinate search on the validation split; {arm: choice + its runs}. Each
    stage's pending runs go in batches across arms (the k-th pending run of every arm together:
    in stage A, one learning rate for every arm at once), run concurrently."""
    rpos = {arm: rpo_alpha(arm, a.overrides) for arm in arms}
    while True:  # each pass runs the next stage of every arm's search
        pending = {
            arm: [
                s
                for s in tuning_specs(
                    arm, a.tune_seed, budget, a.clock, a.quick, log.done, rpos[arm]
                )
                if s.key() not in log.done
            ]
            for arm in arms
        }
        depth = max(len(v) for v in pending.values())
        if depth == 0:
            break
        busy = [arm for arm in arms if pending[arm]]
        if len(busy) == 1:  # one arm's runs (trl_sft_grpo's budget splits) all at once
            batches = [pending[busy[0]]]
        else:
            batches = [
                [pending[arm][k] for arm in busy if k < len(pending[arm])] for k in range(depth)
            ]
        execute(batches, log, a.jobs, a.probe_every, a.overrides, a.cache)
    tuned: dict[str, Any] = {}
    for arm in arms:
        runs = [
            log.done[s.key()]
            for s in tuning_specs(arm, a.tune_seed, budget, a.clock, a.quick, log.done, rpos[arm])
        ]
        tuned[arm] = {
            **choose(runs),
            "rpo_alpha": rpos[arm],
            "grid": [
                {
                    "lr": r["lr"],
                    "g": r["g"],
                    "share": r["share"],
                    "val_acc": r["acc"],
                    "val_reward": round(r["reward"], 4),
                    "steps": r["steps"],
                }
                for r in runs
            ],
        }
    return tuned


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: a 1-point grid, 1 seed, 12 s per run (figures mean nothing)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="training seconds per run, counted by --clock (default 220, the "
        "embedded default run's CPU seconds; --quick: 12)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="cpu",
        help="what the budget counts: the run's CPU seconds (default) or wall seconds",
    )
    p.add_argument("--seeds", type=int, default=None, help="final seeds (default 5; --quick 1)")
    p.add_argument("--first-seed", type=int, default=0, help="final seeds start here (default 0)")
    p.add_argument("--tune-seed", type=int, default=0, help="the tuning runs' seed (default 0)")
    p.add_argument(
        "--arms", default=None, help=f"comma-separated subset of {', '.join(ARMS)} (default: all)"
    )
    p.add_argument(
        "--ablation",
        action="store_true",
        help="our channel variants at ours' tuned settings, from scratch and from an "
        "SFT warm start (instead of the comparison)",
    )
    p.add_argument(
        "--variants",
        default=None,
        help="--ablation: comma-separated subset of "
        f"{', '.join([*CHANNEL_VARIANTS, 'composer'])} (default: all)",
    )
    p.add_argument(
        "--warm-start-steps",
        type=int,
        default=250,
        help="--ablation: SFT steps of the warm start (default 250)",
    )
    p.add_argument(
        "--starts",
        choices=("both", "scratch", "warm"),
        default="both",
        help="--ablation: from scratch, from the SFT warm start, or both (default)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="--ablation: train every variant at this learning rate instead of ours' tuned one "
        "(with --g: no tuning runs)",
    )
    p.add_argument(
        "--g", type=int, default=None, help="--ablation: completions per prompt (with --lr)"
    )
    p.add_argument(
        "--probe-every",
        type=int,
        default=5,
        help="measure the channels' gradient shares every N micro-batches (default 5)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=len(ARMS),
        help="at most this many runs at once (default 5: the arms of a comparison run side by "
        "side, so the load affects them alike; each has train.torch_threads)",
    )
    p.add_argument(
        "--log",
        default=str(HERE / "results" / "vs_trl.jsonl"),
        help="finished runs, appended as JSON lines; a rerun skips those already "
        "there (default benchmarks/results/vs_trl.jsonl)",
    )
    p.add_argument("--cache", default=None, help="warm-start weights (default: beside --log)")
    p.add_argument("--bootstrap", type=int, default=BOOTSTRAP_REPS, help="bootstrap replicates")
    p.add_argument("overrides", nargs="*", help="extra section.key=value config overrides")
    a = p.parse_args()
    budget = a.budget_s or (12.0 if a.quick else DEFAULT_BUDGET_S)
    seeds = a.seeds or (1 if a.quick else DEFAULT_SEEDS)
    if budget <= 0 or seeds < 1 or a.probe_every < 1 or a.jobs < 1 or a.warm_start_steps < 0:
        p.error("--budget-s must be > 0; --seeds, --probe-every, --jobs >= 1; warm start >= 0")
    if a.starts == "warm" and not a.warm_start_steps:
        p.error("--starts warm needs --warm-start-steps > 0")
    arms = list(ARMS)
    if a.arms:
        arms = [t.strip() for t in a.arms.split(",") if t.strip()]
        unknown = sorted(set(arms) - set(ARMS))
        if unknown or not arms:
            p.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    if a.ablation:
        arms = ["composer"]
    every = [*CHANNEL_VARIANTS, "composer"]
    a.variants = [t.strip() for t in (a.variants or ",".join(every)).split(",") if t.strip()]
    if set(a.variants) - set(every) or not a.variants:
        p.error(f"--variants: unknown {sorted(set(a.variants) - set(every))}; choose from {every}")
    if (a.lr is None) != (a.g is None) or (a.lr is not None and not a.ablation):
        p.error("--lr and --g go together, with --ablation")
    a.cache = a.cache or str(Path(a.log).parent / "warm")
    log = Log(Path(a.log))
    t0 = time.monotonic()
    final_seeds = range(a.first_seed, a.first_seed + seeds)
    if a.ablation and a.lr is not None:  # settings given: no tuning runs
        ablation(a, log, {"lr": a.lr, "g": a.g}, budget, final_seeds, t0)
        return
    tuned = tune(arms, a, log, budget)
    print(
        f"\ntuning on the validation split (seed {a.tune_seed}, {N_VAL}+ prompts carved from "
        f"training, whole classes): exact match per grid point"
    )
    for arm in arms:
        cells = ", ".join(
            f"lr {c['lr']:g} G {c['g']}"
            + ("" if c["share"] is None else f" share {c['share']}")
            + f": {c['val_acc']:.3f}"
            for c in tuned[arm]["grid"]
        )
        print(
            f"{arm:16s} | {cells} | chosen lr {tuned[arm]['lr']:g} G {tuned[arm]['g']}"
            + ("" if tuned[arm]["share"] is None else f" share {tuned[arm]['share']}")
            + (f" (rpo_alpha {tuned[arm]['rpo_alpha']:g})" if tuned[arm]["rpo_alpha"] else "")
        )
    if a.ablation:
        ablation(a, log, tuned["composer"], budget, final_seeds, t0)
        return
    batches = [
        [
            Spec(
                arm,
                s,
                tuned[arm]["lr"],
                tuned[arm]["g"],
                tuned[arm]["share"],
                "heldout",
                0,
                budget,
                a.clock,
                rpo_alpha(arm, a.overrides),
            )
            for arm in arms
        ]
        for s in final_seeds
    ]
    final = execute(batches, log, a.jobs, a.probe_every, a.overrides, a.cache)
    summary = summarize(final, arms, a.bootstrap)
    n = final[0]["n"]
    n_classes = len(set(final[0]["classes"]))
    print(
        f"\nembedded default's task, {budget:.0f} {a.clock} s of training per run, {seeds} "
        f"seed(s), {n} held-out prompts ({n_classes} operand multisets in seed "
        f"{final[0]['seed']}), greedy exact match; medians over seeds, 95% bootstrap intervals"
    )
    print(f"{'arm':16s} | held-out acc [95% CI]  | ood acc | constant share | steps | ch2 / ch3")
    for arm in arms:
        m = summary["medians"][arm]
        ci = summary[f"{arm}_heldout_acc_ci"] or [math.nan, math.nan]
        print(
            f"{arm:16s} | {m['acc']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] | {m['ood_acc']:7.3f} | "
            f"{m['constant_answer_share']:14.3f} | {m['steps']:5.0f} | "
            f"{_fmt(m['channel2_loss_share'], 4)} / {_fmt(m['channel3_loss_share'], 4)}"
        )
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    print("targets: " + ", ".join(f"{k} {verdict[v]}" for k, v in summary["targets"].items()))
    summary.update(
        tuned=tuned,
        budget_s=budget,
        clock=a.clock,
        seeds=seeds,
        n_heldout=n,
        heldout_classes=n_classes,
        grid_lr=list(GRID_LR),
        grid_g=list(GRID_G),
        sft_shares=list(SFT_SHARES),
        n_val=N_VAL,
        seconds=round(time.monotonic() - t0, 1),
    )
    print(json.dumps(summary))


def ablation(
    a: argparse.Namespace, log: Log, chosen: dict[str, Any], budget: float, seeds: range, t0: float
) -> None:
    """Our channel variants at ours' tuned (lr, G), from scratch and from the SFT warm start."""
    variants = a.variants
    starts = [0, a.warm_start_steps] if a.warm_start_steps else [0]
    if a.starts != "both":
        starts = [starts[0] if a.starts == "scratch" else starts[-1]]

    def rows(w: int) -> list[str]:  # a warm start's own row first: what the variants add to
        return [WARM_START, *variants] if w else variants

    batches = [
        [
            Spec(
                v,
                s,
                chosen["lr"],
                chosen["g"],
                None,
                "heldout",
                w,
                0.0 if v == WARM_START else budget,
                a.clock,
                rpo_alpha(v, a.overrides),
            )
            for v in rows(w)
        ]
        for w in starts
        for s in seeds
    ]
    for s in seeds:  # the warm starts, once per seed, before the variants that share them
        if a.warm_start_steps and any(
            x.key() not in log.done for b in batches for x in b if x.warm and x.seed == s
        ):
            prepare_warm_start(s, a.warm_start_steps, a.overrides, a.cache)
    runs = execute(batches, log, a.jobs, a.probe_every, a.overrides, a.cache)
    result: dict[str, Any] = {
        "budget_s": budget,
        "clock": a.clock,
        "seeds": len(seeds),
        "lr": chosen["lr"],
        "g": chosen["g"],
    }
    how = "given" if a.lr is not None else "ours' tuned"
    print(
        f"\nablation at {how} settings (lr {chosen['lr']:g}, G {chosen['g']}), "
        f"{budget:.0f} {a.clock} s per run, {len(seeds)} seeds; medians [95% bootstrap CI]; "
        "teacher adv.: channel 2's hinted teacher's reward minus the student's (mean over the "
        "run), gate: share of batches it let through"
    )
    print(
        f"{'variant':16s} | start    | held-out acc [95% CI]  | ood   | ch2 share | ch3 share"
        " | teacher adv. | gate | const."
    )
    for w in starts:
        per = {v: [r for r in runs if r["arm"] == v and r["warm"] == w] for v in rows(w)}
        boot = bootstrap(per, a.bootstrap)
        label = "scratch" if w == 0 else f"sft {w}"
        for v in rows(w):
            med = {
                k: _median([r.get(k) for r in per[v]])
                for k in (
                    "acc",
                    "ood_acc",
                    "channel2_loss_share",
                    "channel3_loss_share",
                    "teacher_advantage",
                    "gate_open_share",
                    "constant_answer_share",
                )
            }
            lo, hi = boot["intervals"][v]
            print(
                f"{v:16s} | {label:8s} | {med['acc']:.3f} [{lo:.3f}, {hi:.3f}] | "
                f"{med['ood_acc']:.3f} | {_fmt(med['channel2_loss_share'], 4):>9s} | "
                f"{_fmt(med['channel3_loss_share'], 4):>9s} | "
                f"{_fmt(med['teacher_advantage']):>12s} | {_fmt(med['gate_open_share'], 2):>4s} | "
                f"{_fmt(med['constant_answer_share'], 2)}"
            )
            key = v if v == WARM_START else f"{v}_{'scratch' if w == 0 else 'warm'}"
            result[f"{key}_heldout_acc"] = med["acc"]
            result[f"{key}_heldout_acc_ci"] = _r2((lo, hi))
            result[f"{key}_ood_acc"] = med["ood_acc"]
            result[f"{key}_channel2_loss_share"] = med["channel2_loss_share"]
            result[f"{key}_channel3_loss_share"] = med["channel3_loss_share"]
            result[f"{key}_teacher_advantage"] = med["teacher_advantage"]
            result[f"{key}_gate_open_share"] = med["gate_open_share"]
            result[f"{key}_constant_answer_share"] = med["constant_answer_share"]
            result.setdefault("per_seed", {})[key] = [_brief(r) for r in per[v]]
    result["warm_start_steps"] = a.warm_start_steps
    result["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
