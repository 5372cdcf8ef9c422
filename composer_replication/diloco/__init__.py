"""DiLoCo outer optimisation: replicas train H inner steps, then exchange pseudo-gradients
(global - local) once and apply an outer Nesterov step. Knows nothing of losses."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "make_diloco_outer_loop": "composer_replication.diloco.outer_loop",
    "DiLoCoOuterLoop": "composer_replication.diloco.outer_loop",
    "Manager": "composer_replication.diloco.manager",
    "TorchFTManager": "composer_replication.diloco.torchft_path",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'composer_replication.diloco' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
