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
from collections.abc import Callable

from transformers import TrainerControl, TrainerState, TrainingArguments

from composer_replication.diloco.mode_protocol import OuterLoop
from composer_replication.diloco.replica_state import (
    ReplicaStateError,
    ResumableTrainer,
    load_replica_state,
    resume_plan,
    resume_point,
    rollback_to,
)
from composer_replication.diloco.state_writer import StateWriter
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


class ResumeStateWriter(StateWriter):
    """Writes this replica's resume state (`diloco.replica_state`) after every committed outer
    round, and prunes its states beyond the newest `keep_rounds` (`StateWriter`: after the
    step's log line, the metrics flushed first). A round whose step is not
    ``round * sync_every_h`` (a replica that healed onto a newer global state) is skipped: an
    exact resume from round R starts at step R * H."""

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
        super().__init__(
            store=store, rank=rank, kind="rank", keep=keep_rounds, flush=flush, keys=keys
        )
        self.outer, self.trainer, self.sync_every_h = outer, trainer, sync_every_h
        self._round: int | None = None

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
        self.stage(rnd, step, self.trainer.resume_state(), control)
