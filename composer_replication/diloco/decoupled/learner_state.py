"""Decoupled DiLoCo's exact resume: each learner's state at its last push, in the run store.

After every inner step at which a learner queued a push, `LearnerStateWriter` (a trainer
callback, added last) saves the trainer's resume state (weights, inner optimizer, LR schedule,
data position, RNG states; `ComposerReplicationTrainer.resume_state`) plus the learner's own
(`DecoupledLearner.resume_state`: step, each fragment's base version and weights, the steps and
tokens since that base and since its last push) under ``resume/learner-<r>/<step:010d>``, in
sync mode's format (diloco/replica_state.py: data first, a manifest with sizes and sha256 last,
never unpickled, every tensor checked finite on load; with ``[security] sign`` the manifest is
signed with the learner's key and a state not signed by it is refused), and keeps the newest
`KEEP` states.

A learner that starts (``train --resume``, or relaunched during the run: one path) takes its
newest state that passes every check (`learner_resume`): it continues from that step with
that state, its data at that step; the usual poller then applies any newer globals. A state
that is missing, torn, corrupt or forged (wrong size or checksum, non-finite, not this
learner's step) is skipped with a line saying why; with none left the learner starts from the
newest globals with fresh inner state, as before. `learner_start` is that start, restored into
the learner; `learner_resume_plan` says what ``train --resume`` would do (`status`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping

from transformers import TrainerControl, TrainerState, TrainingArguments

from composer_replication.diloco.decoupled.learner import DecoupledLearner
from composer_replication.diloco.mode_protocol import ReplicaStart
from composer_replication.diloco.replica_state import (
    ResumableTrainer,
    newest_replica_state,
)
from composer_replication.diloco.state_writer import StateWriter
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.store import ObjectStore

__all__ = [
    "KEEP",
    "LearnerResume",
    "LearnerStateWriter",
    "learner_resume",
    "learner_resume_plan",
    "learner_start",
]

log = logging.getLogger(__name__)

KEEP = 2  # a learner's newest states kept in the store (the newest may be torn by a kill)

LearnerResume = tuple[int, str, dict[str, object]]  # (step, manifest key, trainer + learner state)


def learner_resume(
    store: ObjectStore,
    rank: int,
    *,
    keys: RunKeys | None = None,
    warn: Callable[[str], None] | None = None,
) -> LearnerResume | None:
    """Learner `rank`'s newest valid resume state (see the module docstring), or None; `warn`
    gets one line per state skipped and why; ``keys`` (a signed run): only states signed by
    this learner count."""

    def check(step: int, state: Mapping[str, object]) -> str | None:
        own = state.get("learner")
        if not isinstance(own, dict) or own.get("step") != step:
            return f"its learner part is not at step {step}"
        return None

    return newest_replica_state(store, rank, "learner", check=check, warn=warn, keys=keys)


def learner_start(
    store: ObjectStore, rank: int, learner: DecoupledLearner, max_steps: int
) -> ReplicaStart:
    """A decoupled learner's newest valid state at a push, restored into `learner`, and the
    start event's fields naming it (``resume_state``: its manifest key) or why there is none
    (``resume_fallback``: the learner then starts from the newest globals with fresh inner
    state). A start at step 0 with no state says nothing."""
    skipped: list[str] = []
    found = learner_resume(store, rank, keys=learner.keys, warn=skipped.append)
    why = "; ".join(skipped)
    if found is not None:
        step, key, state = found
        if step >= max_steps:
            why = f"{key} is at step {step}, the end of training ({max_steps})"
        else:
            try:
                learner.restore(state["learner"])
            except ValueError as exc:
                why = f"{key}: {exc}"
            else:
                fields: dict[str, str | int] = {"resume_state": key, "resume_state_step": step}
                return ReplicaStart(state, learner.start_step, fields)
    elif learner.start_step > 0 and not why:
        why = f"no resume state of learner {rank} in the store"
    if not why:
        return ReplicaStart(None, learner.start_step)
    print(
        f"replica {rank}: {why}; starting from the newest global weights with a fresh inner "
        "optimizer, schedule position and sampling stream",
        file=sys.stderr,
        flush=True,
    )
    return ReplicaStart(None, learner.start_step, {"resume_fallback": why[:2000]})


def learner_resume_plan(store: ObjectStore, n_learners: int) -> tuple[str, list[str]]:
    """What ``train --resume`` would do now (read only): each learner from its newest valid
    state at a push; and the lines saying which states it would skip."""
    lines: list[str] = []
    found = {r: learner_resume(store, r, warn=lines.append) for r in range(n_learners)}
    each = ", ".join(
        f"learner {r} at step {f[0]}" if f else f"learner {r} from the newest globals"
        for r, f in found.items()
    )
    return f"relaunch each learner from its state at its last push ({each})", lines


class LearnerStateWriter(StateWriter):
    """Saves the learner's resume state after every step at which it queued a push (see the
    module docstring; `StateWriter`: after the step's log line, the metrics flushed first), and
    keeps its newest ``keep``."""

    def __init__(
        self,
        *,
        store: ObjectStore,
        rank: int,
        learner: DecoupledLearner,
        trainer: ResumableTrainer,
        flush: Callable[[], None],
        keep: int = KEEP,
    ) -> None:
        super().__init__(
            store=store, rank=rank, kind="learner", keep=keep, flush=flush, keys=learner.keys
        )
        self.learner, self.trainer = learner, trainer
        self._saved: int | None = learner.restored_from

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        step = int(state.global_step)
        if self.learner.last_push_step != step or self._saved == step:
            return
        if self.learner.step != step:  # not aligned with the trainer: nothing exact to save
            return
        try:
            resume = self.trainer.resume_state()
        except RuntimeError as exc:  # between two generations: the next push saves
            log.warning("learner %d: no resume state at step %d: %s", self.rank, step, exc)
            return
        resume["learner"] = self.learner.resume_state()
        self._saved = step
        self.stage(step, step, resume, control)
