"""`StateWriter`: what the outer-loop modes' resume-state writers share (sync's
`ResumeStateWriter`, a decoupled learner's `LearnerStateWriter`).

A mode's writer is a trainer callback added LAST (after the trainer's own TAID/EMA callbacks),
so at a step's end it sees the step's final state; it decides when a state is due and hands it
to `stage`. The state is saved after that step's log line, the metrics flushed first (every
record up to a resume point is in the store before that point is), or at once when the step
does not log (nothing trains in between: the live tensors stay valid); then the writer's
states beyond the newest ``keep`` are pruned (diloco/replica_state.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from composer_replication.diloco.replica_state import (
    StateKind,
    prune_replica_states,
    save_replica_state,
)
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.store import ObjectStore

__all__ = ["StateWriter"]


class StateWriter(TrainerCallback):
    """Saves the resume states a mode's writer `stage`s (see the module docstring); ``keys``
    (a signed run): each state's manifest is signed with this rank's key."""

    def __init__(
        self,
        *,
        store: ObjectStore,
        rank: int,
        kind: StateKind,
        keep: int,
        flush: Callable[[], None],
        keys: RunKeys | None = None,
    ) -> None:
        self.store, self.rank, self.kind, self.keep = store, rank, kind, keep
        self.flush, self.keys = flush, keys
        self._pending: tuple[int, int, dict[str, object]] | None = None

    def stage(
        self, round: int, step: int, state: dict[str, object], control: TrainerControl
    ) -> None:
        """Save ``state`` (indexed by ``round``; a learner's by its step) after this step's
        log line, or now when the step does not log."""
        self._pending = (round, step, state)
        if not control.should_log:
            self._write()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, object] | None = None,
        **kwargs: object,
    ) -> None:
        self._write()

    def _write(self) -> None:
        if self._pending is None:
            return
        round_, step, resume = self._pending
        self._pending = None
        self.flush()
        save_replica_state(
            self.store,
            rank=self.rank,
            round=round_,
            step=step,
            state=resume,
            kind=self.kind,
            keys=self.keys,
        )
        prune_replica_states(self.store, self.rank, self.keep, kind=self.kind)
