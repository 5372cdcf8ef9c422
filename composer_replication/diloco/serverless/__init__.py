"""The seeds' import path, kept as a compatibility façade (no code lives here).

The seed documents import everything serverless from ``composer_replication.diloco.serverless``.
Since the floor plan (ARCHITECTURE.md) the pieces live where their job is: the object-store
exchange in `composer_replication.exchange`, the launchers in `composer_replication.executors`,
and the replica a run launches in `composer_replication.run.replica`. This package only
re-exports those names, lazily (importing it imports nothing heavy), and
``python -m composer_replication.diloco.serverless.replica_entrypoint`` still starts a replica.
"""

from __future__ import annotations

from composer_replication import exchange, executors
from composer_replication.lazy import lazy_getattr

_LAZY = {**exchange.EXPORTS, **executors.EXPORTS}
# Modules the seeds name as attributes of this package.
_MODULES = {"replica_entrypoint": "composer_replication.run.replica"}

__all__ = sorted([*_LAZY, *_MODULES])


__getattr__ = lazy_getattr(__name__, _LAZY, _MODULES)
