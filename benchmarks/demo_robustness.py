"""The embedded default's held-out accuracy under every CPU kernel set: does the demo's figure
hold on any x86 CPU, or does it ride one machine's float rounding?

    python benchmarks/demo_robustness.py [--seeds 0,1,2] [--capabilities default,avx2,avx512]
                                         [--jobs N] [--log PATH] [section.key=value ...]

Each (seed, capability) pair is one whole `composer-replication train run.seed=SEED` (the
embedded default: 2 local replicas, DiLoCo through file://) with `ATEN_CPU_CAPABILITY` set to the
capability in its environment, so every replica computes with that kernel set (`default` = no
SIMD dispatch, `avx2`, `avx512` where the CPU has it: a capability the CPU lacks is left out and
said so). The figure is the run's last held-out evaluation (`eval/accuracy` of its last `eval`
record in metrics.jsonl, the number `train` prints), on the task's held-out prompts (no operand
multiset of a training prompt). A seed repeats bit for bit under one capability on one machine,
so a result that differs across capabilities differs by float rounding alone.

Every finished run is appended to ``--log`` (JSON lines; default
``benchmarks/results/demo_robustness.jsonl``) with the commit, CPU, capability torch reports and
load; a rerun skips the pairs already logged at this commit and overrides. Prints one line per
run, a table, and as the LAST line one JSON object: ``demo_min_heldout_acc`` (the lowest of all
runs), ``demo_median_heldout_acc_<capability>`` per capability, ``per_run``, ``goals`` (every run
>= 0.6, each capability's median >= 0.8) and ``goals_met``; where channel 2 measured its hinted
teacher (`sdpo/teacher_advantage`), ``demo_min_teacher_advantage`` and
``demo_median_teacher_advantage`` over the runs' whole-run means, and
``demo_min_teacher_advantage_last10`` over their last tenths of steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CAPABILITIES = ("default", "avx2", "avx512")
GOAL_MIN = 0.6
GOAL_MEDIAN = 0.8
# What the CPU must list in /proc/cpuinfo for torch's kernels of that capability.
_NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq")}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def available(capabilities: list[str]) -> tuple[list[str], list[str]]:
    """(the capabilities this CPU can run, those it cannot)."""
    flags = cpu_flags()
    ok = [c for c in capabilities if all(f in flags for f in _NEEDS.get(c, ()))]
    return ok, [c for c in capabilities if c not in ok]


def torch_capability(capability: str) -> str:
    """The capability torch reports under ATEN_CPU_CAPABILITY=capability (a check that the
    setting took effect)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().lower()


def last_eval(metrics: Path) -> dict[str, Any] | None:
    last = None
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("kind") == "eval" and "eval/accuracy" in record:
            if last is None or int(record.get("step", 0)) >= int(last.get("step", 0)):
                last = record
    return last


# What each run records from its report (`run.report.summarize`): the training reward over the
# first and last 10% of steps, and channel 2's teacher advantage and gate (absent when channel 2
# did not measure it).
REPORTED = (
    "reward_first10",
    "reward_last10",
    "teacher_advantage_first10",
    "teacher_advantage_last10",
    "teacher_advantage_run",
    "gate_open_run",
)


def reported(metrics: Path) -> dict[str, Any]:
    """The `REPORTED` figures of one run, as its report computes them."""
    from composer_replication.run.metrics import read_metrics
    from composer_replication.run.report import summarize

    summary = summarize(read_metrics(metrics))
    return {key: summary.get(key) for key in REPORTED}


def commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        # results being appended to (this log, vs_trl's) are not code
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--", "."]
        + [":!benchmarks/results"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def run_one(seed: int, capability: str, overrides: list[str]) -> dict[str, Any]:
    """One whole `train` of the embedded default under `capability`."""
    name = f"robust-s{seed}-{capability}"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "CUDA_VISIBLE_DEVICES": ""}
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="demo-robust-") as cwd:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "composer_replication",
                "train",
                f"run.name={name}",
                f"run.seed={seed}",
                *overrides,
            ],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(
                f"train (seed {seed}, {capability}) exited {proc.returncode}:\n"
                + proc.stdout[-2000:]
                + proc.stderr[-3000:]
            )
        metrics = Path(cwd) / "runs" / name / "metrics.jsonl"
        record = last_eval(metrics)
        figures = reported(metrics)
    if record is None:
        raise RuntimeError(f"train (seed {seed}, {capability}) logged no held-out evaluation")
    return {
        "seed": seed,
        "capability": capability,
        "torch_capability": torch_capability(capability),
        "heldout_acc": float(record["eval/accuracy"]),
        "heldout_n": int(record.get("eval/n", 0)),
        "ood_acc": record.get("eval/ood_accuracy"),
        "step": int(record.get("step", 0)),
        **figures,
        "wall_s": round(wall, 1),
        "load_start": round(load, 1),
        "load_end": round(os.getloadavg()[0], 1),
    }


def summarize(runs: list[dict[str, Any]], capabilities: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    accs = [r["heldout_acc"] for r in runs]
    out["demo_min_heldout_acc"] = min(accs) if accs else None
    met = bool(accs) and min(accs) >= GOAL_MIN
    for cap in capabilities:
        values = [r["heldout_acc"] for r in runs if r["capability"] == cap]
        median = statistics.median(values) if values else None
        out[f"demo_median_heldout_acc_{cap}"] = median
        met = met and median is not None and median >= GOAL_MEDIAN
    advantages = [
        r["teacher_advantage_run"] for r in runs if r.get("teacher_advantage_run") is not None
    ]
    if advantages:  # channel 2's hinted teacher against its student, over each whole run
        out["demo_min_teacher_advantage"] = min(advantages)
        out["demo_median_teacher_advantage"] = statistics.median(advantages)
    late = [
        r["teacher_advantage_last10"] for r in runs if r.get("teacher_advantage_last10") is not None
    ]
    if late:  # ... and over each run's last tenth of steps (the student has learnt to add)
        out["demo_min_teacher_advantage_last10"] = min(late)
    out["goals"] = {"every_run_min": GOAL_MIN, "median_per_capability_min": GOAL_MEDIAN}
    out["goals_met"] = met
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument(
        "--capabilities",
        default=",".join(CAPABILITIES),
        help="ATEN_CPU_CAPABILITY values (default: default,avx2,avx512; those the CPU lacks are "
        "left out)",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each is 2 processes)")
    p.add_argument("--log", default=str(HERE / "results" / "demo_robustness.jsonl"))
    p.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    wanted = [c.strip() for c in a.capabilities.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(CAPABILITIES))
    if unknown:
        p.error(f"--capabilities: unknown {unknown}; choose from {', '.join(CAPABILITIES)}")
    capabilities, missing = available(wanted)
    for cap in missing:
        print(f"skipped: this CPU lacks {cap} ({', '.join(_NEEDS[cap])})", flush=True)
    here = {"commit": commit(), "cpu": cpu_model(), "overrides": a.overrides}
    log = Path(a.log)
    done: dict[tuple[int, str], dict[str, Any]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            if r.get("commit") == here["commit"] and r.get("overrides") == a.overrides:
                done[(int(r["seed"]), str(r["capability"]))] = r
    todo = [(s, c) for c in capabilities for s in seeds if (s, c) not in done]

    def work(pair: tuple[int, str]) -> dict[str, Any]:
        r = {**run_one(pair[0], pair[1], a.overrides), **here}
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(
            f"seed {r['seed']} {r['capability']:8s} (torch: {r['torch_capability']}): held-out "
            f"{r['heldout_acc']:.3f} of {r['heldout_n']}, {r['wall_s']:.0f} s, load "
            f"{r['load_start']}-{r['load_end']}"
            + (
                f", ch2 teacher adv. {r['teacher_advantage_run']:+.3f} over the run"
                if r.get("teacher_advantage_run") is not None
                else ""
            ),
            flush=True,
        )
        return r

    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        for r in pool.map(work, todo):
            done[(r["seed"], r["capability"])] = r
    runs = [done[(s, c)] for c in capabilities for s in seeds]
    print(f"\n{'capability':10s} | " + " | ".join(f"seed {s}" for s in seeds) + " | median")
    for cap in capabilities:
        accs = [done[(s, cap)]["heldout_acc"] for s in seeds]
        print(
            f"{cap:10s} | "
            + " | ".join(f"{x:6.3f}" for x in accs)
            + f" | {statistics.median(accs):.3f}"
        )
    result = {
        **summarize(runs, capabilities),
        "capabilities": capabilities,
        "capabilities_missing": missing,
        "seeds": seeds,
        "per_run": [
            {
                k: r.get(k)
                for k in (
                    "seed",
                    "capability",
                    "torch_capability",
                    "heldout_acc",
                    "teacher_advantage_run",
                    "wall_s",
                )
            }
            for r in runs
        ],
        **here,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
