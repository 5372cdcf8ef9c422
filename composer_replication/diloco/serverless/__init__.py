"""The seeds' import path, kept as a compatibility façade (no code lives here).

The seed documents import everything serverless from ``composer_replication.diloco.serverless``.
Since the floor plan (ARCHITECTURE.md) the pieces live where their job is: the object-store
exchange in `composer_replication.exchange`, the launchers in `composer_replication.executors`,
and the replica a run launches in `composer_replication.run.replica`. This package only
re-exports those names, lazily (importing it imports nothing heavy), and
``python -m composer_replication.diloco.serverless.replica_entrypoint`` still starts a replica.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ObjectStoreAllReduce": "composer_replication.exchange.allreduce",
    "ObjectStoreManager": "composer_replication.exchange.manager",
    "MockManager": "composer_replication.exchange.manager",
    "ServerlessExecutor": "composer_replication.executors.base",
    "ReplicaHandle": "composer_replication.executors.base",
    "ReplicaStatus": "composer_replication.executors.base",
    "LocalProcessExecutor": "composer_replication.executors.local",
    "MultiExecutor": "composer_replication.executors.multi",
    "RayExecutor": "composer_replication.executors.ray",
    "K8sExecutor": "composer_replication.executors.k8s",
    "ModalExecutor": "composer_replication.executors.modal",
    "HFJobsExecutor": "composer_replication.executors.hf_jobs",
    "SageMakerExecutor": "composer_replication.executors.sagemaker",
    "CloudExecutorError": "composer_replication.executors.redact",
    "MissingCredentialsError": "composer_replication.executors.redact",
}
# Modules the seeds name as attributes of this package.
_MODULES = {"replica_entrypoint": "composer_replication.run.replica"}

__all__ = sorted([*_LAZY, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(
            f"module 'composer_replication.diloco.serverless' has no attribute {name!r}"
        )
    return getattr(importlib.import_module(module_name), name)
