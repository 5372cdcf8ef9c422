"""`status` tells a dead run from a live one (issue 22, item 2): a real run whose driver and
replicas are all killed with SIGKILL reads `stopped (driver gone since ...)` with what `--resume`
would do, not `running`; a driver on another host is judged by the replicas' heartbeats and the
age of driver.json."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.exchange.liveness import REPLICA_ROLE, write_heartbeat
from composer_replication.exchange.store import ObjectStore
from composer_replication.run.folder import RunFolder
from composer_replication.run.processes import pid_alive
from composer_replication.run.status import run_status, status_text

ARGS = [
    *TINY_RUN,
    "logging.tensorboard=false",
    "logging.report=false",
    "train.max_steps=60",
    "diloco.sync_every_h=3",
]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _resume_saved(run: Path, rank: int) -> list[int]:
    folder = run / "store" / "resume" / f"rank-{rank}"
    if not folder.is_dir():
        return []
    return [int(n.split(".")[0]) for n in os.listdir(folder) if re.fullmatch(r"\d{10}\.json", n)]


@pytest.mark.long
@pytest.mark.slow
def test_status_after_kill_9_of_the_driver_and_every_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "dead"
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_replication", "train", *ARGS, "--name", "dead"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 300
        # the event: both replicas saved their exact state of a round >= 1
        while not all(any(r >= 1 for r in _resume_saved(run, rank)) for rank in (0, 1)):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "timed out waiting for round 1's resume states"
            time.sleep(0.05)
        assert main(["status", str(run)]) == 0
        alive = capsys.readouterr().out
        assert alive.startswith("run dead: running "), alive
        replicas = _children(proc.pid)
        assert len(replicas) == 2
        proc.send_signal(signal.SIGKILL)
        for pid in replicas:
            os.killpg(pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        while any(pid_alive(pid) for pid in replicas):  # SIGKILL is delivered, not yet done
            assert time.monotonic() < deadline + 60, "the killed replicas did not exit"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    driver = json.loads((run / "driver.json").read_text())
    assert driver["status"] == "running"  # what the killed driver left behind
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("run dead: stopped (driver gone since "), out
    assert f"pid {driver['pid']} on {socket.gethostname()} no longer exists" in first
    resumable = min(max(_resume_saved(run, rank)) for rank in (0, 1))
    match = re.search(
        rf"`composer-replication train --resume {run}` would resume at outer "
        r"round (\d+) \(the newest round every replica saved its exact state for\)",
        out,
    )
    assert match is not None, out
    assert 1 <= int(match.group(1)) <= resumable
    assert "still running without a driver" not in out  # the replicas are gone too
    assert main(["status", str(run), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["status"] == "stopped" and info["driver_gone"]["pid"] == driver["pid"]
    assert info["resume"]["still_running"] == []


def _driver_elsewhere(tmp_path: Path, updated_ago: float) -> tuple[RunFolder, ObjectStore]:
    folder = RunFolder.at(tmp_path / "runs" / "remote")
    folder.create()
    store = ObjectStore(str(folder.store))
    config = {
        "backend": {"n_replicas": 2, "kind": "k8s"},
        "store": {"uri": store.uri, "storage_options": {}},
        "diloco": {"mode": "decoupled"},
    }
    folder.config_json.write_text(json.dumps(config))
    now = time.time()
    folder.update_driver(
        status="running",
        pid=4242,
        host="another-host.example",
        started=now - 3600,
        updated=now - updated_ago,
    )
    return folder, store


def test_a_driver_on_another_host_is_judged_by_heartbeats_and_driver_json(tmp_path: Path) -> None:
    folder, store = _driver_elsewhere(tmp_path, updated_ago=600)
    info = run_status(folder)
    assert info["status"] == "stopped", info
    assert "no heartbeat within" in info["driver_gone"]["how"]
    text = status_text(info)
    assert text.startswith("run remote: stopped (driver gone since ")
    assert (
        "would relaunch each learner from its state at its last push (learner 0 from the "
        "newest globals, learner 1 from the newest globals)" in text
    )
    # a learner still beats (a remote pod outlives its driver): something runs
    write_heartbeat(store, "learner", 0)
    assert run_status(folder)["status"] == "running"
    # and a driver that updated its folder a moment ago is running, heartbeats or not
    fresh, _ = _driver_elsewhere(tmp_path / "b", updated_ago=1)
    assert run_status(fresh)["status"] == "running"


def test_a_live_driver_of_this_host_reads_running(tmp_path: Path) -> None:
    folder, store = _driver_elsewhere(tmp_path, updated_ago=600)
    folder.update_driver(pid=os.getpid(), host=socket.gethostname())
    assert run_status(folder)["status"] == "running"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    folder.update_driver(pid=sleeper.pid)
    assert run_status(folder)["status"] == "running"
    sleeper.kill()
    sleeper.wait()
    write_heartbeat(store, REPLICA_ROLE, 0)  # a heartbeat of this host's pid: irrelevant here
    info = run_status(folder)
    assert info["status"] == "stopped"
    assert (
        info["driver_gone"]["how"] == f"pid {sleeper.pid} on {socket.gethostname()} no "
        "longer exists"
    )


def _chunk_steps(run: Path, rank: int) -> set[int]:
    """The train steps replica `rank` has uploaded to the store so far."""
    folder = run / "store" / "replicas" / str(rank) / "metrics"
    steps: set[int] = set()
    for path in folder.glob("*.jsonl") if folder.is_dir() else []:
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("kind") == "train":
                steps.add(int(record["step"]))
    return steps


@pytest.mark.long
@pytest.mark.slow
def test_redone_steps_after_kill_9_and_resume_are_marked_in_metrics_jsonl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Issue 22 item 8: the raw metrics.jsonl (as pandas reads it) has one unsuperseded row per
    (replica, step) after a driver crash and `--resume`; each first copy of a redone step says
    `"superseded": true` and each replica has a `resume` event."""
    pd = pytest.importorskip("pandas")
    monkeypatch.chdir(tmp_path)
    steps, h = 18, 3
    # every round waits for both replicas (the default quorum, n - 1, lets one run a round
    # ahead), so that both are mid-round when the driver dies and both redo steps
    args = [*ARGS, f"train.max_steps={steps}", f"diloco.sync_every_h={h}", "diloco.min_replicas=2"]
    run = tmp_path / "runs" / "redo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_replication", "train", *args, "--name", "redo"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )

    def mid_round() -> bool:
        # both replicas saved round k's state and uploaded a step of the next round (k = the
        # newest round both saved: the one --resume rolls back to)
        k = min(max(_resume_saved(run, rank), default=0) for rank in (0, 1))
        return k >= 1 and all(max(_chunk_steps(run, rank), default=0) > k * h for rank in (0, 1))

    def signal_all(replicas: list[int], sig: signal.Signals) -> None:
        os.kill(proc.pid, sig)
        for pid in replicas:  # each replica leads its own process group
            os.killpg(pid, sig)

    try:
        deadline = time.monotonic() + 300
        while True:
            while not mid_round():
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline, "timed out waiting for a step after round 1"
                time.sleep(0.02)
            # freeze the driver and every replica, then look again: a loaded machine can let
            # the replicas finish that round (and save the next) between the look and the kill,
            # leaving no step to redo
            replicas = _children(proc.pid)
            signal_all(replicas, signal.SIGSTOP)
            if mid_round():
                break
            signal_all(replicas, signal.SIGCONT)
        signal_all(replicas, signal.SIGKILL)
        proc.communicate(timeout=30)
        while any(pid_alive(pid) for pid in replicas):
            assert time.monotonic() < deadline + 60, "the killed replicas did not exit"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert main(["train", "--resume", "redo"]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    resumed = int(re.search(r"Resuming at outer round (\d+)", out).group(1))  # type: ignore[union-attr]
    assert resumed >= 1

    df = pd.read_json(run / "metrics.jsonl", lines=True)
    events = df[(df["kind"] == "event") & (df["event"] == "resume")]
    assert sorted(events["replica"]) == [0, 1]
    assert set(events["redo_after_step"]) == {resumed * h}
    train = df[df["kind"] == "train"]
    kept = train[train["superseded"] != True]  # noqa: E712 - the column is True or NaN
    for rank in (0, 1):
        mine = kept[kept["replica"] == rank]["step"]
        assert sorted(mine) == list(range(1, steps + 1)), rank  # one row per step
    dropped = train[train["superseded"] == True]  # noqa: E712
    assert len(dropped) >= 2 and (dropped["step"] > resumed * h).all()
    assert int(events["superseded_records"].sum()) >= len(dropped)
