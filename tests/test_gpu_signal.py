"""benchmarks/gpu_signal.py, scripts/gpu-check.sh's ``signal`` phase: the RL run's model is the
10-30M-parameter one the issue asks for, the figures are read from what `train` logged (last
held-out evaluation, the teacher advantage over the steps that measured it, the device the run
used), a run past --timeout-s is stopped and reported as unfinished, and a real tiny run of both
`train`s on the CPU writes every key."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_signal.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_signal  # noqa: E402


def test_the_rl_model_has_10_to_30m_parameters() -> None:
    pytest.importorskip("transformers")
    n = gpu_signal.param_count(gpu_signal.RL_MODEL)
    assert 10_000_000 <= n <= 30_000_000, n
    overrides = gpu_signal.rl_overrides(gpu_signal.RL_MODEL, 1200, 1e-3)
    assert "model.hidden_size=384" in overrides and "backend.n_replicas=1" in overrides
    assert "train.max_steps=1200" in overrides and "train.learning_rate=0.001" in overrides


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_figures_are_what_the_run_logged(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    records = [
        {"kind": "event", "event": "device", "replica": 0, "time": 1.0, "device": "cuda:0",
         "device_name": "NVIDIA H200"},
        {"kind": "eval", "replica": 0, "step": 0, "eval/accuracy": 0.0, "eval/n": 256},
    ]  # fmt: skip
    for step in range(1, 21):
        adv = float("nan") if step % 5 == 0 else (0.5 if step <= 2 else -0.1)
        records.append(
            {
                "kind": "train",
                "replica": 0,
                "step": step,
                "reward": 0.1 * step,
                "sdpo/teacher_advantage": adv,
                "sdpo/gate_open": 1.0 if adv > 0 else 0.0,
            }
        )
    records.append({"kind": "eval", "replica": 0, "step": 20, "eval/accuracy": 0.75, "eval/n": 256})
    records.append({"kind": "eval", "replica": 0, "step": 10, "eval/accuracy": 0.5, "eval/n": 256})
    _write(metrics, records)
    f = gpu_signal.run_figures(metrics)
    assert f["heldout_accuracy"] == 0.75 and f["heldout_accuracy_first"] == 0.0  # by step
    assert f["heldout_n"] == 256 and f["steps"] == 20
    # 16 finite values (4 steps logged NaN: nothing probed): 2 x 0.5 and 14 x -0.1
    assert f["teacher_advantage"] == pytest.approx((2 * 0.5 - 14 * 0.1) / 16)
    assert f["teacher_advantage_first10"] == pytest.approx(0.5)  # steps 1-2
    assert f["gate_open"] == pytest.approx(0.1)  # open at steps 1-2 only: 2 / 20
    assert (f["device"], f["device_name"]) == ("cuda:0", "NVIDIA H200")
    empty = gpu_signal.run_figures(tmp_path / "absent.jsonl")
    assert empty["heldout_accuracy"] is None and empty["teacher_advantage"] is None
    assert empty["steps"] == 0 and empty["device"] is None
    assert gpu_signal.finite_mean([float("nan"), None, "x"]) is None
    assert math.isclose(gpu_signal.finite_mean([1, 2.0, float("inf")]) or 0, 1.5)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_device_cuda_without_a_gpu_fails_clearly() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU (scripts/gpu-check.sh runs --device cuda)")
    done = _run(["--device", "cuda", "--quick"], 120)
    assert done.returncode != 0 and "--device cuda" in done.stderr and "no CUDA" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)  # two `train` runs at once (three processes) on a loaded CPU
def test_a_tiny_run_on_the_cpu_writes_every_key(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    out = tmp_path / "signal.json"
    done = _run(["--device", "cpu", "--quick", "--out", str(out)], 880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == last
    for run in ("default", "rl"):
        assert last[f"signal_{run}_finished"] is True
        assert last[f"signal_{run}_device"] == "cpu" and last[f"signal_{run}_steps"] == 4
        assert 0.0 <= last[f"signal_{run}_heldout_accuracy"] <= 1.0
        assert last[f"signal_{run}_heldout_n"] == 16
    assert isinstance(last["signal_rl_teacher_advantage"], float)
    assert last["signal_rl_params"] == gpu_signal.param_count(gpu_signal.QUICK_RL_MODEL)
    assert last["signal_default_params"] == gpu_signal.param_count({})
    assert last["signal_rl_params"] != last["signal_default_params"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_past_its_time_is_stopped_and_reported_unfinished(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    out = tmp_path / "signal.json"
    done = _run(["--device", "cpu", "--quick", "--timeout-s", "3", "--out", str(out)], 280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = json.loads(out.read_text())
    assert last["signal_default_finished"] is False and last["signal_rl_finished"] is False
    assert "stopped after --timeout-s 3" in done.stdout
