"""Executors: launch N replica processes on a backend, watch them, collect or cancel them.

`base.ServerlessExecutor` is the protocol; every backend (local processes, Ray, Kubernetes,
Modal, HF Jobs, SageMaker, and `MultiExecutor` across several) implements it. `registry` names
the backends `backend.kind` can choose (module, class, pip extra, SDK, placement facts).
Executors know nothing of training: they start a command with a rank in its environment
(ARCHITECTURE.md).

Names load lazily so that importing this package does not import ray, modal, boto3, ... .
"""

from __future__ import annotations

from composer_replication.lazy import lazy_getattr

EXPORTS = {
    "ServerlessExecutor": "composer_replication.executors.executor",
    "RankLauncher": "composer_replication.executors.executor",
    "ReplicaHandle": "composer_replication.executors.executor",
    "ReplicaStatus": "composer_replication.executors.executor",
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

__all__ = sorted(EXPORTS)


__getattr__ = lazy_getattr(__name__, EXPORTS)
