"""Sync DiLoCo over the object store, the ``mode = "sync"``, ``manager = "object_store"``
outer-loop mode: its `OuterLoopMode` (`sync_mode.SyncDiLoCo`, whose hooks run/ calls) and its
exact resume (`sync_resume`: the resume-state writer, a replica's own state of the round it
rejoins at, the driver's rollback on ``--resume``). The torchft path (diloco/torchft/) runs
the same lockstep outer loop and shares this resume."""

from __future__ import annotations

from composer_replication.lazy import lazy_getattr

_LAZY = {
    "SyncDiLoCo": "composer_replication.diloco.sync.sync_mode",
    "ResumeStateWriter": "composer_replication.diloco.sync.sync_resume",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
