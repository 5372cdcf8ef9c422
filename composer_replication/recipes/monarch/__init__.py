"""Monarch recipe (torchmonarch 0.7, extra ``monarch``): a composer-replication run as Monarch
actors on a process mesh, driven from one controller.

- ``actors``: `TrainerActor` (`ComposerReplicationTrainer` + DiLoCo through the object store),
  `GeneratorActor` (rollouts from the trainer's current weights), `RewarderActor` (the task's
  reward with feedback), `TeacherPoolActor` (the run's channel-3 teachers, shared by the mesh).
- ``train``: ``python -m composer_replication.recipes.monarch.train CONFIG.toml`` spawns the
  mesh and the actors and trains; it checks that the replicas' global weights agree after
  every round.

Importing this package imports nothing of Monarch; the names below import ``actors`` (and so
Monarch) on first use. See docs/recipes/monarch.md.
"""

from __future__ import annotations

from composer_replication.lazy import lazy_getattr

_LAZY = {
    "GeneratorActor": "composer_replication.recipes.monarch.actors",
    "RewarderActor": "composer_replication.recipes.monarch.actors",
    "TeacherPoolActor": "composer_replication.recipes.monarch.actors",
    "TrainerActor": "composer_replication.recipes.monarch.actors",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
