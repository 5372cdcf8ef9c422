"""scripts/gpu-check.sh, the one script for a GPU machine: its shell parses, it refuses unknown
phases, its key collection (scripts/gpu_check_keys.py) finds every key the GPU issue names and
reports what is missing or failed, and its --dry-run runs every phase end to end on a CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check_keys as keys  # noqa: E402


def test_the_script_parses_and_refuses_unknown_phases(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(SCRIPT)], check=True)
    env = {**os.environ, "OUT": str(tmp_path), "PHASES": "tests benchmark"}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "unknown phase 'benchmark'" in done.stderr
    done = subprocess.run(["bash", str(SCRIPT), "--now"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="{failures}" skipped="1" tests="3"><testcase classname="tests.trainer.test_x" name="a"/>
<testcase classname="tests.trainer.test_x" name="b">{failure}</testcase>
<testcase classname="tests.trainer.test_x" name="c"><skipped type="pytest.skip"
message="needs a CUDA device: run ..."/></testcase></testsuite></testsuites>"""


def _phase(out: Path, name: str, rc: int, log: str = "", saved: dict | None = None) -> None:
    (out / f"{name}.rc").write_text(f"{rc}\n")
    (out / f"{name}.log").write_text(log)
    if saved is not None:
        (out / f"{name}.json").write_text(json.dumps(saved))


def test_keys_are_collected_from_logs_and_saved_json(tmp_path):
    out = tmp_path
    _phase(out, "gpu", 0)
    (out / "junit-gpu.xml").write_text(JUNIT.format(failures=0, failure=""))
    loss = {"gpu_jsd_peak_ratio": 0.006, "gpu_jsd_time_ratio": 1.7, "gpu_replay_peak_ratio": 0.03}
    _phase(out, "loss", 0, "chunked: 12 ms\n" + json.dumps(loss) + "\ntrailing words\n")
    # the step phase was cut by its time limit: its --out file has the first shape
    step = {
        "gpu_channels_off_ratio": 1.01,
        "gpu_all_on_ratio": 1.3,
        "gpu_peak_memory_ratio": 1.02,
        "gpu_train_part_ratio": 1.1,
        "gpu_train_part_ratio_channels_off": 1.05,
        "gpu_train_part_ratio_range": [0.9, 1.3],
        "measured_steps": 16,
        "gpu_generation_paged_ratio": 4.2,
        "qwen05b_all_on_teacher_s": 0.4,
        "device_name": "NVIDIA H200",
    }
    _phase(out, "step", 124, "  qwen15b plain step 1 (warm-up) ...\n", saved=step)
    diloco = {
        "loss_gap_vs_dp_b128": 0.03,
        "loss_gap_vs_dp_b256": 0.015,
        "critical_batch": 256,
        "critical_batch_reached": True,
        "loss_gap_vs_dp_at_critical_batch": 0.015,
        "best_outer_lr": 1.0,
        "best_outer_momentum": 0.8,
        "loss_gap_vs_dp_at_best_outer": 0.025,
        "outer_grid_batch": 256,
    }
    _phase(out, "diloco", 0, "batch 128 ...\n" + json.dumps(diloco) + "\n")
    signal = {
        "signal_default_heldout_accuracy": 0.95,
        "signal_rl_heldout_accuracy": 0.4,
        "signal_rl_teacher_advantage": 0.03,
        "signal_rl_params": 17351936,
        "signal_rl_wall_s": 300.0,
        "signal_default_finished": True,
        "signal_rl_finished": False,
    }
    _phase(out, "signal", 0, "  default: ...\n", saved=signal)
    (out / "diffs.jsonl").write_text(
        json.dumps(
            {
                "test": "t::a",
                "what": "loss",
                "max_abs_diff": 1e-9,
                "rtol": 1e-5,
                "atol": 1e-5,
                "ratio": 0.01,
            }
        )
        + "\nnot json\n"
    )
    report, problems = keys.collect(out)
    assert report["keys"]["gpu_jsd_time_ratio"] == 1.7
    assert report["keys"]["gpu_all_on_ratio"] == 1.3 and report["keys"]["critical_batch"] == 256
    assert report["keys"]["loss_gap_vs_dp_b256"] == 0.015
    assert report["keys"]["step.gpu_generation_paged_ratio"] == 4.2
    assert report["keys"]["gpu_train_part_ratio"] == 1.1
    assert report["keys"]["step.gpu_train_part_ratio_range"] == [0.9, 1.3]
    assert report["keys"]["step.measured_steps"] == 16
    assert report["phases"] == {
        "gpu": "ok",
        "tests": "not run",
        "loss": "ok",
        "step": "exit 124",
        "diloco": "ok",
        "signal": "ok",
    }
    assert report["keys"]["best_outer_momentum"] == 0.8
    assert report["keys"]["diloco.outer_grid_batch"] == 256
    assert report["keys"]["signal_rl_teacher_advantage"] == 0.03
    assert report["keys"]["signal.signal_rl_wall_s"] == 300.0
    assert problems == [
        f"phase step exited 124 (see {out / 'step.log'})",
        "phase signal: the rl run did not finish",
        "gpu tests skipped: tests.trainer.test_x::c",
    ]
    assert report["tests"]["gpu"]["passed"] == 2 and len(report["diffs"]) == 1
    text = keys.render(report, problems)
    assert "gpu_all_on_ratio" in text and "goal <= 1.15: NOT met" in text
    assert "gpu_channels_off_ratio" in text and "goal <= 1.02: met" in text
    assert "gpu_train_part_ratio_channels_off" in text and "goal <= 1.02: NOT met" in text
    assert "gpu_replay_peak_ratio" in text and "goal <= 0.2: met" in text
    assert "loss_gap_vs_dp_at_best_outer" in text and "goal <= 0.02: NOT met" in text
    assert "0.0100  max |diff| 1e-09" in text


def test_missing_keys_and_failed_tests_are_problems(tmp_path):
    out = tmp_path
    _phase(out, "tests", 1)
    (out / "junit-tests.xml").write_text(
        JUNIT.format(failures=1, failure='<failure message="boom"/>')
    )
    _phase(out, "loss", 0, json.dumps({"gpu_jsd_peak_ratio": 0.1}) + "\n")
    _phase(out, "diloco", 1, "Traceback ...\n")
    assert keys.main([str(out)]) == 1
    report = json.loads((out / "keys.json").read_text())
    problems = report["problems"]
    assert "phase tests exited 1" in problems[0]
    assert "phase loss: key gpu_jsd_time_ratio missing" in problems
    assert "phase loss: key gpu_replay_peak_ratio missing" in problems
    assert "phase diloco: key loss_gap_vs_dp_b{batch} missing" in problems
    assert "phase diloco: key best_outer_lr missing" in problems
    _phase(out, "signal", 0, json.dumps({"signal_default_heldout_accuracy": 0.9}) + "\n")
    _, problems = keys.collect(out)
    assert "phase signal: key signal_rl_teacher_advantage missing" in problems
    assert any(p.startswith("tests tests failed: tests.trainer.test_x::b") for p in problems)
    # the dry run asks the loss benchmark's CPU keys and tolerates skipped gpu tests
    cpu_loss = {"peak_memory_ratio": 0.08, "time_ratio": 0.9, "replay_peak_memory_ratio": 0.02}
    _phase(out, "loss", 0, json.dumps(cpu_loss) + "\n")
    _, dry = keys.collect(out, dry_run=True)
    assert not any("phase loss" in p for p in dry) and not any("skipped" in p for p in dry)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(3000)  # every phase, CPU-sized; minutes on a loaded 2-core machine
def test_dry_run_runs_every_phase_on_the_cpu(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("matplotlib")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("COMPOSER_DIFF_LOG", None)
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "keys.json").read_text())
    assert set(report["phases"].values()) == {"ok"} and report["problems"] == []
    for key in (
        "gpu_channels_off_ratio",
        "gpu_all_on_ratio",
        "gpu_peak_memory_ratio",
        "loss_gap_vs_dp_b2",
        "loss_gap_vs_dp_b4",
        "critical_batch",
        "peak_memory_ratio",
        "replay_peak_memory_ratio",
        "gpu_train_part_ratio",
        "gpu_train_part_ratio_channels_off",
        "step.gpu_generation_paged_ratio",
        "best_outer_lr",
        "best_outer_momentum",
        "loss_gap_vs_dp_at_best_outer",
        "signal_default_heldout_accuracy",
        "signal_rl_heldout_accuracy",
        "signal_rl_teacher_advantage",
        "signal_rl_params",
    ):
        assert report["keys"][key] is not None, key
    gpu = report["tests"]["gpu"]
    assert gpu["tests"] >= 4 and len(gpu["gpu_skipped"]) == gpu["tests"]  # collected, skipped
    assert report["tests"]["tests"]["passed"] > 0
    assert "s (total " in done.stdout  # each phase's time is printed
