"""Executors: launch N replica processes on a backend, watch them, collect or cancel them.

`base.ServerlessExecutor` is the protocol; every backend (local processes, Ray, Kubernetes,
Modal, HF Jobs, SageMaker, and `MultiExecutor` across several) implements it. `registry` names
the backends `backend.kind` can choose (module, class, pip extra, SDK, placement facts).
Executors know nothing of training: they start a command with a rank in its environment
(ARCHITECTURE.md).

Names load lazily so that importing this package does not import ray, modal, boto3, ... .
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ServerlessExecutor": "composer_replication.executors.base",
    "RankLauncher": "composer_replication.executors.base",
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

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'composer_replication.executors' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
