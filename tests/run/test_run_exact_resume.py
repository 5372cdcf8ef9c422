"""Exact resume end to end: a run whose driver and replicas are all killed with SIGKILL mid-round
(and whose newest global state is then damaged) and resumed with `--resume` ends on
bit-identical final weights to the same run uninterrupted.

CPU, one torch thread per replica (the default `train.torch_threads = 1`): every kernel is
deterministic, the DiLoCo merge is in rank order in float32, so equality is exact (no
tolerance). A linear LR schedule and TAID's schedule make the step count and the scheduler
state matter; the tiny data islands (16 prompts per replica, 2 per step) make the resumed
round start mid-epoch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _run_small import TINY_RUN
from safetensors.torch import load_file

from composer_replication.cli import main
from composer_replication.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

STEPS, H = 24, 3  # 8 rounds: a fast machine must not finish before the kill after round 2
ARGS = [
    *TINY_RUN,
    "train.lr_scheduler=linear",
    "loss.sdpo_wrapper=taid",
    f"loss.taid_total_steps={STEPS}",
    "logging.tensorboard=false",
    f"train.max_steps={STEPS}",
    f"diloco.sync_every_h={H}",
]


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (the driver's replicas; each leads its own group)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _global_rounds(run: Path) -> list[int]:
    states = run / "store" / "states" / "global"
    if not states.is_dir():
        return []
    return [int(n.split(".")[0]) for n in os.listdir(states) if n.endswith(".safetensors")]


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / "final" / "model.safetensors"))


def _digests(run: Path) -> set[str]:
    return {
        r["sha256"]
        for r in read_metrics(run / "metrics.jsonl")
        if r.get("event") == "global_weights"
    }


def test_sigkill_everything_mid_round_then_resume_gives_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *ARGS, "--name", "straight"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    straight = tmp_path / "runs" / "straight"

    run = tmp_path / "runs" / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_replication", "train", *ARGS, "--name", "killed"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 240
        while max(_global_rounds(run), default=-1) < 2:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "timed out waiting for round 2"
            time.sleep(0.05)
        time.sleep(0.05)  # into round 3's inner steps
        replicas = _children(proc.pid)
        assert len(replicas) == 2
        proc.send_signal(signal.SIGKILL)
        for pid in replicas:
            os.killpg(pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(_global_rounds(run))
    assert killed_at < STEPS // H, "the run finished before it was killed"
    assert not (run / "checkpoints" / "final").exists()
    # and the newest global state was damaged (truncated): --resume must skip it
    newest = run / "store" / "states" / "global" / f"{killed_at:010d}.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])

    assert main(["train", "--resume", "killed"]) == 0
    out, err = capsys.readouterr()
    assert "Run killed: finished" in out
    assert f"global state of round {killed_at} is unusable" in err
    records = read_metrics(run / "metrics.jsonl")
    starts = [r for r in records if r.get("event") == "start" and r["resumed_round"] > 0]
    # both replicas restarted from their own exact state of a round >= 1, not from scratch
    assert sorted(r["replica"] for r in starts) == [0, 1], out
    assert all(r["exact"] for r in starts)
    resumed_round = starts[0]["resumed_round"]
    assert 1 <= resumed_round < killed_at and f"Resuming at outer round {resumed_round}" in out

    expected = _final_weights(straight)
    got = _final_weights(run)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert _digests(run) == _digests(straight) and len(_digests(run)) == 1

    # each (replica, step) once: the redone steps replaced the discarded ones
    train = [r for r in records if r["kind"] == "train"]
    for rank in (0, 1):
        steps = [r["step"] for r in train if r["replica"] == rank]
        assert sorted(steps) == list(range(1, STEPS + 1))
    rounds = [(r["replica"], r["round"]) for r in records if r["kind"] == "round"]
    assert sorted(rounds) == [(k, j) for k in (0, 1) for j in range(1, STEPS // H + 1)]
