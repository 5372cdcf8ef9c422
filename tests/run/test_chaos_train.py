"""`composer-replication train` with ``diloco.mode = "decoupled"``: the driver runs the
synchronizer beside the replicas, the replicas train as learners, `status` shows the health and
the synchronizer, the report draws the health; with ``[chaos]`` a replica and the synchronizer
are killed mid-run and the run still finishes with every replica on the same global weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.config import load_config
from composer_replication.run.metrics import read_metrics

SMALL = [
    *TINY_RUN,
    "model.num_layers=2",
    "diloco.mode=decoupled",
    "diloco.fragments=2",
    "diloco.lease_ttl_s=3",
]

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def test_decoupled_train_with_a_killed_replica_and_synchronizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "dd"
    chaos = tmp_path / "chaos.toml"
    chaos.write_text(
        "[backend]\noptions = {max_restarts = 2}\n\n"
        "[[chaos.events]]\nat_s = 1.0\naction = 'kill'\ntarget = '1'\n\n"
        "[[chaos.events]]\nat_s = 3.0\naction = 'kill_synchronizer'\nrestart_after_s = 1.0\n"
    )  # early enough that a fast machine is still training (it once finished before 8 s)
    config = load_config(chaos, [*SMALL, "train.max_steps=120", "diloco.sync_every_h=4"])
    assert config.diloco.mode == "decoupled" and len(config.chaos.events) == 2
    code = main(
        [
            "train",
            str(chaos),
            *SMALL,
            "train.max_steps=120",
            "diloco.sync_every_h=4",
            "--name",
            "dd",
        ]
    )
    out = capsys.readouterr().out
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((run / "logs").glob("*.log")))
    assert code == 0, out + logs
    assert "Run dd: finished" in out
    report = json.loads((run / "chaos.json").read_text())
    actions = {e["action"]: e["outcome"] for e in report["events"]}
    assert actions == {"kill": "killed", "kill_synchronizer": "killed"}, report["events"]
    assert report["ok"] and report["check"]["finished"] and report["check"]["rounds_lost"] == 0
    assert report["check"]["applied_twice"] == 0
    driver = json.loads((run / "driver.json").read_text())
    assert [r["restarts"] for r in driver["replicas"]] == [0, 1]
    # both replicas end on the same global weights (the final versions of every fragment)
    records = read_metrics(run / "metrics.jsonl")
    digests = {r["replica"]: r["sha256"] for r in records if r.get("event") == "global_weights"}
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1
    health = [r for r in records if r["kind"] == "health"]
    assert health and {r["health/state"] for r in health} <= {
        "starting",
        "healthy",
        "degraded",
        "critical",
    }
    assert "synchronizer.log" in {p.name for p in (run / "logs").iterdir()}
    assert "health.png" in {p.name for p in (run / "plots").glob("*.png")}

    assert main(["status", "--json", str(run)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["health"]["synchronizer"]["merges"] >= 1
    assert main(["status", str(run)]) == 0
    text = capsys.readouterr().out
    assert "health: " in text and "synchronizer " in text


@pytest.mark.server
def test_decoupled_train_through_s3_with_a_throttled_store_and_a_stopped_replica(
    seaweedfs_server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,  # noqa: ANN001
) -> None:
    import uuid

    _, bucket, options = seaweedfs_server
    monkeypatch.chdir(tmp_path)
    inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    args = [
        *SMALL,
        "train.max_steps=60",
        "diloco.sync_every_h=4",
        "logging.tensorboard=false",
        f"store.uri=s3://{bucket}/{uuid.uuid4().hex}/",
        f"store.storage_options={{{inner}}}",
        "chaos.events=[{action='throttle', at_s=2.0, duration_s=4.0, rate_bytes_s=50000.0},"
        " {action='stop', target='0', at_s=3.0, duration_s=3.0}]",
        "--name",
        "dds3",
    ]
    code = main(["train", *args])
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "dds3"
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((run / "logs").glob("*.log")))
    assert code == 0, out + logs
    report = json.loads((run / "chaos.json").read_text())
    outcomes = [(e["action"], e["outcome"]) for e in report["events"]]
    assert ("throttle", "throttled") in outcomes and ("throttle", "full speed") in outcomes
    assert ("stop", "stopped") in outcomes and ("stop", "continued") in outcomes
    assert report["ok"] and report["check"]["same_final"], report
    records = read_metrics(run / "metrics.jsonl")
    digests = {r["replica"]: r["sha256"] for r in records if r.get("event") == "global_weights"}
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1
