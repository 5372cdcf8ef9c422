"""Losing a replica the way the README promises: kill -9 one of 2 replicas mid-run; the driver
relaunches it on the same rank, it rejoins from the store, the run finishes with exit 0 and says
how many restarts it took. Every replica is required here (diloco.min_replicas=2), so the round
it missed waits for it and both end on the same weights; with the default quorum (all but one)
the survivor goes on without it (test_run_replica_lost.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

SMALL = [
    *TINY_RUN,
    "logging.tensorboard=false",
    "train.max_steps=32",
    "diloco.sync_every_h=4",
    "diloco.min_replicas=2",
]
LAST_ROUND = 32 // 4


def _run(tmp_path: Path, name: str, extra: list[str], capsys: pytest.CaptureFixture) -> tuple:
    code = main(
        [
            "train",
            *SMALL,
            *extra,
            "chaos.events=[{action='kill', target='1', at_s=0.3}]",
            "--name",
            name,
        ]
    )
    out = capsys.readouterr().out
    run = tmp_path / "runs" / name
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((run / "logs").glob("*.log")))
    return code, out, run, logs


def test_a_killed_replica_is_restarted_and_the_run_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, run, logs = _run(tmp_path, "restart", [], capsys)
    assert code == 0, out + logs
    chaos = json.loads((run / "chaos.json").read_text())
    # killed while it trains (not after it finished: a fast machine trains 32 tiny steps quickly)
    assert [e["outcome"] for e in chaos["events"]] == ["killed"], chaos
    assert "replica 1 failed" in out and "restarted (1 of 2)" in out
    assert "Run restart: finished" in out and "1 replica restart)" in out
    driver = json.loads((run / "driver.json").read_text())
    assert driver["status"] == "finished"
    assert [(r["status"], r["restarts"]) for r in driver["replicas"]] == [
        ("succeeded", 0),
        ("succeeded", 1),
    ]
    records = read_metrics(run / "metrics.jsonl")
    starts = [r for r in records if r["kind"] == "event" and r.get("event") == "start"]
    assert sorted(r["replica"] for r in starts) == [0, 1, 1]  # rank 1 started twice
    digests = {
        r["replica"]: r["sha256"]
        for r in records
        if r["kind"] == "event" and r.get("event") == "global_weights"
    }
    assert sorted(digests) == [0, 1] and len(set(digests.values())) == 1
    rounds = {(r["replica"], r["round"]) for r in records if r["kind"] == "round"}
    assert {(0, LAST_ROUND), (1, LAST_ROUND)} <= rounds  # both replicas reached the last round


def test_the_local_executors_own_restart_is_counted_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, run, logs = _run(
        tmp_path,
        "norestart",
        ["backend.max_restarts=0", "backend.options={max_restarts=1}", "diloco.timeout_s=60"],
        capsys,
    )
    # the local executor's own restart (options.max_restarts) still brings it back, counted too
    assert code == 0, out + logs
    driver = json.loads((run / "driver.json").read_text())
    assert [r["restarts"] for r in driver["replicas"]] == [0, 1]
    assert "relaunching" not in out and "restarted (" not in out  # not the driver's doing
