"""benchmarks/vs_trl.py --quick: TRL's GRPOTrainer, TRL's SDPOTrainer and ours each train on the
embedded default's task for a small budget, are evaluated on the held-out prompts, and the last
line is the JSON the docs quote (tiny budget: the figures are not judged here, only their form
and that every trainer ran and was measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("composer_heldout_acc", "trl_grpo_heldout_acc", "trl_sdpo_heldout_acc",
        "composer_constant_answer_share", "channel2_loss_share")  # fmt: skip


@pytest.mark.slow
def test_quick_run_prints_the_keys():
    pytest.importorskip("trl")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--quick", "--budget-s", "4",
           "--clock", "cpu", "--probe-every", "1"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in KEYS:
        assert 0.0 <= result[key] <= 1.0, (key, result[key])
    assert result["n_heldout"] == 256 and result["seeds"] == 1
    for trainer in ("trl_grpo", "trl_sdpo", "composer"):
        (run,) = result["per_seed"][trainer]
        assert run["steps"] >= 1 and run["train_seconds"] >= 4.0  # the budget was spent
        assert run["n_heldout"] == 256
    # the probe measured channel 2 on every micro-batch of ours, and only there
    assert (
        result["per_seed"]["composer"][0]["probed_micro_batches"]
        == (result["per_seed"]["composer"][0]["steps"])
    )
    assert result["per_seed"]["trl_grpo"][0]["channel2_loss_share"] is None
    assert set(result["targets"]) == {"composer_acc_ge_0.5", "composer_ahead_by_0.1",
                                      "constant_share_le_0.2"}  # fmt: skip
