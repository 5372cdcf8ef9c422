"""`ComposerReplicationTrainer`: TRL's ``GRPOTrainer`` plus channels 2 and 3 of the composer loss.

What is added to TRL 1.16's GRPO step, and where:

* ``_calculate_rewards``: reward functions may return ``(score, feedback)`` pairs (see
  `feedback`); ``feedback_funcs`` are called too. Rewards, completions and feedback are kept for
  the next step;
* ``_generate_and_score_completions``: after TRL's rollouts/rewards/advantages, the channel-2
  keys (hinted teacher contexts, `batch.plan_hints`) and the channel-3 rollout-pair keys (trace
  pairs and their reference log-probs, `batch.plan_pairs`) of the composer batch (docs/api.md)
  are added to the generation batch, row-aligned so TRL's shuffle/split into micro-batches keeps
  them with their rollouts;
* ``_compute_loss``: channel 1 is TRL's own loss, computed from ONE student forward whose
  completion logits are kept (``_get_per_token_logps_and_entropies``); channels 2 and 3 are the
  loss library's public ``sdpo_term`` / ``replay_term`` on the same batch, fed those logits
  (channel 2's student side, channel 3's rejected side). The total is the loss library's
  ``assemble`` of the three results.
* channel 2 fused with the output layer (``sdpo_fused``, on by default where it applies:
  ``trainer/fused_capture.py``): the student forward keeps the body's last hidden states instead (and,
  when channel 3 needs no logits in the micro-batch, runs TRL's own fused LM head for channel 1,
  so no ``(B, T, V)`` logits exist at all); the teacher runs its body only; the divergence is
  ``loss.fused_sdpo_term``. Equal to the logits path up to float rounding.
* channel 3 fused with the output layer (``replay_fused``, on by default where it applies): the
  rejected side is scored from the student forward's last hidden states and the chosen side runs
  the policy's body only; both through ``loss.fused_replay_term`` (no ``(N, T, V)`` logits). With
  channel 2 fused or off, the student forward then runs TRL's fused LM head for channel 1: no
  ``(B, T, V)`` logits exist in the step. Equal to the logits path up to float rounding.

Normalisation: like TRL's ``dapo``, each extra channel is divided by its *global* count over the
accumulated batch (selected completion tokens for channel 2, pairs for channel 3; the batch's
``sdpo_num_tokens`` / ``replay_num_pairs``), not by the micro-batch's own count, so 1 x N and
N x 1 gradient accumulation give the same update.

A model that only exists in memory works with ``beta != 0``: the frozen reference is a deep copy
of it rather than a reload from ``config._name_or_path`` (which TRL would attempt).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict, TypeVar, cast

import torch
from torch import nn

from composer_replication.data.hints import HINTED_EXAMPLE_COLUMN
from composer_replication.data.teachers import TeacherPool
from composer_replication.data.traces import Prompt, TraceRecord, TraceStore
from composer_replication.data.turns import align_generation_stops, end_of_turn_id
from composer_replication.loss import (
    ComposeConfig,
    assemble,
    fused_replay_term,
    fused_sdpo_term,
    replay_term,
    sdpo_term,
    sdpo_wrappers,
    selective_log_softmax,
)
from composer_replication.trainer.batch import (
    GenerationBatch,
    HintPlan,
    completion_text,
    hint_tensors,
    left_pad,
    pair_tensors,
    plan_hints,
    plan_pairs,
    select_probe_rows,
)
from composer_replication.trainer.callbacks import EMATeacherCallback, TAIDCallback
from composer_replication.trainer.config import ComposerConfig, ComposerSettings
from composer_replication.trainer.ema import EMATeacher, frozen_copy
from composer_replication.trainer.feedback import (
    FeedbackRecorder,
    RewardFunc,
    call_feedback_funcs,
    merge_feedback,
    wrap_reward_func,
)
from composer_replication.trainer.fused_capture import (
    HiddenStateSource,
    capture_hidden,
    hidden_state_source,
)
from composer_replication.trainer.gate import TeacherGate
from composer_replication.trainer.reference_models import (
    ReferenceScorer,
    is_peft,
    reference_from_memory,
)
from composer_replication.trainer.resume import (
    RESUME_FORMAT,
    EpochSampler,
    ResumeStateError,
    check_optimizer_state,
    check_tensors,
    get_rng_state,
    require,
    set_rng_state,
)

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
    from peft import PeftConfig, PeftModel
    from torch.utils.data import Sampler
    from transformers import (
        BitsAndBytesConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        ProcessorMixin,
        TrainerCallback,
    )

    # GRPOTrainer's own argument types (trl.GRPOTrainer.__init__), which this trainer passes on
    # (a reward function may also return (score, feedback) pairs: `feedback.RewardFunc`)
    _RewardFunc: TypeAlias = str | PreTrainedModel | RewardFunc
    _TrainData: TypeAlias = Dataset | IterableDataset
    _EvalData: TypeAlias = (
        Dataset
        | IterableDataset
        | DatasetDict
        | IterableDatasetDict
        | dict[str, Dataset | IterableDataset]
    )
    from trl.trainer.grpo_trainer import EnvironmentFactory, RolloutFunc

try:
    from accelerate.utils import gather_object
    from transformers import TrainerState
    from transformers.trainer_utils import TrainOutput
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ComposerReplicationTrainer needs TRL; install it with "
        "`pip install composer-replication[train]`."
    ) from exc

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class _RewardBatch(TypedDict, total=False):
    """What `_calculate_rewards` keeps of a generation batch for its channel-2/3 inputs."""

    prompts: list[Prompt]
    completions: list[Prompt]  # a completion is a string or chat messages, as a prompt
    rewards_per_func: torch.Tensor  # (B, reward functions), over all processes
    feedback: list[str | None]


class ComposerReplicationTrainer(GRPOTrainer):
    """GRPO (channel 1) + hint self-distillation (channel 2) + trace replay (channel 3).

    Arguments: everything ``trl.GRPOTrainer`` takes, plus (keyword-only)

    * ``feedback_funcs``: ``[g(prompts, completions, **columns) -> list[str | None]]``;
    * ``trace_store``: a `TraceStore` of teacher traces for channel 3 (or ``args.trace_files``);
    * ``teacher_pool``: a `TeacherPool` asked lazily for prompts the store lacks (its traces go
      into the trainer's store);
    * every `ComposerSettings` field as a keyword (``alpha_sdpo``, ``beta_replay``, the other
      compose_loss keywords with `loss.ComposeConfig`'s defaults, ``sdpo_teacher``,
      ``sdpo_ema_rate``, ``hint_template``, ...); keywords override the same fields of a
      `ComposerConfig` ``args``.

    ``args=None`` builds a CPU-safe `ComposerConfig`. Channel 2 is on when ``alpha_sdpo != 0``,
    channel 3 when ``beta_replay != 0`` and traces exist; each switches itself off for a batch or
    micro-batch with no inputs (metrics ``sdpo/active``, ``replay/active``).

    Public state for callbacks: `taid_t` / `set_taid_t` / `pop_taid_losses` (the TAID schedule),
    `ema_teacher` / `update_ema_teacher` (channel 2's EMA teacher), `replay_reference` (channel
    3's DPO reference model); `set_loss_probe` (each micro-batch's loss terms before backward).

    Exact resume: `resume_state` (after an optimizer step) and `resume_train` (on a fresh
    trainer of the same run; see `composer_replication.trainer.resume`).
    """

    _tag_names = ["trl", "grpo", "composer-replication"]
    args: GRPOConfig

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs: _RewardFunc | list[_RewardFunc] | None = None,
        args: GRPOConfig | None = None,
        train_dataset: _TrainData | None = None,
        eval_dataset: _EvalData | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        reward_processing_classes: (
            PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None
        ) = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[
            torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None
        ] = (None, None),
        quantization_config: BitsAndBytesConfig | None = None,
        peft_config: PeftConfig | None = None,
        tools: list[Callable[..., Any]] | None = None,
        rollout_func: RolloutFunc | None = None,
        environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory] | None = None,
        *,
        feedback_funcs: Sequence[Callable[..., Iterable[str | None]]] | None = None,
        trace_store: TraceStore | None = None,
        teacher_pool: TeacherPool | None = None,
        **composer_kwargs: Any,
    ) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = ComposerConfig(output_dir=f"{str(name).split('/')[-1]}-Composer")
        self.composer = ComposerSettings.resolve(args, composer_kwargs)
        trace_files = getattr(args, "trace_files", None)
        if trace_store is None and trace_files:
            trace_store = TraceStore.load(trace_files)
        if teacher_pool is not None:
            if trace_store is None:
                trace_store = teacher_pool.store
            teacher_pool.store = trace_store
        with reference_from_memory(model, args.beta):
            super().__init__(
                model=model,
                # TRL's annotation names only float-returning functions; the pairs of ours are
                # unwrapped below (`wrap_reward_func`)
                reward_funcs=reward_funcs,  # type: ignore[arg-type]
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                reward_processing_classes=reward_processing_classes,
                callbacks=callbacks,
                optimizers=optimizers,
                quantization_config=quantization_config,
                peft_config=peft_config,
                tools=tools,
                rollout_func=rollout_func,
                environment_factory=environment_factory,
            )
        s = self.composer
        self._end_of_turn = self._align_stops()
        self._gate_warned = False
        self._gate = TeacherGate(s.sdpo_gate_window)
        self.feedback_funcs = list(feedback_funcs or [])
        self.trace_store = trace_store
        self.teacher_pool = teacher_pool
        self._feedback = FeedbackRecorder()
        self.reward_funcs = [
            # TRL awaits async reward functions too; its annotation names only the sync form
            cast("Callable[..., list[float | None]]", wrap_reward_func(f, i, self._feedback))
            if callable(f) and not isinstance(f, nn.Module)
            else f
            for i, f in enumerate(self.reward_funcs)
        ]
        self._channel2 = s.alpha_sdpo != 0.0
        self._channel3 = s.beta_replay != 0.0 and trace_store is not None
        unwrapped = self.accelerator.unwrap_model(self.model)
        self._ema: EMATeacher | None = None
        if self._channel2 and s.sdpo_teacher == "ema":
            self._ema = EMATeacher(unwrapped, s.sdpo_ema_rate)
            self.add_callback(EMATeacherCallback(self))
        # Channel 2 fused with the output layer: (student, teacher) bodies and heads, or None.
        self._fused2 = self._fused_sources(unwrapped) if self._channel2 else None
        # Channel 3 fused with the output layer: the policy's body and head, or None.
        self._fused3 = self._replay_source(unwrapped) if self._channel3 else None
        # DPO needs reference log-probs: TRL's KL reference if there is one, the adapter-free base
        # for PEFT, else a frozen copy of the initial policy.
        self._replay_ref: nn.Module | None = None
        if self._channel3 and s.dpo_variant == "dpo":
            if self.ref_model is not None:
                self._replay_ref = self.ref_model
            elif not is_peft(unwrapped):
                self._replay_ref = frozen_copy(unwrapped)
        assert self.model is not None  # Trainer.__init__ set it
        self._ref_scorer = ReferenceScorer(
            self._replay_ref,
            policy=self.model,
            unwrap=self.accelerator.unwrap_model,
            cacheable=not self.args.sync_ref_model,
        )
        self._taid_t: float | None = s.taid_t
        self._taid_step_losses: list[float] = []
        self._taid_callback: TAIDCallback | None = None
        if self._channel2 and s.taid_scheduled:
            taid_cb = next(
                (c for c in self.callback_handler.callbacks if isinstance(c, TAIDCallback)), None
            )
            if taid_cb is None:
                taid_cb = TAIDCallback(total_steps=s.taid_total_steps)
                self.add_callback(taid_cb)
            taid_cb.bind(self)
            self._taid_callback = taid_cb
        self._pool_records: list[TraceRecord] = []  # traces the teacher pool added (resume)
        self._train_sampler: EpochSampler | None = None
        self._pending_resume: dict[str, Any] | None = None
        self._capture_logits = False
        self._capture_hidden = False
        self._phase_s: dict[str, float] = {"generate": 0.0, "teacher": 0.0}  # training_step
        self._captured_logits: torch.Tensor | None = None
        self._captured_hidden: torch.Tensor | None = None
        self._batch: _RewardBatch = {}
        self._loss_probe: Callable[[dict[str, torch.Tensor | None]], None] | None = None

    def _align_stops(self) -> int | None:
        """Rollouts end at the chat template's end of turn as well as at EOS (data/turns.py):
        the model's ``generation_config`` and TRL's stop list get the ids they lack, so a policy
        that learned to end its answer with ``<|im_end|>`` (SFT, the template) stops there, as
        evaluation does. Returns the end-of-turn id (channel 3's chosen traces end with it)."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        stops = align_generation_stops(unwrapped, self._tokenizer)
        missing = [t for t in stops if t not in self.eos_token_ids]
        if missing:
            self.eos_token_ids = [*self.eos_token_ids, *missing]
            config = getattr(self, "generation_config", None)
            if config is not None:
                config.eos_token_id = list(self.eos_token_ids)
            logger.info(
                "rollouts also stop at token ids %s (chat template / generation_config)", missing
            )
        return end_of_turn_id(self._tokenizer)

    # -- public state for callbacks ----------------------------------------------------------------
    @property
    def taid_t(self) -> float | None:
        """TAID's t used by channel 2's next loss (None unless ``sdpo_wrapper="taid"``)."""
        return self._taid_t

    def set_taid_t(self, t: float) -> None:
        """Set TAID's t for the next channel-2 losses (the `TAIDCallback` schedule)."""
        if not 0.0 <= t <= 1.0:
            raise ValueError(f"TAID t must be in [0, 1], got {t}")
        self._taid_t = float(t)

    def pop_taid_losses(self) -> list[float]:
        """The channel-2 (TAID) losses since the last call, oldest first; the list is emptied."""
        losses, self._taid_step_losses = self._taid_step_losses, []
        return losses

    @property
    def channel2_fused(self) -> bool:
        """Whether channel 2 runs fused with the output layer (``sdpo_fused`` and it applies)."""
        return self._fused2 is not None

    def _fused_sources(
        self, unwrapped: nn.Module
    ) -> tuple[HiddenStateSource, HiddenStateSource] | None:
        """The student's and the teacher's body and head for the fused channel 2, or None (with
        the reason logged) when the setting is off or the path does not apply."""
        s = self.composer
        if not s.sdpo_fused:
            return None
        if not sdpo_wrappers.get(s.sdpo_wrapper).fused_ok or s.sdpo_top_k is not None:
            why = f"sdpo_wrapper={s.sdpo_wrapper!r} / sdpo_top_k={s.sdpo_top_k!r} need the logits"
            student = teacher = None
        else:
            student, why = hidden_state_source(_hf_model(unwrapped))
            teacher = student
            if student is not None and self._ema is not None:
                teacher, why = hidden_state_source(_hf_model(self._ema.model))
        if student is None or teacher is None:
            logger.info("channel 2 runs on the logits (not fused with the output layer): %s", why)
            return None
        return student, teacher

    @property
    def channel3_fused(self) -> bool:
        """Whether channel 3 runs fused with the output layer (``replay_fused`` and it applies)."""
        return self._fused3 is not None

    def _replay_source(self, unwrapped: nn.Module) -> HiddenStateSource | None:
        """The policy's body and head for the fused channel 3, or None (with the reason logged)
        when the setting is off or the path does not apply."""
        if not self.composer.replay_fused:
            return None
        source, why = hidden_state_source(_hf_model(unwrapped))
        if source is None:
            logger.info("channel 3 runs on the logits (not fused with the output layer): %s", why)
        return source

    @property
    def ema_teacher(self) -> EMATeacher | None:
        """Channel 2's EMA teacher (``sdpo_teacher="ema"``), else None."""
        return self._ema

    def update_ema_teacher(self) -> None:
        """Move the EMA teacher toward the current policy (no-op without one)."""
        if self._ema is not None:
            self._ema.update(self.accelerator.unwrap_model(self.model))

    @property
    def replay_reference(self) -> nn.Module | None:
        """Channel 3's frozen DPO reference model (None for SimPO, PEFT or channel 3 off)."""
        return self._replay_ref

    def set_loss_probe(
        self, probe: Callable[[dict[str, torch.Tensor | None]], None] | None
    ) -> None:
        """Call ``probe(terms)`` on every training micro-batch, before backward, with the loss
        terms as they are summed: ``{"grpo": channel 1, "sdpo": alpha_sdpo * channel 2,
        "replay": beta_replay * channel 3, "total": their sum}`` (a channel that is off or has
        no inputs in this micro-batch is None). The tensors are still attached to the graph: a
        probe may take ``torch.autograd.grad(term, params, retain_graph=True)`` of them (e.g. to
        measure each channel's share of the gradient, benchmarks/vs_trl.py) but must not call
        ``backward``. ``None`` removes the probe."""
        self._loss_probe = probe

    # -- exact resume ------------------------------------------------------------------------------
    def resume_state(self) -> dict[str, Any]:
        """Everything that decides how training continues from here (see `trainer.resume` for
        the layout): call it between optimizer steps, e.g. from a callback's ``on_step_end``
        placed after the trainer's own callbacks (TAID, EMA)."""
        if self.optimizer is None:
            raise RuntimeError("resume_state() needs a running trainer (no optimizer yet)")
        generate_every = int(self.args.steps_per_generation or 1) * self.num_iterations
        if self._step % generate_every != 0:
            raise RuntimeError(
                f"resume_state() between two generations (micro step {self._step}, generating "
                f"every {generate_every}): the buffered rollouts would be lost; take it at an "
                "optimizer step that ends a generation batch"
            )
        taid = None
        if self._taid_callback is not None or self._taid_t is not None:
            taid = {
                "t": self._taid_t,
                "pending_losses": list(self._taid_step_losses),
                "scheduler": None
                if self._taid_callback is None
                else self._taid_callback.scheduler.state_dict(),
            }
        replay = None
        if self._channel3:
            replay = {
                "traces": [r.to_json() for r in self._pool_records],
                "reference_cache": self._ref_scorer.state_rows(),
            }
        sampler = self._train_sampler
        unwrapped = self.accelerator.unwrap_model(self.model)
        return {
            "format": RESUME_FORMAT,
            "global_step": int(self.state.global_step),
            "epoch": float(self.state.epoch or 0.0),
            "micro_step": int(self._step),
            "num_input_tokens_seen": int(self.state.num_input_tokens_seen or 0),
            "total_flos": float(self.state.total_flos or 0.0),
            "model": dict(unwrapped.state_dict()),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "sampler_epoch_start": None if sampler is None else sampler.epoch_start_state,
            "rng": get_rng_state(),
            "taid": taid,
            "ema": None if self._ema is None else dict(self._ema.model.state_dict()),
            "replay": replay,
            "sdpo_gate": self._gate.state(),
        }

    def resume_train(self, state: Mapping[str, Any]) -> TrainOutput:
        """``train()`` continuing from `resume_state`'s output, taken from a trainer of the same
        run (same model, data, arguments and ``max_steps``). The parts are checked against this
        trainer first (`ResumeStateError` naming the part); the optimizer, scheduler, data
        position and TRL's counters are restored by Trainer's own resume path, the RNG states and
        the weights right before the first resumed step (after the callbacks' ``on_train_begin``,
        where an outer loop may load other weights)."""
        self._check_resume_state(state)
        self._apply_resume_state(state)
        self._pending_resume = dict(state)
        global_step = int(state["global_step"])
        if global_step >= self.args.max_steps:
            raise ResumeStateError(
                f"resume state is at step {global_step}, max_steps is {self.args.max_steps}: "
                "nothing left to train"
            )
        with tempfile.TemporaryDirectory(prefix="resume-", dir=self.args.output_dir) as folder:
            trainer_state = TrainerState(
                global_step=global_step,
                epoch=float(state["epoch"]),
                max_steps=self.args.max_steps,
                train_batch_size=self._train_batch_size,
                num_input_tokens_seen=int(state["num_input_tokens_seen"]),
                total_flos=float(state["total_flos"]),
            )
            trainer_state.compute_steps(self.args, self.args.max_steps)  # as a fresh train()
            trainer_state.save_to_json(os.path.join(folder, "trainer_state.json"))
            try:
                return self.train(resume_from_checkpoint=folder)
            finally:
                self._pending_resume = None

    def train_from_step(self, step: int) -> TrainOutput:
        """``train()`` as if `step` optimizer steps had already been taken, when no resume
        state exists (a replica restarted onto newer global weights): the step count, the LR
        schedule and TAID's step continue from `step` (so ``max_steps`` stays the run's);
        the optimizer moments, RNG streams and data order start afresh (seed them first)."""
        if not 0 <= step < self.args.max_steps:
            raise ValueError(f"step {step} is outside [0, max_steps={self.args.max_steps})")
        if step == 0:
            return self.train()
        self._pending_resume = {"global_step": int(step), "partial": True}
        self._step = int(step) * self.args.gradient_accumulation_steps
        self._buffered_inputs = None
        with tempfile.TemporaryDirectory(prefix="resume-", dir=self.args.output_dir) as folder:
            trainer_state = TrainerState(
                global_step=int(step),
                max_steps=self.args.max_steps,
                train_batch_size=self._train_batch_size,
            )
            trainer_state.compute_steps(self.args, self.args.max_steps)
            trainer_state.save_to_json(os.path.join(folder, "trainer_state.json"))
            try:
                return self.train(resume_from_checkpoint=folder)
            finally:
                self._pending_resume = None

    def _check_resume_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("format") != RESUME_FORMAT:
            raise ResumeStateError(
                f"resume state has format {getattr(state, 'get', lambda _: None)('format')!r}, "
                f"expected {RESUME_FORMAT}"
            )
        for key in ("global_step", "micro_step", "num_input_tokens_seen"):
            if require(state, key, int) < 0:
                raise ResumeStateError(f"resume state: {key!r} must be >= 0")
        require(state, "epoch", (int, float))
        require(state, "total_flos", (int, float))
        unwrapped = self.accelerator.unwrap_model(self.model)
        check_tensors("model", state.get("model"), unwrapped.state_dict())
        if (state.get("ema") is None) != (self._ema is None):
            raise ResumeStateError("resume state and trainer disagree on channel 2's EMA teacher")
        if self._ema is not None:
            check_tensors("ema", state["ema"], self._ema.model.state_dict())
        if (state.get("replay") is None) != (not self._channel3):
            raise ResumeStateError("resume state and trainer disagree on channel 3")
        if (state.get("taid") is None) != (self._taid_callback is None and self._taid_t is None):
            raise ResumeStateError("resume state and trainer disagree on channel 2's TAID")
        require(state, "optimizer", Mapping)
        require(state, "rng", Mapping)
        try:
            TeacherGate(self._gate.window).load_state(state.get("sdpo_gate") or [])
        except ValueError as exc:
            raise ResumeStateError(f"sdpo_gate: {exc}") from exc
        epoch_start = state.get("sampler_epoch_start")
        if epoch_start is not None and (
            not isinstance(epoch_start, torch.Tensor) or epoch_start.dtype != torch.uint8
        ):
            raise ResumeStateError("sampler_epoch_start must be a uint8 generator state")

    def _apply_resume_state(self, state: Mapping[str, Any]) -> None:
        """The parts that live in this object (not in Trainer's training loop)."""
        self._step = int(state["micro_step"])
        self._buffered_inputs = None
        taid = state.get("taid")
        if taid is not None:
            if not isinstance(taid, Mapping):
                raise ResumeStateError("taid must be a dict")
            t = taid.get("t")
            if t is not None:
                self.set_taid_t(float(t))
            losses = taid.get("pending_losses") or []
            self._taid_step_losses = [float(x) for x in losses]
            sched = taid.get("scheduler")
            if self._taid_callback is not None:
                if not isinstance(sched, Mapping):
                    raise ResumeStateError("taid.scheduler must be a TAIDScheduler state")
                self._taid_callback.scheduler.load_state_dict(dict(sched))
        if self._ema is not None:
            self._ema.model.load_state_dict(dict(state["ema"]), strict=True)
        # absent from states written before the gate had a window: an empty one
        self._gate.load_state(state.get("sdpo_gate") or [])
        replay = state.get("replay")
        if replay is not None:
            if not isinstance(replay, Mapping):
                raise ResumeStateError("replay must be a dict")
            records = [
                TraceRecord.from_json(obj, where=f"replay.traces[{i}]")
                for i, obj in enumerate(replay.get("traces") or [])
            ]
            assert self.trace_store is not None
            for record in records:
                self.trace_store.add(record)
            self._pool_records = records
            self._ref_scorer.load_state_rows(replay.get("reference_cache") or [])

    # Trainer's resume path, fed from the pending resume state instead of torch.load'ed files.
    def _get_train_sampler(self, dataset: Dataset | None = None) -> Sampler[int]:
        sampler = EpochSampler(super()._get_train_sampler(dataset))
        if self._pending_resume is not None:
            sampler.restore_epoch_start(self._pending_resume.get("sampler_epoch_start"))
        self._train_sampler = sampler
        return sampler

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        if self._pending_resume is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: the weights are loaded with the RNG states, right before the first step

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        pending = self._pending_resume
        if pending is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        assert self.optimizer is not None
        if pending.get("partial"):  # train_from_step: the schedule continues at the step
            if self.lr_scheduler is not None:
                with warnings.catch_warnings():  # "step() before optimizer.step()"
                    warnings.simplefilter("ignore", UserWarning)
                    for _ in range(int(pending["global_step"])):
                        self.lr_scheduler.step()
            return
        check_optimizer_state(pending["optimizer"], self.optimizer)
        try:
            self.optimizer.load_state_dict(pending["optimizer"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ResumeStateError(f"optimizer: {exc}") from None
        scheduler = pending.get("scheduler")
        if (scheduler is None) != (self.lr_scheduler is None):
            raise ResumeStateError("resume state and trainer disagree on the LR scheduler")
        if self.lr_scheduler is not None:
            if not isinstance(scheduler, Mapping):
                raise ResumeStateError("scheduler must be a state_dict")
            try:
                self.lr_scheduler.load_state_dict(dict(scheduler))
            except (ValueError, KeyError, TypeError) as exc:
                raise ResumeStateError(f"scheduler: {exc}") from None

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._pending_resume is None:
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        pending = self._pending_resume
        if pending is None:
            super()._load_rng_state(checkpoint)
            return
        if pending.get("partial"):
            return  # train_from_step: the caller seeded the RNG streams
        unwrapped = self.accelerator.unwrap_model(self.model)
        with torch.no_grad():
            unwrapped.load_state_dict(dict(pending["model"]), strict=True)
        set_rng_state(pending["rng"])

    @property
    def _group_size(self) -> int:
        """Rollouts per prompt (TRL's ``num_generations``, set by the time training runs)."""
        if self.num_generations is None:
            raise ValueError("num_generations must be set for channels 2 and 3")
        return self.num_generations

    # -- rewards and feedback ------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[no-untyped-def]
        self._feedback.clear()
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        sources = [self._feedback.slots[i] for i in sorted(self._feedback.slots)]
        if self.feedback_funcs:
            extra = _reward_columns(inputs, range(len(inputs)))
            extra["completion_ids"] = completion_ids_list
            sources += call_feedback_funcs(self.feedback_funcs, prompts, completions, extra)
        self._batch = {
            "prompts": prompts,
            "completions": completions,
            "rewards_per_func": rewards_per_func,
            "feedback": merge_feedback(sources, len(prompts)),
        }
        return rewards_per_func

    def _global_rewards(self) -> torch.Tensor:
        """Weighted reward per rollout over all processes (NaN when every function returned None)."""
        rpf = self._batch["rewards_per_func"]
        rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
        return rewards

    # -- generation batch: add channel-2/3 inputs -----------------------------------------------
    # -- where a step's time goes ----------------------------------------------------------------
    def training_step(  # type: ignore[override]
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """TRL's step, timed: ``time/step_s`` (the whole micro-step), ``time/generate_s``
        (rollouts, rewards and the channel inputs, when this step generates), ``time/teacher_s``
        (channel 2: the teacher's forward over the hinted contexts and the distillation term)
        and ``time/loss_backward_s`` (the rest: policy forward, losses, backward); wall seconds,
        averaged over each logging window like every other metric. On a GPU each reading waits
        for the device's queued work (`_clock`), so the split is of work done, not launched."""
        self._phase_s = {"generate": 0.0, "teacher": 0.0}
        t0 = self._clock()
        loss = super().training_step(model, inputs, num_items_in_batch)
        step = self._clock() - t0
        if model.training:
            gen, teacher = self._phase_s["generate"], self._phase_s["teacher"]
            metrics = self._metrics["train"]
            metrics["time/step_s"].append(step)
            metrics["time/generate_s"].append(gen)
            metrics["time/teacher_s"].append(teacher)
            metrics["time/loss_backward_s"].append(max(0.0, step - gen - teacher))
        return loss

    def _clock(self) -> float:
        """``time.perf_counter()`` once the accelerator's queued kernels have finished (CUDA runs
        asynchronously: without the wait a phase would be charged for its launches only and the
        next one for its work). A no-op wait on CPU."""
        device = self.accelerator.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _generate_and_score_completions(self, inputs):  # type: ignore[no-untyped-def]
        t0 = self._clock()
        try:
            return self._generate_with_channel_inputs(inputs)
        finally:
            self._phase_s["generate"] += self._clock() - t0

    def _generate_with_channel_inputs(self, inputs):  # type: ignore[no-untyped-def]
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self._mask_hinted_examples(output, inputs)
        if not self.model.training or not (self._channel2 or self._channel3):
            return output
        rewards = self._global_rewards()
        n = len(self._batch["prompts"])
        start = self.accelerator.process_index * n
        if self._channel2:
            output.update(self._hint_inputs(output, rewards, start, inputs))
        if self._channel3:
            output.update(self._pair_inputs(output, rewards[start : start + n], start))
        return output

    def _mask_hinted_examples(self, output: GenerationBatch, inputs: list[dict]) -> None:
        """Zero the channel-1 advantage of the local rows that are hinted examples (dataset
        column `HINTED_EXAMPLE_COLUMN`) unless ``hint_grpo``: a prompt that shows its own solution
        is then learnt through channel 3's replay (and channel 2) only. Their group statistics
        are their own (a hinted example is its own prompt group), so no other row's advantage
        moves. Logs ``grpo/frac_hinted_examples``, the local share of such rows."""
        hinted = [bool(row.get(HINTED_EXAMPLE_COLUMN, False)) for row in inputs]
        self._metrics["train"]["grpo/frac_hinted_examples"].append(
            sum(hinted) / max(len(hinted), 1)
        )
        if self.composer.hint_grpo or not any(hinted):
            return
        advantages = output["advantages"]
        keep = torch.tensor([not h for h in hinted], dtype=advantages.dtype)
        output["advantages"] = advantages * keep.to(advantages.device)

    def _global_count(self, local: int | torch.Tensor) -> torch.Tensor:
        """Global count / number of processes (the per-process normaliser, as TRL's dapo)."""
        t = torch.as_tensor(local, dtype=torch.float32, device=self.accelerator.device)
        return self.accelerator.gather(t.reshape(1)).sum() / self.accelerator.num_processes

    def _hint_inputs(
        self, output: GenerationBatch, rewards: torch.Tensor, start: int, inputs: list[dict]
    ) -> dict[str, torch.Tensor]:
        s = self.composer
        all_completions = gather_object([completion_text(c) for c in self._batch["completions"]])
        plan = plan_hints(
            self._batch["prompts"],
            all_completions,
            rewards.tolist(),
            self._batch["feedback"],
            num_generations=self._group_size,
            process_start=start,
            template=s.hint_template,
            success_threshold=s.sdpo_success_threshold,
        )
        self._gate_on_teacher(plan, rewards, start, inputs)
        tensors = hint_tensors(
            plan,
            lambda ps: self._tokenize_prompts(ps)[0],
            output["completion_ids"],
            output["completion_mask"],
            pad_id=self._tokenizer.pad_token_id,
        )
        tokens = (output["completion_mask"].bool() & tensors["sdpo_sample_mask"][:, None]).sum()
        tensors["sdpo_num_tokens"] = self._global_count(tokens)
        n = max(len(plan.sample_mask), 1)
        hinted = self._global_count(sum(plan.sample_mask))
        self._metrics["train"]["sdpo/frac_hinted"].append(sum(plan.sample_mask) / n)
        self._metrics["train"]["sdpo/frac_with_sibling"].append(plan.with_sibling / n)
        self._metrics["train"]["sdpo/frac_with_feedback"].append(plan.with_feedback / n)
        self._metrics["train"]["sdpo/frac_failed"].append(plan.failed / n)
        if float(hinted) == 0.0:
            logger.info(
                "channel 2 off for this batch: no failed rollout has a successful sibling "
                "(reward >= %.3g) or feedback",
                s.sdpo_success_threshold,
            )
        return tensors

    def _gate_on_teacher(
        self, plan: HintPlan, rewards: torch.Tensor, start: int, inputs: list[dict]
    ) -> None:
        """Measure the hinted teacher's advantage on this batch and close channel 2 for the batch
        while the teacher is not better than its student (``sdpo_gate``).

        Up to ``sdpo_teacher_probe`` hinted rows (one per prompt group first) get one completion
        sampled from the teacher (the channel-2 teacher model reading the hinted prompt, TRL's
        rollout sampling settings), scored by the run's reward functions; the student's reward
        on the same prompt is its group's mean rollout reward. ``sdpo/teacher_advantage`` =
        mean teacher reward - mean student reward over the probed rows (NaN when nothing was
        probed). Distilling toward a teacher that is no better can only pull the student down,
        so with the gate on channel 2 distils only while the teacher is ahead by more than the
        noise of its measurement: over the last ``sdpo_gate_window`` probed rows, the mean
        paired difference exceeds its standard error (`gate.TeacherGate`;
        ``sdpo/gate_advantage`` logs that mean). SDPO itself distils only from successful
        hints."""
        s = self.composer
        metrics = self._metrics["train"]
        probe = select_probe_rows(plan.sample_mask, start, self._group_size, s.sdpo_teacher_probe)
        advantage = float("nan")
        if probe:
            teacher = self._teacher_rewards([plan.teacher_prompts[i] for i in probe], inputs, probe)
            if teacher is None:  # cannot be measured here: the gate stays open, said once
                if not self._gate_warned:
                    logger.warning(
                        "channel 2's teacher advantage cannot be measured (a reward model, or "
                        "a rollout engine without a generation config): its gate stays open"
                    )
                    self._gate_warned = True
                probe = []
            else:
                groups = rewards.view(-1, self._group_size).nanmean(dim=1)
                student = [float(groups[(start + i) // self._group_size]) for i in probe]
                advantage = float(torch.tensor(teacher).nanmean() - torch.tensor(student).nanmean())
                metrics["sdpo/teacher_reward"].append(float(torch.tensor(teacher).nanmean()))
                metrics["sdpo/student_reward"].append(float(torch.tensor(student).nanmean()))
                self._gate.add(t - u for t, u in zip(teacher, student, strict=True))
        if probe:
            metrics["sdpo/teacher_advantage"].append(advantage)
            metrics["sdpo/gate_advantage"].append(self._gate.mean)
        closed = s.sdpo_gate and bool(probe) and not self._gate.is_open()
        metrics["sdpo/gate_open"].append(0.0 if closed else 1.0)
        if closed:
            plan.sample_mask = [False] * len(plan.sample_mask)

    @torch.no_grad()
    def _teacher_rewards(
        self, prompts: list[Prompt], inputs: list[dict], rows: list[int]
    ) -> list[float] | None:
        """One sampled teacher completion per hinted prompt, scored by the reward functions
        (weighted as TRL weighs them); None when that cannot be done here (a reward function
        that is a model, or a rollout engine without a generation config)."""
        config = getattr(self, "generation_config", None)
        if config is None or any(isinstance(f, nn.Module) for f in self.reward_funcs):
            return None
        model: nn.Module = (
            self._ema.model if self._ema is not None else self.accelerator.unwrap_model(self.model)
        )
        ids = self._tokenize_prompts(prompts)[0]
        input_ids, attention_mask = left_pad(ids, self._tokenizer.pad_token_id)
        device = self.accelerator.device
        out = model.generate(  # type: ignore[operator]
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
        )
        stops = set(self.eos_token_ids)
        completion_ids: list[list[int]] = []
        for row in out[:, input_ids.shape[1] :].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
            completion_ids.append(row[:cut])
        texts = self._tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = not isinstance(prompts[0], str)
        completions = [
            [{"role": "assistant", "content": t}] if conversational else t for t in texts
        ]
        columns = _reward_columns(inputs, rows)
        total = torch.zeros(len(rows))
        scored = torch.zeros(len(rows), dtype=torch.bool)
        weights = self.reward_weights.tolist()
        for func, weight in zip(self.reward_funcs, weights, strict=True):
            # `teacher_probe=True` tells a reward function with side effects (counting
            # rollouts, logging) that this call scores the teacher, not a rollout
            out_scores = cast("Callable[..., Iterable[float | None]]", func)(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                teacher_probe=True,
                **columns,
            )
            if inspect.isawaitable(out_scores):
                out_scores = asyncio.run(_awaited(out_scores))
            values = torch.tensor([math.nan if v is None else float(v) for v in out_scores])
            total += torch.nan_to_num(values) * weight
            scored |= ~torch.isnan(values)
        total[~scored] = math.nan
        return total.tolist()

    def _pair_inputs(
        self, output: GenerationBatch, rewards: torch.Tensor, start: int
    ) -> dict[str, torch.Tensor]:
        s = self.composer
        prompts = self._batch["prompts"]
        assert self.trace_store is not None
        if self.teacher_pool is not None:  # lazy teachers: only prompts the store lacks
            self._pool_records += self.teacher_pool.ensure(prompts[:: self._group_size] or prompts)
        completion_mask = output["completion_mask"]
        pairs, covered = plan_pairs(
            prompts,
            rewards.tolist(),
            completion_mask.sum(-1).tolist(),
            self.trace_store,
            num_generations=self._group_size,
            process_start=start,
            skip_if_not_worse=s.replay_skip_if_not_worse,
            min_trace_reward=s.replay_min_trace_reward,
        )
        device = completion_mask.device
        tensors = pair_tensors(
            pairs,
            len(prompts),
            lambda text: self._tokenizer(text, add_special_tokens=False)["input_ids"],
            pad_id=self._tokenizer.pad_token_id,
            eos_id=self._tokenizer.eos_token_id if self._end_of_turn is None else self._end_of_turn,
            max_length=self._replay_max_length(),
            device=device,
        )
        if s.dpo_variant == "dpo":
            tensors.update(self._ref_scorer.pair_logps(output, tensors, pairs))
        tensors["replay_num_pairs"] = self._global_count(len(pairs))
        groups = max(len(prompts) // self._group_size, 1)
        self._metrics["train"]["replay/trace_coverage"].append(covered / groups)
        self._metrics["train"]["replay/pairs_built"].append(float(len(pairs)))
        return tensors

    def _replay_max_length(self) -> int:
        length = self.composer.replay_max_length or self.max_completion_length
        if length is None:
            raise ValueError("channel 3 needs replay_max_length or max_completion_length")
        return length

    # -- loss ------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(  # type: ignore[override]
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's per-token log-probs; when channels 2/3 need them, from plain logits kept aside,
        and for the fused channel 2 with the body's last hidden states kept aside."""
        want_logits, want_hidden = self._capture_logits, self._capture_hidden
        if not (want_logits or want_hidden):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **multimodal,
            )
        self._capture_logits = self._capture_hidden = False
        if any(v is not None for v in multimodal.values()):
            raise ValueError(
                "channels 2 and 3 support text-only models; set alpha_sdpo=0 and beta_replay=0 "
                "for multimodal inputs"
            )
        with contextlib.ExitStack() as stack:
            hidden: list[torch.Tensor] | None = None
            if want_hidden:
                policy = self._fused3 or (self._fused2[0] if self._fused2 else None)
                assert policy is not None
                hidden = stack.enter_context(capture_hidden(policy.body))
            if want_logits:
                result = self._logits_forward(
                    model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    compute_entropy,
                    compute_aux_loss,
                )
            else:  # TRL's fused LM head: channel 1 without (B, T, V) logits
                result = super()._get_per_token_logps_and_entropies(
                    model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size=batch_size,
                    compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss,
                )
        if hidden is not None:
            if not hidden:
                raise RuntimeError(
                    "the model's body did not run during the student forward; set "
                    "sdpo_fused=False and replay_fused=False"
                )
            states = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
            # (B, T, H): position t is the output layer's input scoring completion token t
            self._captured_hidden = states[:, -(logits_to_keep + 1) : -1]
        return result

    def _logits_forward(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        compute_entropy: bool,
        compute_aux_loss: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One plain forward; the completion logits are kept aside for channels 2/3."""
        kwargs: dict[str, int | bool] = {"logits_to_keep": logits_to_keep + 1}
        if compute_aux_loss:
            kwargs["output_router_logits"] = True
        with self.accelerator.autocast():
            out = model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = out.logits[:, :-1]  # (B, T, V): position t scores completion token t
        ids = input_ids[:, -logits_to_keep:]
        # No full-vocab log-softmax kept for backward: (B, T, V) is already held once (the logits
        # channels 2/3 reuse); a second and third copy would triple the peak at real vocab sizes.
        logps = selective_log_softmax(logits, ids, self.temperature)
        entropies = None
        if compute_entropy:
            entropies = self._entropies(logits)
        self._captured_logits = logits
        return logps, entropies, (out.aux_loss if compute_aux_loss else None)

    def _entropies(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-token entropy at TRL's temperature; row by row (and without grad) unless TRL's
        entropy bonus needs its gradient."""
        if self._entropy_bonus_enabled:
            log_probs = (logits.float() / self.temperature).log_softmax(-1)
            return -(log_probs.exp() * log_probs).sum(-1)
        with torch.no_grad():
            rows = []
            for row in logits:
                lp = (row.float() / self.temperature).log_softmax(-1)
                rows.append(-(lp.exp() * lp).sum(-1))
            return torch.stack(rows)

    def _loss_kwargs(self) -> dict[str, Any]:
        kwargs = self.composer.loss_kwargs()
        if self.composer.taid_scheduled:
            kwargs["taid_t"] = self._taid_t
        kwargs["temperature"] = self.temperature
        return kwargs

    def _loss_batch(self, inputs: GenerationBatch, mode: str) -> GenerationBatch:
        """The composer batch of this micro-batch: the generation batch's counts rescaled to one
        accumulation window (as TRL rescales ``num_items_in_batch`` for ``dapo``)."""
        batch = inputs.copy()
        steps = 1.0
        if mode == "train":
            steps = self.current_gradient_accumulation_steps / self.args.steps_per_generation
        if "sdpo_num_tokens" in batch:
            batch["sdpo_num_tokens"] = batch["sdpo_num_tokens"].clamp(min=1.0) * steps
        if "replay_num_pairs" in batch:
            batch["replay_num_pairs"] = batch["replay_num_pairs"].clamp(min=1.0) * steps
        return batch

    def _compute_loss(self, model: nn.Module, inputs: GenerationBatch) -> torch.Tensor:
        mode = "train" if self.model is not None and self.model.training else "eval"
        want2 = self._channel2 and _any_row(inputs, "sdpo_sample_mask")
        want3 = self._channel3 and _any_row(inputs, "replay_pair_mask")
        if not (want2 or want3):
            loss = super()._compute_loss(model, inputs)
            self._metrics[mode]["loss/grpo"].append(float(loss.detach()))
            self._log_flags(mode, False, False)
            self._call_loss_probe(mode, loss, None, None, loss)
            return loss
        fused2 = want2 and self._fused2 is not None
        fused3 = want3 and self._fused3 is not None
        self._capture_logits = (want3 and not fused3) or (want2 and not fused2)
        self._capture_hidden = fused2 or fused3
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._capture_logits = self._capture_hidden = False
        self._metrics[mode]["loss/grpo"].append(float(loss.detach()))  # channel 1 alone
        grpo_loss = loss
        logits, self._captured_logits = self._captured_logits, None
        hidden, self._captured_hidden = self._captured_hidden, None
        s = self.composer
        batch = self._loss_batch(inputs, mode)
        kwargs = self._loss_kwargs()
        sdpo: tuple[torch.Tensor, dict[str, float]] | None = None
        replay: tuple[torch.Tensor, dict[str, float]] | None = None
        if want2:
            t0 = self._clock()
            if fused2:
                assert hidden is not None and self._fused2 is not None
                student, teacher = self._fused2
                own = teacher is student  # the policy itself: its head, without gradient
                sdpo = fused_sdpo_term(
                    teacher.body,
                    batch,
                    hidden,
                    student.head.weight,
                    student.head.bias,
                    teacher_weight=None if own else teacher.head.weight,
                    teacher_bias=None if own else teacher.head.bias,
                    share_prefix=s.sdpo_share_prefix,
                    backend=s.sdpo_fused_backend,
                    **kwargs,
                )
            else:
                assert logits is not None
                sdpo = sdpo_term(
                    self._ema.model if self._ema is not None else model,
                    batch,
                    logits,
                    logits_to_keep=True,
                    share_prefix=s.sdpo_share_prefix,
                    **kwargs,
                )
            self._phase_s["teacher"] += self._clock() - t0
            if sdpo is not None:
                self._log(mode, sdpo[1])
                if s.taid_scheduled:
                    self._taid_step_losses.append(sdpo[1]["loss/sdpo"])
        if want3:
            if fused3:
                assert hidden is not None and self._fused3 is not None
                head = self._fused3.head
                replay = fused_replay_term(
                    self._fused3.body, batch, hidden, head.weight, head.bias, **kwargs
                )
            else:
                assert logits is not None
                replay = replay_term(model, batch, logits, logits_to_keep=True, **kwargs)
            if replay is not None:
                self._log(mode, replay[1])
        # The total is the loss library's (grpo + alpha_sdpo * sdpo + beta_replay * replay).
        loss, _ = assemble((grpo_loss, {}), sdpo, replay, **kwargs)
        self._log_flags(mode, sdpo is not None, replay is not None)
        if self._loss_probe is not None:
            term2 = None if sdpo is None else s.alpha_sdpo * sdpo[0]
            term3 = None if replay is None else s.beta_replay * replay[0]
            self._call_loss_probe(mode, grpo_loss, term2, term3, loss)
        return loss

    def _call_loss_probe(
        self,
        mode: str,
        grpo: torch.Tensor,
        sdpo: torch.Tensor | None,
        replay: torch.Tensor | None,
        total: torch.Tensor,
    ) -> None:
        if self._loss_probe is not None and mode == "train":
            self._loss_probe({"grpo": grpo, "sdpo": sdpo, "replay": replay, "total": total})

    def _log(self, mode: str, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if key != "taid/t":  # logged by _log_flags once per micro-batch
                self._metrics[mode][key].append(float(value))

    def _log_flags(self, mode: str, active2: bool, active3: bool) -> None:
        if self._channel2:
            self._metrics[mode]["sdpo/active"].append(float(active2))
            kwargs = self._loss_kwargs()
            if kwargs["taid_t"] is not None:  # the wrapper's metrics of every step (taid/t)
                cfg = ComposeConfig.from_kwargs(kwargs)
                for key, value in sdpo_wrappers.get(cfg.sdpo_wrapper).step_metrics(cfg).items():
                    self._metrics[mode][key].append(value)
        if self._channel3:
            self._metrics[mode]["replay/active"].append(float(active3))


def _reward_columns(inputs: list[dict], rows: Iterable[int]) -> dict[str, list[object]]:
    """The dataset columns a reward or feedback function gets for `rows` of the batch (every
    column but the prompt and the completion, which are passed on their own)."""
    keys = [k for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")]
    picked = list(rows)
    return {k: [inputs[i][k] for i in picked] for k in keys}


async def _awaited(value: Awaitable[_T]) -> _T:
    return await value


def _hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model under a PEFT wrapper (TRL patches that one), else ``model``."""
    return cast("PeftModel", model).get_base_model() if is_peft(model) else model


def _any_row(inputs: Mapping[str, object], key: str) -> bool:
    """Whether the row mask ``inputs[key]`` (a channel's selection) selects any row."""
    mask = inputs.get(key)
    return isinstance(mask, torch.Tensor) and bool(mask.any())


__all__ = ["ComposerReplicationTrainer"]
