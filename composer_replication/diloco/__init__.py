"""DiLoCo outer optimisation: replicas train H inner steps, then exchange pseudo-gradients
(global - local) once and apply an outer Nesterov step. Knows nothing of losses.

Three ways to run it, each one `OuterLoopMode` (sync over the object store, the torchft path,
Decoupled DiLoCo), picked from the `[diloco]` section (`DilocoConfig`) by `outer_loop_mode`."""

from __future__ import annotations

from composer_replication.lazy import lazy_getattr

_LAZY = {
    "make_diloco_outer_loop": "composer_replication.diloco.outer_loop",
    "DiLoCoOuterLoop": "composer_replication.diloco.outer_loop",
    "DilocoConfig": "composer_replication.diloco.section",
    "Manager": "composer_replication.diloco.manager",
    "OuterLoopMode": "composer_replication.diloco.mode_protocol",
    "OuterOptimizerConfig": "composer_replication.diloco.outer_optimizer",
    "StreamingOptions": "composer_replication.diloco.outer_loop",
    "TorchFTManager": "composer_replication.diloco.torchft.torchft_path",
    "outer_loop_mode": "composer_replication.diloco.mode_registry",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
