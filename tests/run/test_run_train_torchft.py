"""`composer-replication train` with `diloco.manager = "torchft"`: 2 local replicas synchronised by
torchft's Manager over gloo, with the lighthouse the driver runs on 127.0.0.1.

Checked independently of what the replicas say about themselves: the final checkpoint (written by
replica 0) is loaded back and digested here, and must equal the global-weights digest both
replicas report, and differ from the initial weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_run_train_e2e import SMALL as E2E_SMALL

from composer_replication.assembly.build import build_model
from composer_replication.config import load_config
from composer_replication.run.metrics import read_metrics
from composer_replication.run.replica_training import weights_digest

# the e2e test's small config, without TensorBoard files and plots
SMALL = [*E2E_SMALL, "logging.tensorboard=false", "logging.report=false"]

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def test_train_with_torchft_manager_two_local_replicas_end_identical(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    env = {k: v for k, v in os.environ.items() if k not in ("TORCHFT_LIGHTHOUSE", "RUST_LOG")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer_replication",
            "train",
            *SMALL,
            "train.max_steps=6",
            "diloco.sync_every_h=2",
            "diloco.manager=torchft",
            "--name",
            "tft",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    run = tmp_path / "runs" / "tft"
    logs = "\n".join(p.read_text()[-3000:] for p in (run / "logs").glob("*.log"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    assert "Run tft: finished" in proc.stdout and "3 outer rounds" in proc.stdout
    # the lighthouse the driver runs keeps its per-quorum INFO lines out of the display
    assert "torchft::lighthouse" not in proc.stdout + proc.stderr

    records = read_metrics(run / "metrics.jsonl")
    for rank in (0, 1):
        rounds = [r for r in records if r["kind"] == "round" and r["replica"] == rank]
        # every round committed by torchft with both replicas, no heal (same initial weights)
        assert [r["round"] for r in rounds] == [1, 2, 3], rounds
        assert all(r["round/committed"] and not r["round/healed"] for r in rounds)
        assert all(r["round/included"] == 2 and r["round/bytes_up"] > 0 for r in rounds)
    digests = {r["replica"]: r["sha256"] for r in records if r.get("event") == "global_weights"}
    assert set(digests) == {0, 1} and digests[0] == digests[1]

    # the final checkpoint holds those global weights; training moved them off the init
    final = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "final")
    assert weights_digest(final) == digests[0]
    init, _ = build_model(load_config(run / "config.toml"))  # what every replica started from
    assert weights_digest(init) != digests[0]
    assert json.loads((run / "checkpoints" / "final" / "state.json").read_text())["round"] == 3

    # the outer state went to the store after the last round, so `train --resume` finds it
    states = sorted(p.name for p in (run / "store" / "states" / "global").iterdir())
    assert states[-1] == f"{3:010d}.safetensors"
