"""composer-replication: the Composer recipe (GRPO + hint self-distillation + trace replay) on N
cheap replicas kept in step by DiLoCo.

The package root stays cheap to import: heavy names (the TRL trainer) load on first use.
"""

from __future__ import annotations

from composer_replication.lazy import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "ComposerReplicationTrainer": "composer_replication.trainer",
    "ComposerConfig": "composer_replication.trainer",
    "compose_loss": "composer_replication.loss.compose",
}

__all__ = ["ComposerConfig", "ComposerReplicationTrainer", "__version__", "compose_loss"]


__getattr__ = lazy_getattr(__name__, _LAZY)
