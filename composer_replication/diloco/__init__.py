"""DiLoCo outer optimisation: replicas train H inner steps, then exchange pseudo-gradients
(global - local) once and apply an outer Nesterov step. Knows nothing of losses."""

from __future__ import annotations

from composer_replication.lazy import lazy_getattr

_LAZY = {
    "make_diloco_outer_loop": "composer_replication.diloco.outer_loop",
    "DiLoCoOuterLoop": "composer_replication.diloco.outer_loop",
    "Manager": "composer_replication.diloco.manager",
    "TorchFTManager": "composer_replication.diloco.torchft_path",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
