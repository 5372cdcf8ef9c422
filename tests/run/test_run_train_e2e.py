"""`composer-replication train` end to end: 2 local replicas, DiLoCo through file://, all three
loss channels, metrics, plots, checkpoints, summary; and `--resume` after the run was killed.

The embedded default with a shortened budget and a smaller model (the full default runs in the
benchmark and from the README).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.config import load_config
from composer_replication.run.metrics import read_metrics

# Small and quick, but the same code path as the default: tiny Qwen2, arithmetic with the
# oracle teacher, alpha_sdpo > 0 and beta_replay > 0, 2 replicas, a file:// store.
SMALL = [
    *TINY_RUN,
    "train.eval_every_rounds=1",
]

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == kind]


def test_train_default_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "e2e"
    run.mkdir(parents=True)
    (run / "old-junk.txt").write_text("from an earlier run")  # replaced only with --overwrite
    code = main(
        [
            "train",
            *SMALL,
            "train.max_steps=4",
            "diloco.sync_every_h=2",
            "--name",
            "e2e",
            "--overwrite",
        ]
    )
    out = capsys.readouterr().out
    assert not (run / "old-junk.txt").exists()
    assert code == 0, out + "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    # the summary: first-10% vs last-10% reward, eval accuracy, where the report is
    assert "Run e2e: finished" in out and "2 outer rounds" in out
    assert "mean reward      first 10%:" in out and "eval accuracy    first:" in out
    assert "device           cpu, weights float32, autocast none" in out or (
        torch.cuda.is_available()  # there: "cuda:0 (<GPU name>), ..."
    )
    assert "95% interval     last: " in out and "(Wilson)" in out
    assert "loss ch1 grpo" in out and "loss ch3 replay" in out
    assert "ch2 teacher adv." in out  # channel 2 probed its hinted teacher
    assert f"report           {run / 'summary.md'}" in out

    # resolved config and driver state
    config = load_config(run / "config.toml")
    # the folder's own store is recorded as "" (a copy of the folder uses its own store)
    assert config.run.name == "e2e" and config.store.uri == ""
    assert json.loads((run / "driver.json").read_text())["status"] == "finished"

    # metrics from both replicas, all three channels active, one round record per round
    train = _records(run, "train")
    assert {r["replica"] for r in train} == {0, 1}
    assert {r["step"] for r in train} == {1, 2, 3, 4}
    assert all(r["reward"] is not None for r in train)
    assert any(r.get("replay/active") == 1.0 for r in train)
    # channel 2 ran its teacher probe every step and distilled only where its gate was open (this
    # tiny model's teacher is no better than its student, so the gate may stay closed throughout)
    assert all("sdpo/gate_open" in r for r in train)
    assert all(r["sdpo/active"] <= r["sdpo/gate_open"] for r in train)
    ch2_ran = any(r["sdpo/active"] > 0 for r in train)
    assert ("loss ch2 sdpo" in out) == ch2_ran
    rounds = _records(run, "round")
    for rank in (0, 1):
        mine = [r for r in rounds if r["replica"] == rank]
        assert [r["round"] for r in mine] == [1, 2] and all(r["round/committed"] for r in mine)
        assert all(r["round/bytes_up"] > 0 for r in mine)
    # where the time goes, measured: each logged step split into generation, channel 2's
    # teacher forward and the rest (loss + backward); each round's exchange into upload, wait
    # and merge, with the round's pace
    for r in train:
        assert r["time/generate_s"] > 0 and r["time/loss_backward_s"] > 0
        assert r["time/step_s"] >= r["time/generate_s"] + r["time/teacher_s"]
        parts = r["time/generate_s"] + r["time/teacher_s"] + r["time/loss_backward_s"]
        assert parts == pytest.approx(r["time/step_s"], rel=1e-6)
    # channel 2's teacher forward is timed where it ran, and skipped where the gate closed
    assert any(r["time/teacher_s"] > 0 for r in train) == ch2_ran
    for r in rounds:
        phases = r["round/upload_s"] + r["round/wait_s"] + r["round/merge_s"]
        assert 0 < phases <= r["round/seconds"] + 1e-3
        assert 0 < r["round/seconds"] < r["round/wall_s"]
        assert 0.0 <= r["round/wait_fraction"] <= 1.0
        assert r["round/steps_per_s"] == pytest.approx(2 / r["round/wall_s"])
        assert r["round/tokens_per_s"] is None or r["round/tokens_per_s"] > 0
    evals = _records(run, "eval")
    assert [r["step"] for r in evals] == [0, 2, 4]  # baseline, then after each round
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)

    # TensorBoard, logs, plots, summary
    assert list((run / "tensorboard" / "replica-0").glob("events.out.tfevents.*"))
    assert len(list((run / "logs").glob("replica-*.log"))) == 2
    plots = {p.name for p in (run / "plots").glob("*.png")}
    assert {"reward.png", "eval_accuracy.png", "outer_rounds.png", "loss_total.png"} <= plots
    assert "loss_replay.png" in plots and ("loss_sdpo.png" in plots) == ch2_ran
    assert {"time_breakdown.png", "throughput.png"} <= plots
    assert "| mean reward, first 10% of steps |" in (run / "summary.md").read_text()

    # a loadable Hugging Face checkpoint of the final global model, plus outer state (the
    # snippet of docs/quickstart.md "Use the checkpoint" loads it the same way)
    final = run / "checkpoints" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert model.config.hidden_size == 32 and tok.pad_token == "<|pad|>"
    assert (final / "model.safetensors").is_file() and (final / "outer_state.safetensors").is_file()
    assert json.loads((final / "state.json").read_text())["round"] == 2
    assert (run / "checkpoints" / "round-000002" / "COMMITTED").is_file()

    # the other commands work on the finished run
    assert main(["status", str(run)]) == 0
    status = capsys.readouterr().out
    assert "run e2e: finished" in status and "outer round 2" in status
    assert "steps/s" in status and "wait" in status
    assert main(["report", "e2e"]) == 0
    assert "wrote" in capsys.readouterr().out
    # resuming the finished run relaunches nothing and keeps its wall time
    wall = json.loads((run / "driver.json").read_text())["wall_seconds"]
    assert main(["train", "--resume", "e2e"]) == 0
    assert "has already finished" in capsys.readouterr().out
    assert json.loads((run / "driver.json").read_text())["wall_seconds"] == wall


def _latest_state(states: Path) -> int:
    """Newest round of the global state the outer loop published (-1 when none yet)."""
    if not states.is_dir():
        return -1
    rounds = [int(n.split(".")[0]) for n in os.listdir(states) if n.endswith(".safetensors")]
    return max(rounds, default=-1)


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"driver exited with {proc.returncode} before {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_resume_after_kill_continues_from_last_committed_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "runs" / "killed"
    states = run / "store" / "states" / "global"
    args = [
        *SMALL,
        "train.max_steps=120",
        "diloco.sync_every_h=4",
        "train.eval_every_rounds=10",
        "checkpoint.every_rounds=10",
        "--name",
        "killed",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_replication", "train", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        _wait_for(lambda: _latest_state(states) >= 2, 240, "round 2", proc)
        proc.send_signal(signal.SIGTERM)  # what `kill` does; the replicas are cancelled
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, output
    assert "continue with    composer-replication train --resume" in output
    driver = json.loads((run / "driver.json").read_text())
    assert driver["status"] == "interrupted"
    assert all(r["status"] == "cancelled" for r in driver["replicas"])
    killed_at = _latest_state(states)
    assert 2 <= killed_at < 30
    before = read_metrics(run / "metrics.jsonl")

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "killed"]) == 0
    out = capsys.readouterr().out
    assert "Resuming run" in out and "Run killed: finished" in out
    records = read_metrics(run / "metrics.jsonl")
    events_before = [r for r in before if r["kind"] == "event"]
    assert [r for r in records if r["kind"] == "event"][: len(events_before)] == events_before
    starts = [r for r in records if r.get("event") == "start"][2:]
    assert sorted(r["replica"] for r in starts) == [0, 1]
    # each replica restarted from the newest round every replica saved its exact state for
    # (the newest published global state, or the one before when a replica was stopped
    # between the publication and its own save), not from scratch
    assert all(killed_at - 1 <= r["resumed_round"] <= killed_at for r in starts)
    assert all(r["step"] == 4 * r["resumed_round"] and r["exact"] for r in starts)
    # every step once per replica: the redone steps replaced the discarded ones
    train = [r for r in records if r["kind"] == "train"]
    for rank in (0, 1):
        assert sorted(r["step"] for r in train if r["replica"] == rank) == list(range(1, 121))
    final_state = json.loads((run / "checkpoints" / "final" / "state.json").read_text())
    assert final_state["round"] == 30 and final_state["step"] == 120
    driver = json.loads((run / "driver.json").read_text())
    assert driver["status"] == "finished" and driver["attempt"] == 2
    # the wall time adds up both attempts, each shown
    first, second = driver["attempts"]
    assert (first["status"], second["status"]) == ("interrupted", "finished")
    assert driver["wall_seconds"] == pytest.approx(first["seconds"] + second["seconds"])
    assert f"over 2 attempts ({first['seconds']:.1f} + {second['seconds']:.1f} s)" in out
