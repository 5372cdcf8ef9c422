"""Losing a replica for good: kill -9 one of 2 replicas with no restarts left. With
diloco.min_replicas=1 the driver declares it departed at once, the survivor stops waiting for it
(its rounds take a poll interval, not diloco.timeout_s) and the run ends "finished, 1 replica
lost" with exit 0 (the default quorum, max(1, n - 1), tolerates it too); with every replica
required (diloco.min_replicas=2) the run stops with exit 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

SMALL = [
    *TINY_RUN,
    "logging.tensorboard=false",
    "train.max_steps=24",
    "diloco.sync_every_h=4",
    "backend.max_restarts=0",
    "diloco.timeout_s=60",
]
KILL = "chaos.events=[{action='kill', target='1', at_s=0.3}]"


def _run(tmp_path: Path, name: str, extra: list[str], capsys: pytest.CaptureFixture) -> tuple:
    code = main(["train", *SMALL, *extra, "--name", name])
    out = capsys.readouterr().out
    run = tmp_path / "runs" / name
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((run / "logs").glob("*.log")))
    return code, out, run, logs


def test_a_lost_replica_is_not_waited_for_and_the_run_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, run, logs = _run(tmp_path, "lost", ["diloco.min_replicas=1", KILL], capsys)
    assert code == 0, out + logs
    assert "replica 1 is lost (killed by signal SIGKILL)" in out
    assert "Run lost: finished, 1 replica lost after" in out
    driver = json.loads((run / "driver.json").read_text())
    assert driver["status"] == "finished" and driver["lost"] == [1]
    assert [r["status"] for r in driver["replicas"]] == ["succeeded", "failed"]
    records = read_metrics(run / "metrics.jsonl")
    rounds = {r["round"]: r for r in records if r["kind"] == "round" and r["replica"] == 0}
    assert sorted(rounds) == [1, 2, 3, 4, 5, 6]  # the survivor trained every round
    alone = [r for r in rounds.values() if r["round/included"] == 1]
    assert alone, rounds  # rounds merged without rank 1
    # no round waited for the dead rank: at most the departure poll (1 s) plus scheduling
    # noise, against diloco.timeout_s = 60 s per round before
    waits = [r["round/wait_s"] for r in rounds.values()]
    assert max(waits) < 10.0, waits
    finals = [r for r in records if r.get("event") == "global_weights"]
    assert [r["replica"] for r in finals] == [0]
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()
    assert main(["status", str(run)]) == 0
    assert "run lost: finished, 1 replica lost   outer round 6" in capsys.readouterr().out


def test_with_every_replica_required_a_lost_replica_fails_the_run(tmp_path: Path) -> None:
    # chaos refuses a kill nobody survives (config check), so the test kills the replica itself
    args = [*SMALL, "train.max_steps=400", "diloco.min_replicas=2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_replication", "train", *args, "--name", "strict"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    heartbeat = tmp_path / "runs" / "strict" / "store" / "health" / "replica" / "1.json"
    try:
        deadline = time.monotonic() + 180
        while not heartbeat.is_file() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert heartbeat.is_file(), "rank 1 never sent a heartbeat"
        os.kill(json.loads(heartbeat.read_text())["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out
    assert "Run strict: failed, 1 replica lost" in out
    driver = json.loads((tmp_path / "runs" / "strict" / "driver.json").read_text())
    assert driver["status"] == "failed" and driver["lost"] == [1]


def test_a_silent_replica_is_not_waited_for_and_is_taken_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """SIGSTOP rank 1 for 40 s: its process is alive, but its heartbeats stop; after
    SILENT_AFTER_S the driver declares it departed and the survivor stops waiting; once it
    runs again it catches up and the run finishes with both replicas."""
    from composer_replication.run import supervision

    monkeypatch.setattr(supervision, "SILENT_AFTER_S", 10.0)
    monkeypatch.chdir(tmp_path)
    stop = "chaos.events=[{action='stop', target='1', at_s=0.3, duration_s=40}]"
    code, out, run, logs = _run(tmp_path, "silent", ["diloco.min_replicas=1", stop], capsys)
    assert code == 0, out + logs
    assert "replica 1 sent no heartbeat for" in out, out
    # back, it finished too: its own departure ("finished training") replaced the driver's
    # (the driver may have withdrawn the silent one before: "sends heartbeats again")
    departed = json.loads((run / "store" / "departed" / "replica" / "1.json").read_text())
    assert departed["reason"] == "finished training"
    assert "Run silent: finished after" in out  # nothing lost
    records = read_metrics(run / "metrics.jsonl")
    waits = [r["round/wait_s"] for r in records if r["kind"] == "round" and r["replica"] == 0]
    assert len(waits) == 6 and max(waits) < 25.0, waits  # not the 40 s stop, nor timeout_s
    # it healed onto the run's last round and stopped there: no round past the end, and both
    # replicas ended on the same global weights
    assert max(r["round"] for r in records if r["kind"] == "round") == 6
    digests = {r["replica"]: r["sha256"] for r in records if r.get("event") == "global_weights"}
    assert sorted(digests) == [0, 1] and len(set(digests.values())) == 1


def test_a_restarting_replica_is_not_waited_for_and_rejoins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """With restarts (the default) and min_replicas=1: while rank 1 is being relaunched the
    survivor commits without it at once; the new incarnation takes its departure back when it
    is ready and the next rounds include it again."""
    monkeypatch.chdir(tmp_path)
    extra = ["diloco.min_replicas=1", "backend.max_restarts=2", "train.max_steps=400", KILL]
    code, out, run, logs = _run(tmp_path, "rejoin", extra, capsys)
    assert code == 0, out + logs
    assert "restarted (1 of 2)" in out and "Run rejoin: finished after" in out
    assert "lost" not in out.split("Run rejoin:")[1].splitlines()[0]
    records = read_metrics(run / "metrics.jsonl")
    rounds = sorted((r["round"], r) for r in records if r["kind"] == "round" and r["replica"] == 0)
    included = [r["round/included"] for _, r in rounds]
    assert 1 in included, included  # rounds without rank 1 while it restarted...
    assert included[-1] == 2, included  # ...and with it again once it rejoined
    assert max(r["round/wait_s"] for _, r in rounds) < 10.0
    starts = [r for r in records if r.get("event") == "start" and r["replica"] == 1]
    assert len(starts) == 2 and starts[1]["resumed_round"] > 0  # rejoined from the store
