"""`train` with a real object store (SeaweedFS for s3://, the GCS emulator for gs://, both on
127.0.0.1): the replicas meet only in the bucket, the driver reads metrics and checkpoints back from it; a missing bucket is a clear exit-2
error before anything is written."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.server]

SMALL = [
    *TINY_RUN,
    "logging.tensorboard=false",
]


def _options(storage_options: dict) -> str:
    inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in storage_options.items())
    return f"store.storage_options={{{inner}}}"


@pytest.mark.heavy
@pytest.mark.parametrize("server, scheme", [("seaweedfs_server", "s3"), ("gcs_server", "gs")])
def test_train_through_an_object_store(
    server: str,
    scheme: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys,  # noqa: ANN001
) -> None:
    _, bucket, storage_options = request.getfixturevalue(server)
    monkeypatch.chdir(tmp_path)
    uri = f"{scheme}://{bucket}/{uuid.uuid4().hex}/"
    code = main(
        [
            "train",
            *SMALL,
            "train.max_steps=4",
            "diloco.sync_every_h=2",
            f"store.uri={uri}",
            _options(storage_options),
            "--name",
            "s3run",
        ]
    )
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "s3run"
    assert code == 0, out + "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert not (run / "store").exists()  # nothing of the exchange on the local disk
    records = read_metrics(run / "metrics.jsonl")
    rounds = [r for r in records if r["kind"] == "round"]
    assert sorted((r["replica"], r["round"]) for r in rounds) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(r["round/committed"] and r["round/included"] == 2 for r in rounds)
    # checkpoints were written to the bucket and mirrored into the run folder
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()
    from composer_replication.exchange.store import ObjectStore

    assert ObjectStore(uri, storage_options).has_object("checkpoints/final/COMMITTED")
    assert json.loads((run / "config.json").read_text())["store"]["uri"] == uri


def test_missing_bucket_is_a_config_error(
    moto_server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys,  # noqa: ANN001
) -> None:
    _, _, storage_options = moto_server  # moto, unlike SeaweedFS, does not create buckets on PUT
    monkeypatch.chdir(tmp_path)
    uri = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run/"
    assert main(["train", *SMALL, f"store.uri={uri}", _options(storage_options)]) == 2
    err = capsys.readouterr().err
    assert f"store.uri: cannot write to {uri}" in err
    assert list(tmp_path.iterdir()) == []


def test_backend_without_credentials_is_a_config_error(
    moto_server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys,  # noqa: ANN001
) -> None:
    """A cloud backend whose credentials are missing fails before the run folder exists."""
    _, bucket, storage_options = moto_server
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    uri = f"s3://{bucket}/{uuid.uuid4().hex}/"
    code = main(
        [
            "train",
            *SMALL,
            "backend.kind=k8s",
            'backend.options={image = "img:1"}',
            f"store.uri={uri}",
            _options(storage_options),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "error: backend (k8s): no Kubernetes credentials" in err
    assert list(tmp_path.iterdir()) == []  # no runs/ folder
