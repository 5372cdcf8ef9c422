"""The seeds' public import paths keep working (lazy re-exports of the floor plan's modules)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SEED_NAMES = [
    "ServerlessExecutor",
    "ReplicaHandle",
    "LocalProcessExecutor",
    "RayExecutor",
    "K8sExecutor",
    "ModalExecutor",
    "HFJobsExecutor",
    "SageMakerExecutor",
    "ObjectStoreAllReduce",
    "ObjectStoreManager",
    "MockManager",
]


@pytest.mark.parametrize("name", SEED_NAMES)
def test_seed_serverless_name_is_the_real_class(name):
    import importlib

    import composer_replication.diloco.serverless as facade

    obj = getattr(facade, name)
    home = importlib.import_module(obj.__module__)
    assert getattr(home, name) is obj
    assert obj.__module__.startswith(
        ("composer_replication.exchange", "composer_replication.executors")
    )


def test_mock_manager_is_object_store_manager():
    from composer_replication.diloco.serverless import MockManager, ObjectStoreManager

    assert MockManager is ObjectStoreManager


def test_replica_entrypoint_is_the_run_replica_module():
    from composer_replication.diloco.serverless import replica_entrypoint
    from composer_replication.run import replica

    assert replica_entrypoint is replica
    assert callable(replica_entrypoint.main)


def test_make_diloco_outer_loop_and_compose_loss():
    from composer_replication import compose_loss as top
    from composer_replication.diloco import make_diloco_outer_loop
    from composer_replication.diloco.outer_loop import make_diloco_outer_loop as real
    from composer_replication.loss import compose_loss

    assert make_diloco_outer_loop is real
    assert top is compose_loss


def test_unknown_facade_name_is_an_attribute_error():
    import composer_replication.diloco.serverless as facade

    with pytest.raises(AttributeError, match="NoSuchName"):
        facade.NoSuchName  # noqa: B018


def test_facade_import_is_cheap():
    code = (
        "import sys, composer_replication.diloco.serverless as f\n"
        "heavy = [m for m in ('torch', 'ray', 'modal', 'boto3', 'kubernetes', 'trl') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_seed_module_path_runs_the_replica_cli():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer_replication.diloco.serverless.replica_entrypoint",
            "--help",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "--rendezvous" in out.stdout
