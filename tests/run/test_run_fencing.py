"""Fencing after a driver crash: kill -9 the driver of `composer-replication train` mid-run and
`--resume` at once. Its replicas either die with it (the default: parent-death signal) or, when
they outlive it (``backend.options={die_with_driver=false}``, as on a remote backend), are fenced
by the resumed launch's run generation and stop before writing anything. Either way each rank
has exactly one writer: after the resume no (replica, step) and no (replica, round) appears
twice, and the run finishes with its 15 rounds, not more."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

SMALL = [
    *TINY_RUN,
    "logging.tensorboard=false",
    "logging.report=false",
    "train.max_steps=60",
    "diloco.sync_every_h=4",
    "train.eval_every_rounds=100",
    "checkpoint.every_rounds=100",
]
CLI = [sys.executable, "-m", "composer_replication", "train"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _latest_state(states: Path) -> int:
    if not states.is_dir():
        return -1
    rounds = [int(n.split(".")[0]) for n in os.listdir(states) if n.endswith(".safetensors")]
    return max(rounds, default=-1)


@pytest.mark.parametrize("die_with_driver", [True, False])
def test_a_crashed_driver_is_resumed_with_one_writer_per_rank(
    tmp_path: Path, die_with_driver: bool
) -> None:
    run = tmp_path / "runs" / "crash"
    extra = [] if die_with_driver else ["backend.options={die_with_driver=false}"]
    proc = subprocess.Popen(
        [*CLI, *SMALL, *extra, "--name", "crash"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while _latest_state(run / "store" / "states" / "global") < 2:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the run never reached round 2"
            time.sleep(0.1)
        proc.kill()  # kill -9: no handler, no cancel, no atexit
    finally:
        first_output = proc.communicate()[0]
    old = {
        r: json.loads((run / "store" / "health" / "replica" / f"{r}.json").read_text())["pid"]
        for r in (0, 1)
    }

    resumed = subprocess.run(
        [*CLI, "--resume", "crash"],
        cwd=tmp_path,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=600,
    )
    out = resumed.stdout
    assert resumed.returncode == 0, first_output + out
    assert "Run crash: finished" in out
    # replicas that outlived their driver were found alive, fenced and waited for, unless they
    # had run their last steps to the end before the resume looked (the remaining 13 rounds take
    # seconds on a quiet machine and the resume's start-up longer on a loaded one: the one
    # event this test cannot order); then there was nothing to fence, and the checks below (one
    # writer per rank) are what stands
    fenced = "fenced them (run generation 2)" in out
    logs = "".join(p.read_text() for p in (run / "logs").glob("replica-*.log"))
    if die_with_driver:
        assert not fenced, out
    else:
        n_fenced = logs.count("fenced: this process belongs to launch 1")  # one per replica
        assert (n_fenced >= 1) == fenced and n_fenced <= 2, (n_fenced, out, logs[-3000:])
    assert json.loads((run / "store" / "run_generation.json").read_text())["generation"] == 2
    driver = json.loads((run / "driver.json").read_text())
    assert driver["status"] == "finished" and driver["attempt"] == 2

    # one writer per rank: everything logged since the resumed launch started comes from one
    # incarnation per rank (a second writer would log steps and rounds twice)
    after = [r for r in read_metrics(run / "metrics.jsonl") if r["time"] >= driver["started"]]
    starts = [r for r in after if r.get("event") == "start"]
    assert sorted(r["replica"] for r in starts) == [0, 1]
    for rank in (0, 1):
        steps = [r["step"] for r in after if r["kind"] == "train" and r["replica"] == rank]
        first = next(r["resumed_step"] for r in starts if r["replica"] == rank)
        assert steps == list(range(first + 1, 61)), (rank, steps)
        rounds = [r["round"] for r in after if r["kind"] == "round" and r["replica"] == rank]
        assert rounds == list(range(first // 4 + 1, 16)), (rank, rounds)
    final = json.loads((run / "checkpoints" / "final" / "state.json").read_text())
    assert final["round"] == 15 and final["step"] == 60
    assert not any(_alive(pid) for pid in old.values())


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_resume_refuses_while_a_replica_it_cannot_fence_is_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A replica of the run that keeps sending heartbeats after the resumed launch fenced it
    (an old version, a process that ignores the store's generation) stops the resume (exit 2,
    naming it) before anything is launched."""
    from composer_replication.cli import main
    from composer_replication.config import load_config, to_dict
    from composer_replication.run import driver, supervision

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(supervision, "FENCE_WAIT_S", 2.0)
    config, folder = driver.prepare(load_config(None, SMALL), name="busy")
    folder.create()
    folder.config_json.write_text(json.dumps(to_dict(config)))
    store = str(tmp_path / "runs" / "busy" / "store")
    beater = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\n"
                "from composer_replication.exchange.store import ObjectStore\n"
                "from composer_replication.exchange.liveness import write_heartbeat\n"
                "s = ObjectStore(sys.argv[1])\n"
                "while True:\n"
                "    write_heartbeat(s, 'replica', 1)\n"
                "    time.sleep(0.2)\n"
            ),
            store,
        ],
        env=ENV,
    )
    try:
        heartbeat = Path(store) / "health" / "replica" / "1.json"
        deadline = time.monotonic() + 30
        while not heartbeat.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        assert main(["train", "--resume", "busy"]) == 2
        assert time.monotonic() - t0 < 30
    finally:
        beater.kill()
        beater.wait()
    err = capsys.readouterr().err
    assert "still alive after being fenced" in err and f"pid {beater.pid}" in err, err
    assert not list((tmp_path / "runs" / "busy" / "logs").glob("replica-*.log"))  # none launched
