"""Records that heal after a kill: a metrics.jsonl cut inside its last record is cut back to
the last whole record at the next launch (with a warning) and the record is read again from
its chunk, so `pd.read_json(path, lines=True)` reads the file and no record is lost; a damaged
driver.json is named by `status`, which shows its backup (driver.json is written atomically,
then its backup), and the attempts' wall times survive."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from composer_replication.exchange.store import ObjectStore
from composer_replication.run.folder import RunFolder
from composer_replication.run.metrics import (
    MetricsCollector,
    MetricsSink,
    ReplicaMetricsWriter,
    mark_resume,
)
from composer_replication.run.report import closed_attempts, run_wall_seconds
from composer_replication.run.status import run_status, status_text


def _folder(tmp_path: Path) -> tuple[RunFolder, ObjectStore]:
    folder = RunFolder.at(tmp_path / "runs" / "demo")
    folder.create()
    store = ObjectStore(str(folder.store))
    config = {
        "backend": {"n_replicas": 2, "kind": "local"},
        "store": {"uri": store.uri, "storage_options": {}},
    }
    folder.config_json.write_text(json.dumps(config))
    return folder, store


def _chunks(store: ObjectStore) -> list[dict[str, object]]:
    """Two replicas' records, three chunks each; returns them as written."""
    written: list[dict[str, object]] = []
    for rank in range(2):
        writer = ReplicaMetricsWriter(store, rank, flush_every_s=1e9)
        for step in range(1, 10):
            writer.log("train", step=step, round=step // 3, reward=step / 10 + rank)
            if step % 3 == 0:
                writer.flush()
    for rank in range(2):
        for name in sorted(store.list(f"replicas/{rank}/metrics")):
            data = store.get(f"replicas/{rank}/metrics/{name}")
            assert data is not None
            written += [json.loads(line) for line in bytes(data).decode().splitlines()]
    return written


def test_a_metrics_file_cut_inside_its_last_record_heals_at_the_next_launch(
    tmp_path: Path,
) -> None:
    folder, store = _folder(tmp_path)
    written = _chunks(store)
    collector = MetricsCollector(store, 2, MetricsSink(folder.metrics, None), None)
    collector.poll()
    # The driver was killed while appending rank 1's last chunk: its count was not saved, and
    # the file ends inside that chunk's last record.
    saved = {0: collector.consumed[0], 1: collector.consumed[1] - 1}
    whole = folder.metrics.read_bytes()
    folder.metrics.write_bytes(whole[:-25])
    sink = MetricsSink(folder.metrics, None)  # the next launch (`--resume`)
    assert sink.healed is not None and "cut back to the last whole record" in sink.healed
    MetricsCollector(store, 2, sink, saved).poll()
    assert folder.metrics.read_bytes() == whole  # every record once, the cut one restored
    frame = pd.read_json(folder.metrics, lines=True)  # the docs' recipe reads it
    assert len(frame) == len(written)


def test_a_torn_line_an_older_release_left_mid_file_goes_at_the_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "replica": 0, "step": s, "round": 0} for s in (1, 2)]
    path.write_text(json.dumps(rows[0]) + "\n" + '{"kind": "tr\n' + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError):
        pd.read_json(path, lines=True)  # what such a file did to the docs' recipe
    mark_resume(path, MetricsSink(path, None), resumed_round=0, redo_after_step=0, n_replicas=1)
    frame = pd.read_json(path, lines=True)
    assert list(frame["step"][:2]) == [1, 2] and len(frame) == 3  # two records, one event


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"kind": "train", "replica": 0, "step": 1}))
    sink = MetricsSink(path, None)
    assert sink.healed is None
    sink.write([{"kind": "train", "replica": 0, "step": 2}])
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_damaged_driver_json_is_named_and_its_backup_keeps_the_wall_times(
    tmp_path: Path,
) -> None:
    folder, _ = _folder(tmp_path)
    attempts = [{"attempt": 1, "started": 100.0, "ended": 160.0, "seconds": 60.0}]
    folder.write_driver({"status": "running", "attempt": 2, "attempts": attempts, "started": 200.0})
    folder.update_driver(updated=230.0)  # the killed attempt's last update
    text = folder.driver_json.read_text()
    folder.driver_json.write_text(text[: len(text) // 2])  # cut (a crash without fsync)
    info = run_status(folder)
    assert info["driver_damage"] is not None and "driver.json is damaged" in info["driver_damage"]
    assert "shown from driver.json.bak" in info["driver_damage"]
    assert info["status"] != "unknown"
    assert "driver.json is damaged" in status_text(info)
    driver = folder.read_driver()
    assert [a["seconds"] for a in closed_attempts(driver)] == [60.0, 30.0]
    assert run_wall_seconds(driver) == 90.0
    # the next launch keeps the attempts: it reads the backup and writes both files again
    folder.update_driver(status="running", attempts=closed_attempts(driver))
    assert folder.driver_damage() is None
    assert len(json.loads(folder.driver_json.read_text())["attempts"]) == 2
    # both damaged: said plainly, not "unknown" in silence
    folder.driver_json.write_text("{")
    folder.driver_backup.write_text("")
    info = run_status(folder)
    assert "no usable backup" in info["driver_damage"]
    assert "no usable backup" in status_text(info)
