"""benchmarks/diloco_convergence.py's sweeps (issue 13.3): the H sweep keeps the tokens fixed and
moves communication by exactly the number of rounds, the default run's point is reused (not
re-run differently), the outer-lr warm-up is the documented ramp, and the JSON + plot are written
(tiny model; the figures themselves are in docs/benchmarks.md, not judged here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import diloco_convergence as dc  # noqa: E402


def test_outer_lr_warmup_ramps_linearly_then_holds() -> None:
    cfg = SimpleNamespace(outer_lr=0.8, outer_warmup=4)
    assert [dc.outer_lr_at(cfg, r) for r in range(6)] == pytest.approx(  # type: ignore[arg-type]
        [0.2, 0.4, 0.6, 0.8, 0.8, 0.8]
    )
    cfg.outer_warmup = 0
    assert dc.outer_lr_at(cfg, 0) == 0.8  # type: ignore[arg-type]


def test_sweep_lists_are_validated() -> None:
    assert dc.parse_list("10, 25,50", int, "--sweep-h") == [10, 25, 50]
    with pytest.raises(SystemExit, match="--sweep-h"):
        dc.parse_list("10,x", int, "--sweep-h")
    with pytest.raises(SystemExit, match="positive"):
        dc.parse_list("0.7,-1", float, "--sweep-outer-lr")


def test_inner_schedule_is_one_schedule_over_all_steps() -> None:
    """Not restarted per round: warm-up only at the start, cosine down to 10% at step S."""
    cfg = SimpleNamespace(lr=1e-3, steps=400)
    lrs = [dc.Cfg.lr_at(cfg, t) for t in range(400)]  # type: ignore[arg-type]
    warm = 400 // 20
    assert lrs[warm - 1] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[warm:], lrs[warm + 1 :]))  # monotone after warm-up
    assert lrs[-1] == pytest.approx(1e-4, rel=1e-3)


@pytest.mark.slow
def test_sweeps_write_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.json"
    tiny = ["--quick", "--k", "2", "--batch", "2", "--ctx", "32", "--d-model", "32",
            ]  # fmt: skip
    sweeps = ["--sweep-h", "5,10,15", "--sweep-outer-lr", "0.7,1.0", "--sweep-dp-lr", "2e-3,4e-3",
              "--sweep-batch", "2,4"]  # fmt: skip
    cmd = [sys.executable, str(ROOT / "benchmarks" / "diloco_convergence.py"), *tiny, *sweeps,
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["h"] == 10 and last["rounds"] == 3
    assert last["comm_ratio_vs_dp"] == pytest.approx(10, rel=0.05)  # ~H times fewer bytes
    saved = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    by_h = {p["h"]: p for p in saved["sweeps"]["h"]}
    assert {h: p["rounds"] for h, p in by_h.items()} == {5: 6, 10: 3, 15: 2}  # S = 30 each
    # each round moves the same bytes, so the whole run's bytes scale with the rounds
    assert by_h[5]["bytes"] == 2 * by_h[10]["bytes"] == 3 * by_h[15]["bytes"]
    assert by_h[10]["eval_loss"] == last["diloco_eval_loss"]  # the default run, reused
    assert by_h[5]["eval_loss"] != by_h[15]["eval_loss"]
    olr = {p["outer_lr"]: p["eval_loss"] for p in saved["sweeps"]["outer_lr"]}
    assert olr[0.7] == last["diloco_eval_loss"] and olr[1.0] != olr[0.7]
    dp = {p["lr"]: p["eval_loss"] for p in saved["sweeps"]["dp_lr"]}
    assert dp[2e-3] == last["dp_eval_loss"] and dp[4e-3] != dp[2e-3]
    assert last["dp_best_lr"] == min(dp, key=lambda lr: dp[lr])
    # the batch sweep: B=2 is the default run; B=4 is a complete run of its own (own warm start)
    by_b = {p["batch"]: p for p in saved["sweeps"]["batch"]}
    assert last["batch"] == 2 and set(by_b) == {2, 4}
    assert by_b[2]["dp_eval_loss"] == last["dp_eval_loss"]
    assert by_b[2]["diloco_eval_loss"] == last["diloco_eval_loss"]
    assert by_b[2]["start_eval_loss"] == last["start_eval_loss"]
    assert by_b[4]["start_eval_loss"] != last["start_eval_loss"]
    for p in by_b.values():
        assert p["loss_gap_vs_dp"] == pytest.approx(
            (p["diloco_eval_loss"] - p["dp_eval_loss"]) / p["dp_eval_loss"], abs=1e-4
        )
