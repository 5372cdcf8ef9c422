"""Observability never takes training down: a replica's metrics chunk and status writes that
fail (the store read-only or full for a while, faults injected through the store's interface)
are retried with backoff, then skipped with a warning naming the cause; the records stay
buffered and reach the store once it is back, each once. Training-state writes still fail
loudly."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
import torch

from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.faulty_store import Fault, FaultyStore
from composer_replication.exchange.store import ObjectStore
from composer_replication.run.folder import RunFolder
from composer_replication.run.metrics import ReplicaMetricsWriter, chunk_dir, status_key
from composer_replication.run.status import run_status, status_text


class DiskFull(OSError):
    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, f"No space left on device ({message})")


def _records(store: ObjectStore, rank: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for name in sorted(store.list(chunk_dir(rank))):
        raw = store.get(f"{chunk_dir(rank)}/{name}")
        assert raw is not None
        out += [json.loads(line) for line in bytes(raw).decode().splitlines()]
    return out


def test_failed_metrics_and_status_writes_are_retried_then_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    real = ObjectStore(str(tmp_path / "store"))
    faults = [  # the store is full for the first flush's three tries and the forced status
        Fault("put_if_absent", "replicas/0/metrics/*", "fail", times=3, error=DiskFull),
        Fault("put", "replicas/0/status.json", "fail", times=3, error=DiskFull),
    ]
    store = FaultyStore(real, faults)
    writer = ReplicaMetricsWriter(store, 0, flush_every_s=1e9, backoff_s=0.01)
    writer.status(state="training", step=1, force=True)  # skipped, does not raise
    writer.log("train", step=1, round=0, reward=0.5)
    with caplog.at_level(logging.WARNING):
        writer.flush()  # three tries, then skipped: does not raise
    assert "No space left on device" in caplog.text and "metrics chunk" in caplog.text
    assert _records(real, 0) == []
    assert writer.skipped == 2 and writer.last_skip is not None
    writer.log("train", step=2, round=0, reward=0.6)
    writer.flush()  # the store is back: both records, once
    assert [r["step"] for r in _records(real, 0)] == [1, 2]
    status = real.get_json(status_key(0))
    assert status["skipped_writes"] == 2 and "No space left on device" in status["last_skip"]


def test_status_shows_a_replica_whose_writes_were_skipped_as_degraded(tmp_path: Path) -> None:
    folder = RunFolder.at(tmp_path / "runs" / "demo")
    folder.create()
    folder.config_json.write_text(json.dumps({"backend": {"n_replicas": 1, "kind": "local"}}))
    real = ObjectStore(str(folder.store))
    faults = [Fault("put_if_absent", "replicas/0/metrics/*", "fail", times=1, error=DiskFull)]
    writer = ReplicaMetricsWriter(FaultyStore(real, faults), 0, flush_every_s=1e9, attempts=1)
    writer.status(state="training", step=1, round=0)
    writer.log("train", step=1, round=0, reward=0.5)
    writer.flush()  # the chunk is skipped (the store is full)
    writer.flush()  # the store is back: the chunk and the status document go out
    info = run_status(folder)
    assert info["replicas"][0]["health"] == "degraded"
    assert "writes skipped: metrics chunk" in status_text(info)
    assert "No space left on device" in status_text(info)


def test_a_lost_answer_does_not_duplicate_a_chunk(tmp_path: Path) -> None:
    real = ObjectStore(str(tmp_path / "store"))
    store = FaultyStore(real, [Fault("put_if_absent", "replicas/0/metrics/*", "fail_after")])
    writer = ReplicaMetricsWriter(store, 0, flush_every_s=1e9, backoff_s=0.0)
    writer.log("train", step=1, round=0, reward=0.5)
    writer.flush()  # written, its answer lost: the retry finds its own chunk
    writer.log("train", step=2, round=0, reward=0.6)
    writer.flush()
    assert [r["step"] for r in _records(real, 0)] == [1, 2]


def test_training_state_writes_still_fail_loudly(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    store = FaultyStore(
        ObjectStore(uri), [Fault("put_if_absent", "states/*", "fail", error=DiskFull)]
    )
    docs = ObjectStoreAllReduce(store, 1)
    with pytest.raises(OSError, match="No space left on device"):
        docs.publish_state({"w": torch.ones(2)}, round=1)
