"""The learning signal on a device: the embedded default run and one RL run of a locally built
10-30M-parameter model, each through `composer-replication train`, with held-out accuracy and
channel 2's teacher advantage (scripts/gpu-check.sh's ``signal`` phase).

    python benchmarks/gpu_signal.py --device cuda [--out signal.json]
    python benchmarks/gpu_signal.py --device cpu --quick      # tiny sizes: the plumbing only

Two runs, started together (each is its own `train`, its own run folder under a temporary
directory; on one GPU they share the device, which the tiny models leave mostly idle):

- ``default``: the embedded default (`composer-replication train` with no config: the tiny
  Qwen2, hidden 64, 2 layers, 2 local replicas through DiLoCo, all three channels, 1200 steps),
  unchanged but for ``run.*`` (``--default-steps`` sets ``train.max_steps`` when given).
- ``rl``: the same task and loss (GRPO + channel 2's hint self-distillation with its teacher
  probe + channel 3's oracle-trace replay) on a larger tiny Qwen2 built from the config, no
  download: ``model.hidden_size`` 384, 8 layers, 6 heads, 2 key/value heads (17.4M parameters
  with the char tokenizer), one replica, ``--rl-steps`` steps at ``--rl-lr`` (1e-3: the default's
  3e-3 scaled down for a 6x wider model; not tuned).

The device is the run's own: `train` puts the model on CUDA whenever torch sees one; with
``--device cpu`` the runs get ``CUDA_VISIBLE_DEVICES=""``, with ``--device cuda`` the driver
refuses to start without a CUDA device. What each run trained on is read back from its
``device`` event. Held-out accuracy is the run's last ``eval/accuracy`` (exact match, greedy, on
the task's held-out prompts: no operand multiset of a training prompt); the teacher advantage is
``sdpo/teacher_advantage`` (the hinted teacher's sampled reward minus the student's on the same
prompts, `trainer._gate_on_teacher`), its mean over every logged step and over the first and
last 10% of steps (`run.report.summarize`). A run that passes ``--timeout-s`` is stopped and
reported with what it logged (``signal_<run>_finished`` false).

Last line: JSON with ``signal_default_heldout_accuracy``, ``signal_rl_heldout_accuracy``,
``signal_rl_teacher_advantage`` (and ``_first10`` / ``_last10``), each run's ``_params``,
``_steps``, ``_wall_s``, ``_device``, ``_finished``, and ``device`` / ``device_name`` /
``seconds``; also written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The RL run's model: a tiny Qwen2 of 10-30M parameters (tests check the count).
RL_MODEL = {"hidden_size": 384, "num_layers": 8, "num_heads": 6, "num_kv_heads": 2}
# --quick: every run a few steps of a small model (the plumbing, not a figure).
QUICK_RUN = [
    "train.max_steps=4",
    "diloco.sync_every_h=2",
    "train.eval_every_rounds=1",
    "task.n_train=64",
    "task.n_eval=16",
    "train.eval_max_examples=16",
    "train.batch_size=8",
]
QUICK_RL_MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}


def rl_overrides(model: dict[str, int], steps: int, lr: float) -> list[str]:
    """The RL run's config overrides over the embedded default."""
    return [
        *(f"model.{key}={value}" for key, value in model.items()),
        "backend.n_replicas=1",
        f"train.max_steps={steps}",
        f"train.learning_rate={lr}",
    ]


def param_count(model: dict[str, int]) -> int:
    """Parameters of the tiny Qwen2 of these sizes with the default (char) tokenizer, as
    `train` builds it."""
    from composer_replication.models import build_tiny_model, build_tokenizer

    built = build_tiny_model(build_tokenizer(), **model)
    return sum(p.numel() for p in built.parameters())


def finite_mean(values: list[Any]) -> float | None:
    kept = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


def run_figures(metrics: Path) -> dict[str, Any]:
    """What a run logged: held-out accuracy (last and first evaluation), the teacher advantage
    (every logged step's mean, first and last 10%), the gate, the steps and the device."""
    from composer_replication.run.metrics import read_metrics
    from composer_replication.run.report import summarize

    records = read_metrics(metrics)
    summary = summarize(records)
    train = [r for r in records if r.get("kind") == "train"]
    devices = [r for r in records if r.get("kind") == "event" and r.get("event") == "device"]
    return {
        "heldout_accuracy": summary.get("eval_accuracy_last"),
        "heldout_accuracy_first": summary.get("eval_accuracy_first"),
        "heldout_n": summary.get("eval_n"),
        "teacher_advantage": finite_mean([r.get("sdpo/teacher_advantage") for r in train]),
        "teacher_advantage_first10": summary.get("teacher_advantage_first10"),
        "teacher_advantage_last10": summary.get("teacher_advantage_last10"),
        "gate_open": finite_mean([r.get("sdpo/gate_open") for r in train]),
        "reward_first10": summary.get("reward_first10"),
        "reward_last10": summary.get("reward_last10"),
        "steps": max((int(r.get("step", 0)) for r in train), default=0),
        "device": devices[-1].get("device") if devices else None,
        "device_name": (devices[-1].get("device_name") or None) if devices else None,
    }


def start_run(name: str, overrides: list[str], workdir: Path, env: dict[str, str]) -> Any:
    log = (workdir / f"{name}.log").open("w")
    cmd = [
        sys.executable,
        "-m",
        "composer_replication",
        "train",
        f"run.name={name}",
        f"run.runs_dir={workdir / 'runs'}",
        *overrides,
    ]
    print(f"  {name}: {' '.join(cmd[2:])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, log, time.monotonic()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: the plumbing only")
    ap.add_argument(
        "--default-steps",
        type=int,
        default=None,
        help="the default run's train.max_steps (default: the embedded default's, 1200)",
    )
    ap.add_argument("--rl-steps", type=int, default=1200, help="the RL run's steps")
    ap.add_argument("--rl-lr", type=float, default=1e-3, help="the RL run's learning rate")
    ap.add_argument(
        "--timeout-s",
        type=float,
        default=0.0,
        help="stop a run still going after this many seconds and report what it logged (0: none)",
    )
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--keep", default=None, help="keep the run folders and logs here")
    a = ap.parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device cuda: torch {torch.__version__} sees no CUDA device (use --device cpu)"
        )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    model = QUICK_RL_MODEL if a.quick else RL_MODEL
    quick = QUICK_RUN if a.quick else []
    default_over = [*quick]
    if a.default_steps:
        default_over.append(f"train.max_steps={a.default_steps}")
    rl_steps = 4 if a.quick else a.rl_steps
    rl_over = [*quick, *rl_overrides(model, rl_steps, a.rl_lr)]
    t_start = time.monotonic()
    result: dict[str, Any] = {
        "device": a.device,
        "device_name": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
        "quick": a.quick,
        "signal_rl_model": model,
        "signal_rl_lr": a.rl_lr,
        "signal_default_params": param_count({}),
        "signal_rl_params": param_count(model),
    }
    with tempfile.TemporaryDirectory(prefix="gpu-signal-") as tmp:
        workdir = Path(a.keep) if a.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"signal runs on {a.device}, under {workdir}:", flush=True)
        runs = {
            "default": start_run("default", default_over, workdir, env),
            "rl": start_run("rl", rl_over, workdir, env),
        }
        failed = []
        for name, (proc, log, t0) in runs.items():
            left = None if a.timeout_s <= 0 else max(1.0, a.timeout_s - (time.monotonic() - t0))
            timed_out = False
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.terminate()
                try:
                    rc = proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                print(f"  {name}: stopped after --timeout-s {a.timeout_s:g}", flush=True)
            log.close()
            wall = time.monotonic() - t0
            figures = run_figures(workdir / "runs" / name / "metrics.jsonl")
            result.update({f"signal_{name}_{k}": v for k, v in figures.items()})
            result[f"signal_{name}_wall_s"] = round(wall, 1)
            result[f"signal_{name}_finished"] = rc == 0 and not timed_out
            print(
                f"  {name}: exit {rc} after {wall:.0f}s, held-out accuracy "
                f"{figures['heldout_accuracy']} (first {figures['heldout_accuracy_first']}), "
                f"teacher advantage {figures['teacher_advantage']}, {figures['steps']} steps on "
                f"{figures['device']}",
                flush=True,
            )
            if rc != 0 and not timed_out:
                failed.append(name)
                print((workdir / f"{name}.log").read_text()[-3000:], file=sys.stderr)
    result["seconds"] = round(time.monotonic() - t_start, 1)
    line = json.dumps(result)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(line + "\n")
    print(line)
    if failed:
        print(f"gpu_signal: run(s) {', '.join(failed)} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
