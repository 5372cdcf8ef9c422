"""Decoupled exact resume end to end (issue 22, "decoupled kill -9 + --resume"): a decoupled
`composer-replication train` whose driver, learners and synchronizer are all killed with
SIGKILL once merges are in the store and every learner has saved its state at a push, then
`train --resume`d: each learner continues from its newest state at a push (the start event
names it; its step is that push's step), the run finishes and run/chaos.py's checks hold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_chaos_train import SMALL
from test_run_exact_resume import _children

from composer_replication.cli import main
from composer_replication.diloco.decoupled.learner_state import learner_resume
from composer_replication.exchange.push_store import DecoupledStore
from composer_replication.exchange.store import ObjectStore
from composer_replication.run.chaos import check_decoupled_run
from composer_replication.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.long]

STEPS, H, P = 64, 4, 2
ARGS = [*SMALL, f"train.max_steps={STEPS}", f"diloco.sync_every_h={H}", "logging.tensorboard=false"]


def _merges(store: ObjectStore) -> int:
    docs = DecoupledStore(store)
    return sum(len(docs.versions(p, "merge")) for p in range(P))


def _saved_steps(store: ObjectStore) -> dict[int, int]:
    found = {rank: learner_resume(store, rank, warn=lambda _: None) for rank in (0, 1)}
    return {rank: f[0] for rank, f in found.items() if f is not None}


def test_sigkill_everything_then_resume_continues_each_learner_from_its_last_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_replication", "train", *ARGS, "--name", "killed"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "timed out waiting for merges and learner states"
            if (run / "store").is_dir():
                store = ObjectStore(str(run / "store"))
                saved = _saved_steps(store)
                if _merges(store) >= 2 and len(saved) == 2 and min(saved.values()) >= H:
                    break
            time.sleep(0.1)
        children = _children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    store = ObjectStore(str(run / "store"))
    assert DecoupledStore(store).read_final(P) is None, "the run finished before the kill"
    saved = _saved_steps(store)  # what each learner must resume from (nothing writes now)
    assert set(saved) == {0, 1}
    before = len(read_metrics(run / "metrics.jsonl"))
    capsys.readouterr()
    assert main(["status", str(run)]) == 0  # says what --resume will do
    status = capsys.readouterr().out
    plan = f"learner 0 at step {saved[0]}, learner 1 at step {saved[1]}"
    assert f"relaunch each learner from its state at its last push ({plan})" in status, status

    assert main(["train", "--resume", "killed"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "Run killed: finished" in out

    records = read_metrics(run / "metrics.jsonl")
    starts = {r["replica"]: r for r in records[before:] if r.get("event") == "start"}
    assert set(starts) == {0, 1}, starts
    for rank, start in starts.items():
        step = saved[rank]
        assert start["resume_state"] == f"resume/learner-{rank}/{step:010d}.json", start
        assert start["resume_state_step"] == start["resumed_step"] == step
        assert start["exact"] is True and "resume_fallback" not in start
        assert step % (H // P) == 0  # a push step: one fragment leaves every H / P steps
    # each resumed learner's train_begin event: what binding downloaded (at most the newest
    # version of each fragment, however many were merged while it was down)
    begins = {r["replica"]: r for r in records[before:] if r.get("event") == "train_begin"}
    assert set(begins) == {0, 1}, begins
    for begin in begins.values():
        assert 0 <= begin["rejoin_objects"] <= P and begin["rejoin_bytes"] >= 0, begin
        assert begin["rejoin_merged_meanwhile"] >= 0, begin  # restored from a state
    check = check_decoupled_run(store)
    assert check["ok"], check["problems"]
    assert check["finished"] and check["rounds_lost"] == 0
    digests = {r["replica"]: r["sha256"] for r in records if r.get("event") == "global_weights"}
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1
