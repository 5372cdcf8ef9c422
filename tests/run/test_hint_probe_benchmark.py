"""benchmarks/hint_probe.py: the supervised probe of whether the demo's model reads its hint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_few_steps_print_every_figure_with_consistent_shares() -> None:
    pytest.importorskip("transformers")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "hint_probe.py"),
            "--source",
            "both",
            "--steps",
            "3",
            "--probe",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["source"] == "both" and result["probed"] == 8
    for key in ("heldout_plain", "train_plain", "train_hinted", "beyond_hinted"):
        assert 0.0 <= result[key] <= 1.0
    # rescued / broken split the probed prompts by their plain verdict: both undefined only
    # when that side is empty, and together they account for the hinted accuracy
    plain, hinted = result["train_plain"], result["train_hinted"]
    rescued = result["rescued"] or 0.0
    broken = result["broken"] or 0.0
    assert hinted == pytest.approx(plain * (1 - broken) + (1 - plain) * rescued, abs=1e-3)
