"""DiLoCoCallback: run a `DiLoCoOuterLoop` inside a Hugging Face ``trainer.train()``.

``trainer.add_callback(outer.callback())`` (the seed recipes' wiring). The trainer creates its
optimizer inside ``train()``, so the callback binds the outer loop in ``on_train_begin`` (where
the trainer passes ``model=`` and ``optimizer=``), which also loads the run's global weights
before the first step, and enters it: from then on every inner ``optimizer.step()`` is counted
by DiLoCo's hooks and every H-th one triggers the pseudo-gradient exchange and outer step. In
``on_train_end`` the loop is exited; with ``load_global_at_end=True`` (default) the model then
holds the global weights, which is what should be saved or evaluated.

Works with any `transformers.Trainer` subclass, including TRL's GRPOTrainer and
`ComposerReplicationTrainer`. Gradient accumulation is fine: DiLoCo counts optimizer steps.
"""

from __future__ import annotations

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "outer.callback() needs transformers: pip install composer-replication[train]"
    ) from exc

from torch import nn

from composer_replication.diloco.mode_protocol import OuterLoop

__all__ = ["DiLoCoCallback", "OuterLoop"]


class DiLoCoCallback(TrainerCallback):
    """See the module docstring. ``outer`` is the wrapped `DiLoCoOuterLoop` (or any `OuterLoop`,
    e.g. a decoupled learner)."""

    def __init__(self, outer: OuterLoop, *, load_global_at_end: bool = True) -> None:
        self.outer = outer
        self.load_global_at_end = load_global_at_end
        self._tokens_seen = 0

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        model = kwargs.get("model")
        optimizer = kwargs.get("optimizer")
        if not self.outer.bound:
            if optimizer is None:
                raise ValueError(
                    "the trainer passed no optimizer to on_train_begin; cannot bind DiLoCo"
                )
            self.outer.bind(model=_unwrap_model(model), optimizer=optimizer)
        # a resumed trainer restored its token count: only the tokens from here on are new
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self.outer.__enter__()

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        # Token weighting: the trainer counts input tokens when include_num_input_tokens_seen is
        # on; report this step's share before the optimizer step that may trigger the sync.
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if seen > self._tokens_seen:
            self.outer.record_tokens(seen - self._tokens_seen)
        self._tokens_seen = seen

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        # Expose the outer round to other callbacks and the trainer's state.
        setattr(state, "diloco_round", self.outer.round)  # noqa: B010  # not a TrainerState field

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        self.outer.__exit__(None, None, None)
        if self.load_global_at_end:
            self.outer.load_global_weights()


def _unwrap_model(model: object) -> nn.Module | None:
    # DDP / accelerate wrappers keep the real module in .module; DiLoCo needs the parameters.
    while (
        isinstance(model, nn.Module) and hasattr(model, "module") and not hasattr(model, "config")
    ):
        model = model.module
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(
            f"the trainer passed a model of type {type(model).__name__}, not a torch module"
        )
    return model
