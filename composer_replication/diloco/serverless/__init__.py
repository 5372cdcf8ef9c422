"""Serverless DiLoCo: replicas that meet only through an object store.

Two seams (DESIGN.md): `ServerlessExecutor` launches N replicas on a backend; the
`ObjectStoreAllReduce` exchanges their pseudo-gradients through s3:// / gs:// / file:// /
memory://. `ObjectStoreManager` (alias `MockManager`, the seed name) lets
`torchft.local_sgd.DiLoCo` run on top of that exchange.

Names load lazily so that importing this package does not import boto3, ray, modal, ... .
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ObjectStoreAllReduce": "composer_replication.diloco.serverless.allreduce",
    "ObjectStoreManager": "composer_replication.diloco.serverless.manager",
    "MockManager": "composer_replication.diloco.serverless.manager",
    "ServerlessExecutor": "composer_replication.diloco.serverless.executor",
    "ReplicaHandle": "composer_replication.diloco.serverless.executor",
    "ReplicaStatus": "composer_replication.diloco.serverless.executor",
    "LocalProcessExecutor": "composer_replication.diloco.serverless.local",
    "MultiExecutor": "composer_replication.diloco.serverless.multi",
    "RayExecutor": "composer_replication.diloco.serverless.ray",
    "K8sExecutor": "composer_replication.diloco.serverless.k8s",
    "ModalExecutor": "composer_replication.diloco.serverless.modal",
    "HFJobsExecutor": "composer_replication.diloco.serverless.hf_jobs",
    "SageMakerExecutor": "composer_replication.diloco.serverless.sagemaker",
    "CloudExecutorError": "composer_replication.diloco.serverless.redact",
    "MissingCredentialsError": "composer_replication.diloco.serverless.redact",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(
            f"module 'composer_replication.diloco.serverless' has no attribute {name!r}"
        )
    return getattr(importlib.import_module(module_name), name)
