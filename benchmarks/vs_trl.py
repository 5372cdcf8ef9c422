"""Our trainer against TRL's, every arm given the same information and its own fit tuning.

    python benchmarks/vs_trl.py [--quick] [--budget-s S] [--clock cpu|wall] [--seeds K]
                                [--first-seed N] [--arms a,b] [--jobs N] [--log PATH]
                                [--regimes partial,oracle] [--trace-share S]
                                [--teacher-accuracy P] [--base-steps N] [--out PATH]
                                [--plot PNG] [--summary-only]
                                [--ablation] [--warm-start-steps N] [--starts S] [section.key=value ...]

Setting: the embedded default's task (`composer-replication config show`): sums of three digits,
700 training prompts, 256 held-out prompts that share no operand multiset with a training prompt
(whole equivalence classes held out, tasks/task.py), the tiny Qwen2 (hidden 64, 2 layers,
char-level tokenizer), 16 prompts per step, the task's shaped reward judged on the text
evaluation judges. Every arm of a seed starts from the same BASE model (`--base-steps`, default
300: the seed's random init after 300 SFT steps on the easy level's two-digit sums `a+b=`, plain
and under channel 2's hint template; no prompt of the benchmark, which has three terms): what a
pretrained model is to RL, so that an RL arm has a policy to improve (from the random init the
benchmark's GRPO arms learnt nothing). ONE process, one replica (no DiLoCo),
`train.torch_threads` (1) torch threads. Each run trains until its budget (`--budget-s`, default
220) is spent, counted in the run's CPU seconds from `on_train_begin` (`--clock cpu`, the
default: the time a run waits for a core is not charged; a loaded machine still does less work
per CPU second, so the arms of one comparison run side by side where `--jobs` allows); then its
final model answers every held-out prompt greedily, scored by exact match, and every
out-of-distribution prompt (sums of four digits: how far the learning reaches; a figure, not a
target). Final runs also record a LEARNING CURVE: held-out exact match at the start and at
`CURVE_POINTS` (1/4, 1/2, 3/4) of the budget, not charged to it (`--plot` draws them).

Two information regimes (`--regimes`, both by default; the partial one runs first):

- ``oracle``: a correct teacher trace (the oracle answer) for every training prompt: the regime
  where supervised learning must win.
- ``partial``: teacher traces for `--trace-share` (0.25) of the distinct training prompts, drawn
  per seed, of which `--teacher-accuracy` (0.7) are right and the rest the right integer off by
  1-3 (`teacher_traces`); the task's verifier (the reward) for EVERY prompt, and so for every
  trace: the regime the Composer recipe is for.

Arms (none ever sees a held-out answer; each gets the regime's traces and the verifier):

- ``composer``: our ``ComposerReplicationTrainer`` with the default's loss (GRPO + 0.1 x
  channel 2, hint self-distillation + 1.0 x channel 3, replay of the traces with their NLL,
  SimPO); the traces reach it as a trace file scored by the verifier (what ``bake-traces``
  writes), so channel 3 prefers a trace only to rollouts the verifier scores lower.
- ``trl_sft``: TRL's ``SFTTrainer`` on every available trace, wrong ones included.
- ``trl_rft``: rejection-sampling fine-tuning: ``SFTTrainer`` on the traces the verifier accepts
  (partial regime only: with the oracle's traces it is ``trl_sft``).
- ``trl_sft_grpo``: the standard pipeline: ``SFTTrainer`` on the accepted traces for
  ``SFT_SHARE`` (half) of the budget, then ``GRPOTrainer`` for the rest, on the same model.
- ``trl_sdpo``: TRL's ``trl.experimental.sdpo.SDPOTrainer`` (TRL 1.16) with the accepted trace
  of a prompt as its ``privileged_context`` where there is one ("" elsewhere: no context) and
  ``include_environment_feedback=True``: its teacher (the live policy, as our channel 2's) reads
  "Correct solution: <trace>"; the distillation weight is the share of our loss weight that
  carries a trace or a hint, ``(alpha + beta) / (1 + alpha + beta)`` = 0.52; the rest as our
  channel 2 (full-logit generalised JSD with beta 0.5, no importance-sampling clip, success
  threshold 0.5).
- ``trl_grpo``: TRL's ``GRPOTrainer`` on the verifier's reward alone.

Tuning, fit for each arm, on a VALIDATION split carved from the training prompts
(`Task.validation_view`: whole operand multisets, >= 128 prompts, which never get a trace; those
runs train on the rest), with ONE seed (``--tune-seed``, 0), per regime: an RL arm (ours, TRL's
GRPO and SDPO) searches the learning rates ``RL_GRID_LR`` (1e-4, 3e-4, 1e-3) at G = 4
completions per prompt, then G = 8 (``GRID_G``) at the best (16 prompts per step either way);
an SFT arm the learning rates ``SFT_GRID_LR`` (1e-3, 3e-3, 1e-2); SFT -> GRPO each phase on its
own: its SFT phase alone (``trl_sft_grpo:sft``, half the budget) at every SFT learning rate, then
its GRPO phase as an RL arm, each point starting from the best SFT phase's model (cached). No
extra TRL stabiliser (KL, more updates per batch, DAPO's clip-higher): channel 1's settings are
the run's, for ours and TRL's alike (`assembly.build.channel1_args`). The held-out prompts are
used only by the final runs; then every arm runs ``--seeds`` (5) seeds at its chosen settings.

Reported per arm and regime: the median over seeds of held-out exact match with a 95% bootstrap
interval (resampling seeds, and within each seed the held-out operand multisets: the prompts of
one class are not independent), the largest share of one answer among the greedy answers (1.0 =
a constant answer), steps, and for ours the gradient share of channels 2 and 3 (every
``--probe-every`` micro-batches: ``|grad(alpha * sdpo)| / |grad(total)|`` and the same for
``beta * replay``, taken with ``torch.autograd.grad`` on the loss terms (`set_loss_probe`); the
probe's time is not charged to the budget).

``--ablation`` instead runs our channel variants (``composer_grpo`` channel 1 only,
``composer_sdpo`` 1 + 2, ``composer_replay`` 1 + 3, ``composer`` all) at ours' tuned settings
(or ``--lr``/``--g``), ``--seeds`` seeds, from the random init and from an SFT warm start
(``--warm-start-steps`` steps of TRL's ``SFTTrainer`` on the oracle traces of half the training
prompts, plain and hinted, the same start for every variant of a seed, not charged to the
budget; ``--starts scratch`` or ``warm`` runs one of the two). The warm start itself is a row too
(``warm_start``, evaluated without training: ``warm_start_heldout_acc``).

Every finished run is appended to ``--log`` (JSON lines; default
``benchmarks/results/vs_trl.jsonl``); a rerun skips the runs already there (same settings,
budget and clock), so an interrupted measurement resumes, and ``--summary-only`` summarises what
the log holds without running anything (a measurement cut short). Each record has the commit,
CPU model and load average. Prints one line per run, the tuning table (the grid and the chosen
points), the final table per regime, and as the LAST line one JSON object (also ``--out``,
written after each regime, with ``machine``: CPU model and flags, cores, commit, load):
``composer_heldout_acc``, ``trl_best_heldout_acc`` (the best TRL arm's median),
``trl_best_arm``, ``composer_minus_best_trl`` (with ``..._ci``, paired bootstrap),
``composer_constant_answer_share``, one ``<arm>_heldout_acc`` (and ``<arm>_heldout_acc_ci``,
``<arm>_ood_acc``) per arm, ``intervals_overlap``, ``targets``, ``tuned`` (each arm's choice and
its grid), ``per_seed`` (with each run's curve), ``seeds``, ``n_heldout``, ``heldout_classes``
for the oracle regime; the same keys with ``_partial`` (before a trailing ``_ci``:
``composer_minus_best_trl_partial_ci``) for the partial regime, and ``targets_partial``
(ours ahead of the best TRL arm by >= 0.05 with the paired interval above 0); ``budget_s``,
``clock``, ``base_steps``, the grids.
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

from transformers import TrainerCallback

from composer_replication.data.hints import HintTemplate

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

HERE = Path(__file__).resolve().parent
# in the order they run; trl_rft only in the partial regime (with perfect traces it is trl_sft)
ARMS = ("composer", "trl_sft", "trl_rft", "trl_sft_grpo", "trl_sdpo", "trl_grpo")
TRL_ARMS = tuple(a for a in ARMS if a.startswith("trl_"))
RL_ARMS = ("composer", "trl_grpo", "trl_sdpo")  # tuned on RL_GRID_LR x GRID_G
SFT_ARMS = ("trl_sft", "trl_rft")  # tuned on SFT_GRID_LR
# trl_sft_grpo's first phase on its own: a tuning run of its SFT learning rate, whose model the
# second phase's tuning runs start from (cached, `phase_one`).
SFT_PHASE = "trl_sft_grpo:sft"
REGIMES = ("partial", "oracle")  # the order they run
# Our trainer with one channel set per variant ([loss] overrides; "composer" is the default's).
CHANNEL_VARIANTS: dict[str, list[str]] = {
    "composer_grpo": ["loss.alpha_sdpo=0.0", "loss.beta_replay=0.0"],
    "composer_sdpo": ["loss.beta_replay=0.0"],
    "composer_replay": ["loss.alpha_sdpo=0.0"],
}
# The ablation's row for the SFT warm start itself, before any variant trains (budget 0).
WARM_START = "warm_start"
RL_GRID_LR = (1e-4, 3e-4, 1e-3)  # the RL arms' learning rates (ours, GRPO, SDPO, SFT -> GRPO's 2nd)
SFT_GRID_LR = (1e-3, 3e-3, 1e-2)  # the SFT arms' learning rates (and SFT -> GRPO's first phase)
GRID_G = (4, 8)
SFT_SHARE = 0.5  # SFT -> GRPO: the SFT phase's share of the budget (not tuned: compute)
# Learning curves: held-out exact match at these shares of the budget (not charged to it), besides
# the start and the end.
CURVE_POINTS = (0.25, 0.5, 0.75)
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
# The base model every arm of the comparison starts from: the seed's init after this many SFT
# steps on the easy level's two-digit sums (`a+b=`, another problem distribution: no prompt of
# three terms), plain and under channel 2's hint template, so that it can add and read a hint.
DEFAULT_BASE_STEPS = 300
DEFAULT_TRACE_SHARE = 0.25
DEFAULT_TEACHER_ACCURACY = 0.7
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
    sft_lr: float | None = None  # trl_sft_grpo: its SFT phase's learning rate (tuned apart)
    traces: float = 1.0  # the share of the training prompts with a teacher trace
    teacher_acc: float = 1.0  # the share of those traces that are right
    base: int = 0  # base-model SFT steps on the easy level (`base_start`; 0: the random init)
    curve: bool = False  # held-out exact match at CURVE_POINTS of the budget too

    def key(self) -> str:
        fields = asdict(self)
        if not fields["rpo"]:  # the runs logged before the field existed trained without it
            del fields["rpo"]
        # fields added later, at the value every run logged before them had
        for name, default in (
            ("sft_lr", None),
            ("traces", 1.0),
            ("teacher_acc", 1.0),
            ("base", 0),
            ("curve", False),
        ):
            if fields[name] == default:
                del fields[name]
        # The learning signal's version: runs logged before the reward judged what evaluation
        # judges (and before the hinted warm start and channel 2's gate; 3: the warm start's
        # hints as channel 2 writes them, `HINTS`) never match a new run.
        fields["signal"] = SIGNAL_VERSION
        return json.dumps(fields, sort_keys=True)

    @property
    def regime(self) -> str:
        return "oracle" if self.traces == 1.0 and self.teacher_acc == 1.0 else "partial"


@dataclass(frozen=True)
class Trace:
    """A teacher's answer to one training prompt, and whether the task's verifier accepts it."""

    example: Any
    text: str
    correct: bool
    reward: float


def teacher_traces(task: Any, share: float, accuracy: float, seed: int) -> list[Trace]:
    """The teacher traces of a regime: for `share` of the task's distinct training prompts (drawn
    by `seed`) one answer each, right (the oracle's) for `accuracy` of them and otherwise the
    right integer off by 1-3 (a teacher's slip: plausible, and rejected by the verifier). The
    oracle regime is share 1, accuracy 1. Validation runs draw from the view's training prompts,
    so no validation prompt has a trace."""
    import random

    if not (0.0 < share <= 1.0 and 0.0 <= accuracy <= 1.0):
        raise ValueError(
            f"trace share must be in (0, 1] and accuracy in [0, 1]: {share}, {accuracy}"
        )
    distinct = list({ex.prompt: ex for ex in task.train_examples()}.values())
    rng = random.Random(f"vs-trl-teacher:{seed}:{share}:{accuracy}")
    chosen = sorted(rng.sample(range(len(distinct)), max(1, round(share * len(distinct)))))
    wrong = set(rng.sample(chosen, len(chosen) - round(accuracy * len(chosen))))
    out = []
    for i in chosen:
        ex = distinct[i]
        text = task.oracle(ex)
        if i in wrong:
            try:
                text = str(int(text) + rng.choice((-3, -2, -1, 1, 2, 3)))
            except ValueError:  # not an integer answer: a typo instead
                text = text + text[-1:]
        verdict = task.verify(ex, text)
        out.append(Trace(ex, text, bool(verdict.correct), float(verdict.reward)))
    return out


def write_traces(traces: list[Trace], path: Path) -> None:
    """The traces as a trace JSONL file (`data.traces`) with the verifier's reward, as
    `composer-replication bake-traces` writes them with a verifier: what ours replays."""
    from composer_replication.data.traces import prompt_key
    from composer_replication.tasks.task import chat_prompt

    with open(path, "w") as f:
        for t in traces:
            prompt = chat_prompt(t.example.prompt)
            record = {
                "prompt": prompt,
                "prompt_key": prompt_key(prompt),
                "teacher": "teacher",
                "completion": t.text,
                "reward": t.reward,
            }
            f.write(json.dumps(record) + "\n")


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


def trace_dataset(traces: list[Trace]) -> Any:
    """Teacher traces in TRL's prompt-completion chat format (`sft_dataset`'s, with the given
    answers instead of the oracle's)."""
    import datasets

    from composer_replication.tasks.task import chat_prompt

    rows = [
        {
            "prompt": chat_prompt(t.example.prompt),
            "completion": [{"role": "assistant", "content": t.text}],
        }
        for t in traces
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
    arm: str,
    config: Any,
    model: Any,
    tok: Any,
    task: Any,
    scratch: str,
    callbacks: list[Any],
    contexts: dict[str, str] | None = None,
) -> Any:
    """The RL trainer of an arm (ours, TRL's GRPO or TRL's SDPO) on `config`'s settings;
    `contexts` (trl_sdpo): example id -> its privileged context (the teacher's trace)."""
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

        if contexts is None:  # the oracle answer of every training prompt
            contexts = {ex.id: task.oracle(ex) for ex in task.train_examples()}
        # "" where there is no trace: TRL's SDPO then shows no privileged context
        dataset = dataset.add_column(
            "privileged_context", [contexts.get(i, "") for i in dataset["example_id"]]
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


def base_start(config: Any, model: Any, tok: Any, steps: int, cache: Path) -> None:
    """The comparison's base model: the seed's initial model after `steps` SFT steps (lr
    `WARM_START_LR`, 16 per step) on the oracle traces of the arithmetic task's easy level
    (two-digit sums `a+b=`: none is a prompt of the benchmark, whose prompts have three terms),
    each plain and under channel 2's hint template; cached per seed and steps. What a pretrained
    model is to RL: every arm of a seed starts from it."""
    import torch
    from safetensors.torch import load_model, save_model

    from composer_replication.tasks.arithmetic import ArithmeticTask

    seed = config.run.seed
    path = cache / f"base-seed{seed}-steps{steps}-easy-hinted3.safetensors"
    if path.exists():
        load_model(model, str(path))
        torch.manual_seed(seed)
        return
    easy = ArithmeticTask(seed=seed, level="easy", n_train=100, n_eval=0)
    with tempfile.TemporaryDirectory(prefix="vs-trl-base-") as scratch:
        data = sft_dataset(easy, easy.train_examples(), hinted=True)
        sft_runner(config, model, tok, data, scratch, WARM_START_LR, steps, []).train()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_model(model, str(tmp))
    os.replace(tmp, path)
    torch.manual_seed(seed)


def prepare_warm_start(seed: int, steps: int, extra: list[str], cache: str) -> None:
    """Build (and cache) seed's SFT warm start in this process (see `warm_start`)."""
    import torch
    from _inprocess import build_parts, run_config

    config = run_config(seed, MAX_STEPS, extra)
    if config.train.torch_threads > 0:
        torch.set_num_threads(config.train.torch_threads)
    task, model, tok = build_parts(config)
    warm_start(config, model, tok, task, steps, Path(cache))


class Curve(TrainerCallback):
    """Held-out exact match during a phase of training: at every point of `points` (seconds
    of the whole run) the phase's budget has passed, counting from `offset` (the seconds of the
    phases before), inside `budget.excluded()` (not charged). `points` holds (seconds, acc)."""

    def __init__(self, budget: Any, points: list[float], offset: float, evaluate: Any) -> None:
        self.budget = budget
        self.todo = sorted(p for p in points if p > offset)
        self.offset = offset
        self.evaluate = evaluate
        self.points: list[tuple[float, float]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        now = self.offset + self.budget.elapsed()
        if self.todo and now >= self.todo[0] and now < self.offset + self.budget.budget:
            while self.todo and now >= self.todo[0]:
                self.todo.pop(0)
            with self.budget.excluded():
                self.points.append((round(now, 2), self.evaluate()))


def phase_one(spec: Spec) -> Spec:
    """trl_sft_grpo's SFT phase as a run of its own: the spec whose model (cached) its second
    phase starts from."""
    share = SFT_SHARE if spec.share is None else spec.share
    return Spec(
        SFT_PHASE,
        spec.seed,
        spec.lr if spec.sft_lr is None else spec.sft_lr,
        GRID_G[0],
        None,
        spec.split,
        spec.warm,
        share * spec.budget,
        spec.clock,
        traces=spec.traces,
        teacher_acc=spec.teacher_acc,
        base=spec.base,
        curve=spec.curve,
    )


def _phase_path(spec: Spec, cache: Path) -> Path:
    import hashlib

    return cache / f"phase1-{hashlib.sha1(spec.key().encode()).hexdigest()[:16]}.safetensors"


def run_one(spec: Spec, probe_every: int, extra: list[str], cache: str) -> dict[str, Any]:
    import torch
    from _inprocess import RewardLog, WallBudget, build_parts, held_out, run_config
    from safetensors.torch import load_model, save_model

    load_start = round(os.getloadavg()[0], 1)
    log = RewardLog()
    budgets: list[Any] = []
    curve: list[tuple[float, float]] = []
    probe = None
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as scratch:
        traces_path = Path(scratch) / "traces.jsonl"
        overrides = arm_overrides(spec, extra)
        if spec.arm.startswith("composer") and not spec.warm:  # channel 3 replays the traces
            overrides += ["teachers.oracle=false", f"teachers.traces_path={traces_path}"]
        config = run_config(spec.seed, MAX_STEPS, overrides)
        if config.train.torch_threads > 0:  # as a replica of the run does
            torch.set_num_threads(config.train.torch_threads)
        task, model, tok = build_parts(config)  # bit-identical per seed for every arm
        if spec.split == "val":
            task = task.validation_view(N_VAL)
        traces = teacher_traces(task, spec.traces, spec.teacher_acc, spec.seed)
        accepted = [t for t in traces if t.correct]
        write_traces(traces, traces_path)
        if spec.base:
            base_start(config, model, tok, spec.base, Path(cache))
        if spec.warm:
            warm_start(config, model, tok, task, spec.warm, Path(cache))
        examples = task.eval_examples()

        def evaluate() -> float:
            return float(held_out(model, tok, task, config, examples=examples)["accuracy"])

        total = spec.budget
        points = [f * total for f in CURVE_POINTS] if spec.curve else []
        if spec.curve:
            curve.append((0.0, evaluate()))
        phases: list[tuple[str, float]] = [(spec.arm, spec.budget)]
        offset = 0.0
        if spec.arm == WARM_START:  # the ablation's starting point: evaluated, not trained
            if not spec.warm:
                raise ValueError(f"arm {WARM_START!r} needs a warm start (Spec.warm > 0)")
            phases = []
        elif spec.arm == "trl_sft_grpo":  # its SFT phase: cached by the spec of that phase
            first = phase_one(spec)
            path = _phase_path(first, Path(cache))
            if not path.exists():
                done = run_one(first, probe_every, extra, cache)  # trains and caches it
            else:
                done = json.loads(path.with_suffix(".json").read_text())
            load_model(model, str(path))
            torch.manual_seed(spec.seed)
            budgets.append(WallBudget(first.budget, spec.clock))
            budgets[-1].steps, budgets[-1].seconds = done["steps"], done["train_seconds"]
            curve += [tuple(c) for c in done["curve"][1:-1] if c[0] > 0]  # type: ignore[misc]
            offset = done["train_seconds"]
            if spec.curve:
                curve.append((offset, done["acc"]))
            phases = [("trl_grpo", spec.budget - first.budget)]
        elif spec.arm in ("trl_sft", *SFT_ARMS, SFT_PHASE):
            phases = [("sft", spec.budget)]
        for phase, seconds in phases:
            budget = WallBudget(seconds, spec.clock)
            budgets.append(budget)
            tracker = Curve(budget, points, offset, evaluate)
            if phase == "sft":  # trl_sft: every trace; trl_rft and SFT -> GRPO: the accepted
                data = trace_dataset(traces if spec.arm == "trl_sft" else accepted)
                runner = sft_runner(
                    config, model, tok, data, scratch, spec.lr, MAX_STEPS, [budget, tracker]
                )
            else:  # TRL SDPO: the accepted traces as privileged context, where there is one
                contexts = {t.example.id: t.text for t in accepted}
                runner = rl_runner(
                    phase, config, model, tok, task, scratch, [log, budget, tracker], contexts
                )
            loss = config.loss
            if phase.startswith("composer") and (loss.alpha_sdpo or loss.beta_replay):
                params = [p for p in runner.model.parameters() if p.requires_grad]
                probe = GradShare(params, probe_every, budget)
                runner.set_loss_probe(probe)
            runner.train()
            curve += tracker.points
        wall = time.monotonic() - t0
        metrics = held_out(model, tok, task, config, examples=examples)
        seconds = round(sum(b.seconds for b in budgets), 1)
        if spec.curve:
            curve.append((seconds, float(metrics["accuracy"])))
    ood = None  # a tuning run needs only the validation figure
    if spec.split == "heldout":
        ood = held_out(model, tok, task, config, examples=task.ood_examples(N_OOD))
    rewards = log.rewards
    record = {
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
        "ood_acc": None if ood is None else ood["accuracy"],
        "steps": sum(b.steps for b in budgets),
        "phase_steps": [b.steps for b in budgets],
        "train_seconds": seconds,
        "wall_seconds": round(wall, 1),
        "curve": [list(c) for c in curve],
        "n_traces": len(traces),
        "n_traces_accepted": len(accepted),
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
    if spec.arm == SFT_PHASE:  # the second phase of trl_sft_grpo starts from this model
        path = _phase_path(spec, Path(cache))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_model(model, str(tmp))
        os.replace(tmp, path)
        side = {k: record[k] for k in ("steps", "train_seconds", "curve", "acc")}
        path.with_suffix(".json").write_text(json.dumps(side))
    return record


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
    *,
    traces: float = 1.0,
    teacher_acc: float = 1.0,
    base: int = 0,
    grid_g: tuple[int, ...] = GRID_G,
) -> list[Spec]:
    """The validation runs of an arm's search, as far as the finished runs (`done`, by key)
    decide them. An RL arm (ours, TRL's GRPO and SDPO): (A) every learning rate of `RL_GRID_LR`
    at the first G, (B) the other G at A's best. An SFT arm: every learning rate of
    `SFT_GRID_LR`. SFT -> GRPO, each phase on its own: its SFT phase alone (`SFT_PHASE`, the
    SFT share of the budget) at every SFT learning rate, then its GRPO phase's (A) and (B) from
    the best of them. `grid_g`: the G grid (`--grid-g`). `--quick`: one point per phase."""
    rl_lrs, sft_lrs, gs = (
        ((3e-4,), (3e-3,), grid_g[:1]) if quick else (RL_GRID_LR, SFT_GRID_LR, grid_g)
    )
    first = Spec(
        arm, seed, 0.0, gs[0], None, "val", 0, budget, clock, rpo,
        traces=traces, teacher_acc=teacher_acc, base=base,
    )  # fmt: skip
    if arm in SFT_ARMS:
        return [replace(first, lr=lr) for lr in sft_lrs]
    if arm != "trl_sft_grpo":
        return _rl_search(first, rl_lrs, gs, done)
    sft = [replace(first, arm=SFT_PHASE, lr=lr, budget=SFT_SHARE * budget) for lr in sft_lrs]
    if not all(s.key() in done for s in sft):
        return sft
    sft_lr = choose([done[s.key()] for s in sft])["lr"]
    return sft + _rl_search(replace(first, share=SFT_SHARE, sft_lr=sft_lr), rl_lrs, gs, done)


def _rl_search(
    first: Spec, lrs: tuple[float, ...], gs: tuple[int, ...], done: dict[str, dict[str, Any]]
) -> list[Spec]:
    specs = [replace(first, lr=lr) for lr in lrs]
    if not all(s.key() in done for s in specs):
        return specs
    best = choose([done[s.key()] for s in specs])
    return specs + [replace(first, lr=best["lr"], g=g) for g in gs[1:]]


def choose(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The best validation run: highest exact match, then highest mean reward, then the first
    (lower lr, fewer completions)."""
    best = max(range(len(runs)), key=lambda i: (runs[i]["acc"], runs[i]["reward"], -i))
    r = runs[best]
    return {
        "lr": r["lr"],
        "g": r["g"],
        "share": r["share"],
        "sft_lr": r.get("sft_lr"),
        "val_acc": r["acc"],
    }


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

    def __init__(self, path: Path, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
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
        if log.read_only:  # --summary-only: what the log holds
            continue
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
    return [log.done[s.key()] for batch in batches for s in batch if s.key() in log.done]


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
    if r.get("traces", 1.0) != 1.0 or r.get("teacher_acc", 1.0) != 1.0:
        warm += f" partial {r['traces']:g}/{r['teacher_acc']:g}"
    if r.get("sft_lr") is not None:
        warm += f" sft lr {r['sft_lr']:g}"
    print(
        f"{r['arm']:16s} seed {r['seed']} {r['split']:7s} lr {r['lr']:g} G {r['g']}{share}{warm}:"
        f" acc {r['acc']:.3f} (ood {_fmt(r['ood_acc'])}), constant share "
        f"{r['constant_answer_share']:.3f} ({r['top_answer']!r}), {r['steps']} steps in "
        f"{r['train_seconds']:.0f} {r['clock']} s, last-10 reward "
        f"{_fmt(r['last10_train_reward'])}{ch}",
        flush=True,
    )


def regime_of(name: str, a: argparse.Namespace) -> tuple[float, float]:
    """(trace share, teacher accuracy) of a regime: the oracle's every trace, right; the
    partial regime's `--trace-share`, `--teacher-accuracy`."""
    return (1.0, 1.0) if name == "oracle" else (a.trace_share, a.teacher_accuracy)


def tune(
    arms: list[str], a: argparse.Namespace, log: Log, budget: float, regime: str = "oracle"
) -> dict[str, Any]:
    """Every arm's search on the validation split; {arm: choice + its runs}. Each stage's
    pending runs go in batches across arms (the k-th pending run of every arm together: in
    stage A, one learning rate for every arm at once), run concurrently."""
    traces, acc = regime_of(regime, a)
    rpos = {arm: rpo_alpha(arm, a.overrides) for arm in arms}

    def specs(arm: str) -> list[Spec]:
        return tuning_specs(
            arm, a.tune_seed, budget, a.clock, a.quick, log.done, rpos[arm],
            traces=traces, teacher_acc=acc, base=a.base_steps, grid_g=a.grid_g,
        )  # fmt: skip

    while True:  # each pass runs the next stage of every arm's search
        pending = {arm: [s for s in specs(arm) if s.key() not in log.done] for arm in arms}
        depth = max(len(v) for v in pending.values())
        if depth == 0 or log.read_only:
            break
        busy = [arm for arm in arms if pending[arm]]
        batches = [[pending[arm][k] for arm in busy if k < len(pending[arm])] for k in range(depth)]
        execute(batches, log, a.jobs, a.probe_every, a.overrides, a.cache)
    tuned: dict[str, Any] = {}
    for arm in arms:
        runs = [log.done[s.key()] for s in specs(arm) if s.key() in log.done]
        second = [r for r in runs if r["arm"] == arm]  # SFT -> GRPO: its GRPO phase
        if not second:
            continue  # --summary-only, the search not run yet
        tuned[arm] = {
            **choose(second),
            "rpo_alpha": rpos[arm],
            "grid": [
                {
                    "phase": "sft" if r["arm"] == SFT_PHASE else None,
                    "lr": r["lr"],
                    "g": r["g"],
                    "share": r["share"],
                    "sft_lr": r.get("sft_lr"),
                    "val_acc": r["acc"],
                    "val_reward": round(r["reward"], 4),
                    "steps": r["steps"],
                }
                for r in runs
            ],
        }
    return tuned


def _point(arm: str, c: dict[str, Any]) -> str:
    if c.get("phase") == "sft":
        return f"SFT phase lr {c['lr']:g}"
    if arm in SFT_ARMS:
        return f"lr {c['lr']:g}"
    after = "" if c.get("sft_lr") is None else f" after SFT lr {c['sft_lr']:g}"
    return f"lr {c['lr']:g} G {c['g']}{after}"


def run_regime(
    regime: str, arms: list[str], a: argparse.Namespace, log: Log, budget: float, seeds: range
) -> dict[str, Any]:
    """One information regime: every arm's tuning on the validation split, then its final runs
    (with learning curves) on the held-out split, summarised (`summarize`)."""
    traces, acc = regime_of(regime, a)
    arms = [arm for arm in arms if not (regime == "oracle" and arm == "trl_rft")]
    source = regime
    if regime == "oracle" and a.oracle_settings == "partial":  # compute: no search of its own
        source = "partial"
    tuned = tune(arms, a, log, budget, source)
    print(
        f"\n[{regime}: traces for {traces:.0%} of the training prompts, {acc:.0%} of them right] "
        + (
            f"the settings tuned in the {source} regime (no search of its own): "
            if source != regime
            else ""
        )
        + f"tuning on the validation split (seed {a.tune_seed}, {N_VAL}+ prompts carved from "
        f"training, whole classes): exact match per grid point"
    )
    for arm in arms:
        if arm not in tuned:
            print(f"{arm:16s} | (not tuned yet)")
            continue
        t = tuned[arm]
        cells = ", ".join(f"{_point(arm, c)}: {c['val_acc']:.3f}" for c in t["grid"])
        chosen = f"lr {t['lr']:g}" + ("" if arm in SFT_ARMS else f" G {t['g']}")
        if t.get("sft_lr") is not None:
            chosen = f"SFT lr {t['sft_lr']:g} then {chosen}"
        rpo = f" (rpo_alpha {t['rpo_alpha']:g})" if t["rpo_alpha"] else ""
        print(f"{arm:16s} | {cells} | chosen {chosen}{rpo}")
    ready = [arm for arm in arms if arm in tuned]
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
                tuned[arm].get("sft_lr"),
                traces,
                acc,
                a.base_steps,
                True,
            )  # fmt: skip
            for arm in ready
        ]
        for s in seeds
    ]
    final = execute(batches, log, a.jobs, a.probe_every, a.overrides, a.cache)
    # a measurement cut short (--summary-only): the seeds every arm finished, so that every
    # median is over the same seeds as the paired intervals
    complete = [s for s in seeds if {r["arm"] for r in final if r["seed"] == s} >= set(ready)]
    if complete:
        final = [r for r in final if r["seed"] in complete]
    done = [arm for arm in ready if any(r["arm"] == arm for r in final)]
    if not done:
        return {"tuned": tuned}
    summary = summarize(final, done, a.bootstrap)
    n = final[0]["n"]
    n_classes = len(set(final[0]["classes"]))
    n_seeds = {arm: sum(r["arm"] == arm for r in final) for arm in done}
    print(
        f"\n[{regime}] embedded default's task from the base model, {budget:.0f} {a.clock} s of "
        f"training per run, seeds per arm {n_seeds}, {n} held-out prompts ({n_classes} operand "
        f"multisets in seed {final[0]['seed']}), greedy exact match; medians over seeds, 95% "
        f"bootstrap intervals"
    )
    print(f"{'arm':16s} | held-out acc [95% CI]  | ood acc | constant share | steps | ch2 / ch3")
    for arm in done:
        m = summary["medians"][arm]
        ci = summary[f"{arm}_heldout_acc_ci"] or [math.nan, math.nan]
        print(
            f"{arm:16s} | {m['acc']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] | {m['ood_acc']:7.3f} | "
            f"{m['constant_answer_share']:14.3f} | {m['steps']:5.0f} | "
            f"{_fmt(m['channel2_loss_share'], 4)} / {_fmt(m['channel3_loss_share'], 4)}"
        )
    d, dci = summary["composer_minus_best_trl"], summary["composer_minus_best_trl_ci"]
    if d is not None:
        print(
            f"ours minus the best TRL arm ({summary['trl_best_arm']}): {d:+.3f}"
            + ("" if dci is None else f" [{dci[0]:+.3f}, {dci[1]:+.3f}] (paired)")
        )
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    print("targets: " + ", ".join(f"{k} {verdict[v]}" for k, v in summary["targets"].items()))
    summary.update(
        tuned=tuned,
        seeds=min(n_seeds.values()),
        seeds_per_arm=n_seeds,
        n_heldout=n,
        heldout_classes=n_classes,
        trace_share=traces,
        teacher_accuracy=acc,
        n_traces=final[0]["n_traces"],
        n_traces_accepted=final[0]["n_traces_accepted"],
    )
    return summary


def partial_keys(summary: dict[str, Any]) -> dict[str, Any]:
    """The partial regime's keys: each with `_partial` (before a trailing `_ci`)."""
    out = {}
    for key, value in summary.items():
        if key in ("medians", "per_seed", "tuned", "targets"):
            out[f"{key}_partial"] = value
        elif key.endswith("_ci"):
            out[f"{key[:-3]}_partial_ci"] = value
        else:
            out[f"{key}_partial"] = value
    return out


def machine() -> dict[str, Any]:
    """The machine of a measurement: CPU model and flags, cores, commit, load averages."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("flags")), "")
    except OSError:
        pass
    return {
        **provenance(),
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


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
        "--regimes",
        default=",".join(REGIMES),
        help="comma-separated: partial (traces for --trace-share of the prompts, "
        "--teacher-accuracy of them right) and/or oracle (every trace, right); default both",
    )
    p.add_argument(
        "--trace-share",
        type=float,
        default=DEFAULT_TRACE_SHARE,
        help="partial regime: the share of training prompts with a teacher trace (default 0.25)",
    )
    p.add_argument(
        "--teacher-accuracy",
        type=float,
        default=DEFAULT_TEACHER_ACCURACY,
        help="partial regime: the share of those traces that are right (default 0.7)",
    )
    p.add_argument(
        "--base-steps",
        type=int,
        default=None,
        help="SFT steps of the base model on two-digit sums every arm starts from (default "
        f"{DEFAULT_BASE_STEPS}; --quick 2; 0: the random init)",
    )
    p.add_argument(
        "--grid-g",
        default=",".join(map(str, GRID_G)),
        help="the RL arms' completions per prompt, searched after the learning rate at the "
        "first (default 4,8; one value: G fixed, a smaller search)",
    )
    p.add_argument(
        "--oracle-settings",
        choices=("own", "partial"),
        default="own",
        help="the oracle regime's settings: its own search (default) or the partial regime's "
        "chosen points (less compute; said in the output and the JSON)",
    )
    p.add_argument(
        "--summary-only",
        action="store_true",
        help="run nothing: summarise the runs the log holds (a measurement cut short)",
    )
    p.add_argument("--out", default=None, help="also write the last line's JSON here")
    p.add_argument("--plot", default=None, help="draw the learning curves to this PNG")
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
        help="at most this many runs at once (default 6: the arms of a comparison run side by "
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
    if a.base_steps is None:
        a.base_steps = 2 if a.quick else DEFAULT_BASE_STEPS
    if budget <= 0 or seeds < 1 or a.probe_every < 1 or a.jobs < 1 or a.warm_start_steps < 0:
        p.error("--budget-s must be > 0; --seeds, --probe-every, --jobs >= 1; warm start >= 0")
    if not (0 < a.trace_share <= 1 and 0 <= a.teacher_accuracy <= 1) or a.base_steps < 0:
        p.error("--trace-share in (0, 1], --teacher-accuracy in [0, 1], --base-steps >= 0")
    if a.starts == "warm" and not a.warm_start_steps:
        p.error("--starts warm needs --warm-start-steps > 0")
    arms = list(ARMS)
    if a.arms:
        arms = [t.strip() for t in a.arms.split(",") if t.strip()]
        unknown = sorted(set(arms) - set(ARMS))
        if unknown or not arms:
            p.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    try:
        a.grid_g = tuple(int(t) for t in a.grid_g.split(",") if t.strip())
    except ValueError:
        a.grid_g = ()
    if not a.grid_g or min(a.grid_g) < 2:
        p.error("--grid-g: comma-separated integers >= 2 (GRPO needs two completions)")
    regimes = [t.strip() for t in a.regimes.split(",") if t.strip()]
    if not regimes or set(regimes) - set(REGIMES):
        p.error(f"--regimes: choose from {', '.join(REGIMES)}")
    if a.ablation:
        arms = ["composer"]
    every = [*CHANNEL_VARIANTS, "composer"]
    a.variants = [t.strip() for t in (a.variants or ",".join(every)).split(",") if t.strip()]
    if set(a.variants) - set(every) or not a.variants:
        p.error(f"--variants: unknown {sorted(set(a.variants) - set(every))}; choose from {every}")
    if (a.lr is None) != (a.g is None) or (a.lr is not None and not a.ablation):
        p.error("--lr and --g go together, with --ablation")
    a.cache = a.cache or str(Path(a.log).parent / "warm")
    log = Log(Path(a.log), read_only=a.summary_only)
    t0 = time.monotonic()
    final_seeds = range(a.first_seed, a.first_seed + seeds)
    if a.ablation:
        a.base_steps = 0  # the ablation starts from the random init or its own warm start
        if a.lr is not None:  # settings given: no tuning runs
            ablation(a, log, {"lr": a.lr, "g": a.g}, budget, final_seeds, t0)
        else:
            ablation(a, log, tune(arms, a, log, budget)["composer"], budget, final_seeds, t0)
        return
    result: dict[str, Any] = {}
    for regime in regimes:
        summary = run_regime(regime, arms, a, log, budget, final_seeds)
        if regime == "oracle":
            summary["settings_from"] = "partial" if a.oracle_settings == "partial" else "oracle"
        result.update(summary if regime == "oracle" else partial_keys(summary))
        if regime == "partial":
            d = summary.get("composer_minus_best_trl")
            ci = summary.get("composer_minus_best_trl_ci")
            result["targets_partial"] = {
                "composer_ahead_by_0.05": None if d is None else d >= TARGET_MARGIN - 1e-12,
                "difference_interval_above_0": None if ci is None else ci[0] > 0,
            }
        result.update(
            budget_s=budget,
            clock=a.clock,
            base_steps=a.base_steps,
            grid_rl_lr=list(RL_GRID_LR),
            grid_sft_lr=list(SFT_GRID_LR),
            grid_g=list(a.grid_g),
            sft_share=SFT_SHARE,
            curve_points=list(CURVE_POINTS),
            n_val=N_VAL,
            machine=machine(),
            seconds=round(time.monotonic() - t0, 1),
        )
        if a.out:  # after each regime: a measurement cut short keeps what it has
            Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    if a.plot:
        plot_curves(log, regimes, budget, a, Path(a.plot))
    print(json.dumps(result))


def plot_curves(
    log: Log, regimes: list[str], budget: float, a: argparse.Namespace, out: Path
) -> None:
    """Held-out exact match against training CPU seconds, per arm (mean over seeds and the
    band from the lowest to the highest seed), one panel per regime: the final runs' curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(regimes), figsize=(6.2 * len(regimes), 4.2), squeeze=False)
    grid = np.linspace(0.0, budget, 101)
    for ax, regime in zip(axes[0], regimes, strict=True):
        traces, acc = regime_of(regime, a)
        runs = [
            r for r in log.done.values()
            if r["split"] == "heldout" and r.get("curve") and r["budget"] == budget
            and r.get("traces", 1.0) == traces and r.get("teacher_acc", 1.0) == acc
            and r.get("base", 0) == a.base_steps and r["clock"] == a.clock
        ]  # fmt: skip
        for arm in ARMS:
            curves = [r["curve"] for r in runs if r["arm"] == arm]
            if not curves:
                continue
            ys = np.array([np.interp(grid, *zip(*c, strict=True)) for c in curves])
            color = f"C{ARMS.index(arm)}"  # one colour per arm in every panel
            ax.plot(grid, ys.mean(0), color=color, label=f"{arm} ({len(curves)} seeds)")
            ax.fill_between(grid, ys.min(0), ys.max(0), color=color, alpha=0.12)
        title = (
            "oracle traces for every prompt"
            if regime == "oracle"
            else (f"traces for {traces:.0%} of prompts, {acc:.0%} right; verifier for all")
        )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"training {a.clock} seconds")
        ax.set_ylabel("held-out exact match")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("vs_trl: sums of three digits, from the same base model (mean, band: min-max)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"learning curves: {out}")


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
