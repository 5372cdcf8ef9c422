"""Sync DiLoCo's exact resume (sync over the object store and torchft alike): every replica
ends round R at inner step R * H, so a replica resumes from its own resume state of the round
it rejoins at (diloco/replica_state.py), and ``train --resume`` rolls the store back to the
newest round every replica saved its state for.

- `ResumeStateWriter`: the trainer callback that writes this replica's resume state after
  every committed outer round;
- `own_resume_state`: the state a (re)launched replica continues from (None, with a warning,
  when it is absent or fails its checks: fresh inner state from the global weights);
- `rollback_for_resume` / `resume_plan_now`: the driver's rollback on ``--resume`` and what
  `status` says it would do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from composer_replication.diloco.outer_mode import OuterLoop
from composer_replication.diloco.replica_state import (
    ReplicaStateError,
    ResumableTrainer,
    load_replica_state,
    prune_replica_states,
    resume_plan,
    resume_point,
    rollback_to,
    save_replica_state,
)
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.store import ObjectStore

__all__ = ["ResumeStateWriter", "own_resume_state", "resume_plan_now", "rollback_for_resume"]


def own_resume_state(
    store: ObjectStore, rank: int, round: int, keys: RunKeys | None = None
) -> dict[str, object] | None:
    """This replica's resume state of `round` (None at round 0, or with a one-line warning
    when it is absent or fails its checks, or in a signed run is not signed by this rank for
    this run: the replica then starts its inner state afresh)."""
    if round == 0:
        return None
    try:
        return load_replica_state(store, rank=rank, round=round, keys=keys)
    except ReplicaStateError as exc:
        print(
            f"replica {rank}: {exc}; continuing from the global weights of round {round} "
            "with a fresh inner optimizer, schedule position and sampling stream",
            file=sys.stderr,
            flush=True,
        )
        return None


def rollback_for_resume(store: ObjectStore, n_replicas: int, warn: Callable[[str], None]) -> int:
    """The newest round every replica can resume from exactly; the store forgets the rounds
    after it (diloco/replica_state.py)."""
    round_ = resume_point(store, n_replicas, warn=warn)
    rollback_to(store, round_, n_replicas)
    return round_


def resume_plan_now(store: ObjectStore, n_replicas: int) -> tuple[str, list[str]]:
    """What ``train --resume`` would do now (read only), and the lines it would warn with."""
    warnings: list[str] = []
    plan = resume_plan(resume_point(store, n_replicas, warn=warnings.append))
    return plan.replace("resuming at", "resume at").replace("starting over", "start over"), warnings


class ResumeStateWriter(TrainerCallback):
    """Writes this replica's resume state (`diloco.replica_state`) after every committed outer
    round, and prunes its states beyond the newest `keep_rounds`. Added to the trainer LAST (after
    its own TAID/EMA callbacks), so it sees the step's final state. The metrics are flushed
    first, after the step's log line when the step logs: every record up to a resume point is
    in the store before that point is. A round whose step is not ``round * sync_every_h`` (a
    replica that healed onto a newer global state) is skipped: an exact resume from round R
    starts at step R * H."""

    def __init__(
        self,
        *,
        store: ObjectStore,
        rank: int,
        outer: OuterLoop,
        trainer: ResumableTrainer,
        sync_every_h: int,
        keep_rounds: int,
        flush: Callable[[], None],
        keys: RunKeys | None = None,
    ) -> None:
        self.store, self.rank, self.outer, self.trainer = store, rank, outer, trainer
        self.sync_every_h, self.keep_rounds, self.flush = sync_every_h, keep_rounds, flush
        self.keys = keys  # a signed run: each state's manifest is signed with this rank's key
        self._round: int | None = None
        self._pending: tuple[int, int, dict[str, object]] | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        self._round = int(self.outer.round)  # bound by the DiLoCo callback by now

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        rnd = int(self.outer.round)
        if rnd == self._round:
            return
        self._round = rnd
        step = int(state.global_step)
        if step != rnd * self.sync_every_h:
            return
        # Nothing trains between here and this step's log line: the live tensors stay valid.
        self._pending = (rnd, step, self.trainer.resume_state())
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
        rnd, step, resume = self._pending
        self._pending = None
        self.flush()
        save_replica_state(
            self.store, rank=self.rank, round=rnd, step=step, state=resume, keys=self.keys
        )
        prune_replica_states(self.store, self.rank, self.keep_rounds)
