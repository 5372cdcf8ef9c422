"""Collect and print what scripts/gpu-check.sh measured: every benchmark key the GPU issue names,
the test counts, and the measured differences behind the derived test tolerances.

    python scripts/gpu_check_keys.py OUT [--dry-run]

Reads, under OUT: ``<phase>.json`` or else the last JSON line of ``<phase>.log`` for the
benchmark phases (``loss``, ``step``, ``diloco``, ``signal``), ``<phase>.rc`` (each phase's exit status),
``junit-gpu.xml`` / ``junit-tests.xml`` (the two test phases) and ``diffs.jsonl`` (tests/tolerances.py's ``COMPOSER_DIFF_LOG``).
Writes ``OUT/keys.json`` and prints one table. Exit status 1 when a phase that ran failed or a
required key is missing; a goal not met is reported, not failed (the figures are the result).
Standard library only: it runs with the device image's python3 before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

PHASES = ("gpu", "tests", "loss", "step", "diloco", "signal")
TEST_PHASES = ("gpu", "tests")
# Required keys per benchmark phase; a "{batch}" key is required for every swept batch.
REQUIRED = {
    "loss": ("gpu_jsd_peak_ratio", "gpu_jsd_time_ratio", "gpu_replay_peak_ratio"),
    "step": (
        "gpu_channels_off_ratio",
        "gpu_all_on_ratio",
        "gpu_peak_memory_ratio",
        "gpu_train_part_ratio",
        "gpu_train_part_ratio_channels_off",
    ),
    "diloco": (
        "loss_gap_vs_dp_b{batch}",
        "critical_batch",
        "loss_gap_vs_dp_at_critical_batch",
        "best_outer_lr",
        "best_outer_momentum",
        "loss_gap_vs_dp_at_best_outer",
    ),
    "signal": (
        "signal_default_heldout_accuracy",
        "signal_rl_heldout_accuracy",
        "signal_rl_teacher_advantage",
        "signal_rl_params",
    ),
}
# --dry-run runs the loss benchmark's CPU path, whose keys are the CPU ones.
REQUIRED_DRY = {
    **REQUIRED,
    "loss": ("peak_memory_ratio", "time_ratio", "replay_peak_memory_ratio"),
}
# Issues 24's and 39's goals (reported beside each figure).
GOALS = {
    "gpu_jsd_peak_ratio": 0.01,
    "gpu_jsd_time_ratio": 2.0,
    "gpu_channels_off_ratio": 1.02,
    "gpu_all_on_ratio": 1.15,
    "gpu_peak_memory_ratio": 1.05,
    "gpu_train_part_ratio": 1.15,
    "gpu_train_part_ratio_channels_off": 1.02,
    "gpu_replay_peak_ratio": 0.2,
    "replay_peak_memory_ratio": 0.2,
    "loss_gap_vs_dp_at_critical_batch": 0.02,
    "loss_gap_vs_dp_at_best_outer": 0.02,
    "peak_memory_ratio": 0.1,
}
# Printed when present (optional: other shapes, rollout engines, the split).
OPTIONAL = re.compile(
    r"^(gpu_.*_ratio_.*|gpu_generation_.*_ratio|gpu_replay_.*|generation_.*_s|generation_fastest|"
    r"measured_steps|"
    r"qwen\d+b_.*_s|qwen\d+b_.*_peak_gb|tiny_.*_s|tiny_.*_peak_gb|critical_batch_reached|"
    r"outer_grid_.*|best_outer_eval_loss|"
    r"signal_.*_(heldout_accuracy_first|teacher_advantage_.*|gate_open|steps|wall_s|device|"
    r"device_name|finished|params)|"
    r"device|device_name|dtype|gradient_checkpointing|seconds)$"
)


def last_json(path: Path) -> dict[str, Any] | None:
    """The last line of `path` that parses as a JSON object, or None."""
    if not path.is_file():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def phase_result(out: Path, phase: str) -> dict[str, Any] | None:
    """A benchmark phase's JSON: its --out file if it wrote one, else its log's last JSON."""
    saved = last_json(out / f"{phase}.json")
    return saved if saved is not None else last_json(out / f"{phase}.log")


def required_keys(phase: str, result: dict[str, Any], dry_run: bool) -> list[str]:
    table = REQUIRED_DRY if dry_run else REQUIRED
    keys: list[str] = []
    for key in table.get(phase, ()):
        if "{batch}" in key:
            batches = sorted(
                int(k.removeprefix("loss_gap_vs_dp_b"))
                for k in result
                if re.fullmatch(r"loss_gap_vs_dp_b\d+", k)
            )
            keys += [key.format(batch=b) for b in batches] or [key]
        else:
            keys.append(key)
    return keys


def junit_counts(path: Path) -> dict[str, Any] | None:
    """Totals of a pytest junit XML, and the tests skipped for want of a GPU."""
    if not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return {"error": f"junit.xml: {exc}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    gpu_skipped = [
        case.get("classname", "") + "::" + case.get("name", "")
        for case in root.iter("testcase")
        if any("needs a CUDA device" in (s.get("message") or "") for s in case.iter("skipped"))
    ]
    failed = [
        case.get("classname", "") + "::" + case.get("name", "")
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "gpu_skipped": gpu_skipped, "failed": failed}


def diff_records(path: Path) -> list[dict[str, Any]]:
    records = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                records.append(value)
    return records


def collect(out: Path, dry_run: bool = False) -> tuple[dict[str, Any], list[str]]:
    """(everything measured, the problems: failed phases, missing keys)."""
    report: dict[str, Any] = {"dry_run": dry_run, "phases": {}, "keys": {}}
    problems: list[str] = []
    for phase in PHASES:
        rc_file = out / f"{phase}.rc"
        if not rc_file.is_file():
            report["phases"][phase] = "not run"
            continue
        rc = rc_file.read_text().strip()
        report["phases"][phase] = "ok" if rc == "0" else f"exit {rc}"
        if rc != "0":
            problems.append(f"phase {phase} exited {rc} (see {out / (phase + '.log')})")
        if phase in TEST_PHASES:
            continue
        result = phase_result(out, phase) or {}
        for key in required_keys(phase, result, dry_run):
            if result.get(key) is None:
                problems.append(f"phase {phase}: key {key} missing")
            report["keys"][key] = result.get(key)
        for key, value in result.items():
            if OPTIONAL.match(key) and key not in report["keys"]:
                report["keys"][f"{phase}.{key}"] = value
        if phase == "signal":  # a run the driver stopped at its --timeout-s: figures cut short
            for key, value in result.items():
                if re.fullmatch(r"signal_\w+_finished", key) and value is False:
                    run = key.removeprefix("signal_").removesuffix("_finished")
                    problems.append(f"phase signal: the {run} run did not finish")
    for phase in TEST_PHASES:
        tests = junit_counts(out / f"junit-{phase}.xml")
        if tests is None:
            continue
        report.setdefault("tests", {})[phase] = tests
        if tests.get("failed"):
            problems.append(f"{phase} tests failed: {', '.join(tests['failed'][:10])}")
        if tests.get("gpu_skipped") and not dry_run:
            problems.append(f"gpu tests skipped: {', '.join(tests['gpu_skipped'][:10])}")
        if phase == "gpu" and tests.get("tests") == 0:
            problems.append("no gpu test was collected")
    report["diffs"] = diff_records(out / "diffs.jsonl")
    return report, problems


def render(report: dict[str, Any], problems: list[str]) -> str:
    lines = ["== gpu-check: phases " + ", ".join(f"{p} {s}" for p, s in report["phases"].items())]
    for phase, tests in (report.get("tests") or {}).items():
        lines.append(
            f"== {phase} tests: {tests.get('passed', 0)} passed, {tests.get('failures', 0)} "
            f"failed, {tests.get('errors', 0)} errors, {tests.get('skipped', 0)} skipped "
            f"({len(tests.get('gpu_skipped', []))} for want of a GPU)"
        )
    lines.append("== keys")
    for key, value in report["keys"].items():
        goal = GOALS.get(key)
        verdict = ""
        if goal is not None and isinstance(value, int | float):
            verdict = f"   goal <= {goal:g}: {'met' if value <= goal else 'NOT met'}"
        lines.append(f"  {key:<44} {value!s:<14}{verdict}")
    diffs = report.get("diffs") or []
    if diffs:
        lines.append("== measured differences vs derived bounds (ratio = measured / allowed)")
        ranked = sorted(diffs, key=lambda d: -(d.get("ratio") or 0.0))
        for d in ranked[:25]:
            what = f"{d.get('test', '?').split('::')[-1]} {d.get('what', '')}".strip()
            if "max_abs_diff" in d:
                figure = f"max |diff| {d['max_abs_diff']:.3g} (rtol {d.get('rtol', 0):.2g})"
            else:
                figure = f"measured {d.get('measured', 0):.4g} bound {d.get('bound', 0):.4g}"
            lines.append(f"  {(d.get('ratio') or 0.0):8.4f}  {figure}  {what}")
        lines.append(f"  ({len(diffs)} comparisons logged; all in keys.json)")
    if problems:
        lines.append("== problems")
        lines += [f"  {p}" for p in problems]
    else:
        lines.append("== every phase ran and every required key is there")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the folder gpu-check.sh wrote ($OUT)")
    ap.add_argument("--dry-run", action="store_true", help="CPU dry run: the CPU keys")
    args = ap.parse_args(argv)
    out = Path(args.out)
    report, problems = collect(out, args.dry_run)
    report["problems"] = problems
    (out / "keys.json").write_text(json.dumps(report, indent=1) + "\n")
    print(render(report, problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
