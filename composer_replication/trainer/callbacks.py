"""Trainer callbacks: the TAID schedule and the EMA teacher update.

Both act once per optimizer step (``on_step_end``), after the weights changed, and reach the
trainer through its public methods only (the `TAIDScheduled` and `EMAHost` protocols, which
`ComposerReplicationTrainer` implements).
"""

from __future__ import annotations

from typing import Protocol

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "composer_replication.trainer needs transformers; install it with "
        "`pip install composer-replication[train]`."
    ) from exc

from composer_replication.loss import (
    TAID_ALPHA,
    TAID_BETA,
    TAID_T_END,
    TAID_T_START,
    TAIDScheduler,
)


class TAIDScheduled(Protocol):
    """A trainer whose channel-2 TAID t is driven from outside."""

    def set_taid_t(self, t: float) -> None: ...

    def pop_taid_losses(self) -> list[float]: ...


class EMAHost(Protocol):
    """A trainer holding an EMA teacher of its policy."""

    def update_ema_teacher(self) -> None: ...


class TAIDCallback(TrainerCallback):
    """Drives TAID's interpolation coefficient t from the trainer's channel-2 loss and step.

    Each optimizer step it feeds the mean channel-2 (TAID) loss of that step and the global step
    to `loss.TAIDScheduler` (momentum-driven increase with a linear floor from ``t_start`` to
    ``t_end`` over ``total_steps``, default the run's ``max_steps``) and hands the new t to the
    loss for the next step. Steps without channel-2 activity leave t unchanged.

    `ComposerReplicationTrainer` adds one automatically when ``sdpo_wrapper="taid"`` and neither
    ``taid_t`` nor ``taid_schedule_step`` is given; pass your own instance in ``callbacks=`` to
    change its parameters.
    """

    def __init__(
        self,
        t_start: float = TAID_T_START,
        t_end: float = TAID_T_END,
        alpha: float = TAID_ALPHA,
        beta: float = TAID_BETA,
        *,
        adaptive: bool = True,
        total_steps: int | None = None,
    ) -> None:
        if total_steps is not None and total_steps < 1:
            raise ValueError("total_steps must be >= 1 or None")
        self.scheduler = TAIDScheduler(t_start, t_end, alpha, beta, adaptive=adaptive)
        self.total_steps = total_steps
        self._trainer: TAIDScheduled | None = None

    @property
    def t(self) -> float:
        return self.scheduler.t

    def bind(self, trainer: TAIDScheduled) -> None:
        """Attach to the trainer whose loss this callback schedules (done by the trainer)."""
        self._trainer = trainer
        trainer.set_taid_t(self.scheduler.t)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        losses = trainer.pop_taid_losses()
        if not losses:
            return
        total = self.total_steps or max(int(state.max_steps or 0), 1)
        trainer.set_taid_t(self.scheduler.step(sum(losses) / len(losses), state.global_step, total))


class EMATeacherCallback(TrainerCallback):
    """Moves the channel-2 EMA teacher toward the student after each optimizer step."""

    def __init__(self, trainer: EMAHost) -> None:
        self._trainer = trainer

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        self._trainer.update_ema_teacher()
