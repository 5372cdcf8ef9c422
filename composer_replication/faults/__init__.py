"""Fault injection for runs: the chaos injector (`injector`), the throttling S3 proxy (`proxy`)
and their configuration (`events`, the run config's `[chaos]` section).

Faults are real signals and real bytes, never simulated inside the replicas. The composition
root builds them from the run config (assembly/services.py); the driver starts and stops them;
`run.chaos` checks a run afterwards. Imports `exchange` only.
"""

from __future__ import annotations

from composer_replication.lazy import lazy_getattr

_LAZY = {
    "ChaosConfig": "composer_replication.faults.events",
    "ChaosEventConfig": "composer_replication.faults.events",
    "ChaosInjector": "composer_replication.faults.injector",
    "ProcessTargets": "composer_replication.faults.injector",
    "Targets": "composer_replication.faults.injector",
    "ThrottleProxy": "composer_replication.faults.proxy",
    "corrupt_object": "composer_replication.faults.injector",
    "uploading_file": "composer_replication.faults.injector",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
