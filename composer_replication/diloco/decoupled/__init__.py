"""Decoupled DiLoCo, the ``mode = "decoupled"`` outer-loop mode: its `OuterLoopMode`
(`decoupled_mode.DecoupledDiLoCo`, whose hooks run/ calls), the learner (`learner`:
`DecoupledLearner` and its `[diloco]` settings `DecoupledConfig`), a learner's exact resume
(`learner_state`) and the mode's checks over a run's store (`decoupled_check`: the end-of-run
check, the chaos checker) and its service, the synchronizer (`synchronizer`; one fragment's
merges in `fragment_merger`, the merge math in `merge_math`; its settings, composed into the
`[diloco]` section, in diloco/synchronizer_config.py).

``from composer_replication.diloco.decoupled import DecoupledLearner`` (the learner's names,
as when this was one module) keeps working through the lazy table below."""

from __future__ import annotations

from composer_replication.lazy import lazy_getattr

_LEARNER = "composer_replication.diloco.decoupled.learner"
_LAZY = {
    "DecoupledDiLoCo": "composer_replication.diloco.decoupled.decoupled_mode",
    "check_decoupled_run": "composer_replication.diloco.decoupled.decoupled_check",
    "SYNCHRONIZER_PLACES": _LEARNER,
    "DecoupledConfig": _LEARNER,
    "DecoupledLearner": _LEARNER,
    "LearnerConfig": _LEARNER,
    "LearnerState": _LEARNER,
    "RejoinRecord": _LEARNER,
    "push_offsets": _LEARNER,
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
