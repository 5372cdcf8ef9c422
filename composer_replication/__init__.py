"""composer-replication: the Composer recipe (GRPO + hint self-distillation + trace replay) on N
cheap replicas kept in step by DiLoCo.

The package root stays cheap to import: heavy names (the TRL trainer) load on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ComposerReplicationTrainer": "composer_replication.trainer",
    "ComposerConfig": "composer_replication.trainer",
    "compose_loss": "composer_replication.loss.compose",
}

__all__ = ["ComposerConfig", "ComposerReplicationTrainer", "__version__", "compose_loss"]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'composer_replication' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
