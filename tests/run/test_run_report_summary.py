"""The headline numbers of a run: the held-out accuracy's 95 % interval and one line per loss
channel, from the metrics records."""

from __future__ import annotations

import pytest

from composer_replication.run.report import (
    closed_attempts,
    run_wall_seconds,
    summarize,
    wall_text,
    wilson_interval,
)


def test_wilson_interval_matches_the_textbook_values() -> None:
    # Wilson score interval, z = 1.96: 50 of 100 -> 0.4038 - 0.5962; 0 of 10 -> 0 - 0.2775;
    # 9 of 10 -> 0.5958 - 0.9821 (the closed form, worked by hand)
    assert wilson_interval(0.5, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert wilson_interval(0.0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(0.9, 10) == pytest.approx((0.5958, 0.9821), abs=1e-4)


def test_summary_has_the_interval_and_each_loss_channel() -> None:
    records = []
    for replica in (0, 1):
        for step in range(1, 21):
            records.append(
                {
                    "kind": "train",
                    "replica": replica,
                    "step": step,
                    "reward": step / 20,
                    "loss/grpo": -0.01 * step,
                    "loss/sdpo": 0.1,
                    "loss/replay": 2.0 - step / 10,
                }
            )
    records += [
        {"kind": "eval", "replica": 0, "step": 0, "eval/accuracy": 0.0, "eval/n": 256.0},
        {"kind": "eval", "replica": 0, "step": 20, "eval/accuracy": 0.5, "eval/n": 100.0},
    ]
    s = summarize(records)
    assert s["eval_n"] == 100 and s["eval_accuracy_last"] == 0.5
    assert s["eval_accuracy_last_ci95"] == pytest.approx((0.4038, 0.5962), abs=1e-4)
    # first / last 10 % of the 20 steps: steps 1-2 and 19-20, pooled over both replicas
    assert s["loss_grpo_first10"] == pytest.approx(-0.015)
    assert s["loss_grpo_last10"] == pytest.approx(-0.195)
    assert s["loss_sdpo_first10"] == pytest.approx(0.1)
    assert s["loss_replay_last10"] == pytest.approx(2.0 - 1.95)
    # no channel-2 records at all: no channel-2 line
    assert "loss_sdpo_first10" not in summarize([r for r in records if "loss/sdpo" not in r])


def test_one_wall_time_from_the_driver_record() -> None:
    assert run_wall_seconds({"started": 100.0, "ended": 131.25}) == 31.25
    assert run_wall_seconds({"started": 100.0, "ended": None}) is None


def test_wall_time_adds_up_the_attempts_of_a_resumed_run() -> None:
    """Attempt 1 ran 616.2 s and was killed (its last update is its end), attempt 2 ran 34.8 s:
    the run's wall time is 651.0 s, each attempt shown; a finished attempt is counted once."""
    killed = {
        "attempt": 1,
        "status": "running",
        "started": 1000.0,
        "ended": None,
        "updated": 1616.2,
    }
    (first,) = closed_attempts(killed)
    assert first == {
        "attempt": 1,
        "started": 1000.0,
        "ended": 1616.2,
        "seconds": pytest.approx(616.2),
        "status": "running",
    }
    resumed = {
        "attempt": 2,
        "attempts": [first],
        "status": "finished",
        "started": 2000.0,
        "ended": 2034.8,
        "updated": 2030.0,
    }
    assert [a["seconds"] for a in closed_attempts(resumed)] == pytest.approx([616.2, 34.8])
    assert run_wall_seconds(resumed) == pytest.approx(651.0)
    assert wall_text(resumed) == "651.0 s over 2 attempts (616.2 + 34.8 s)"
    recorded = {**resumed, "attempts": closed_attempts(resumed)}
    assert run_wall_seconds(recorded) == pytest.approx(651.0)  # not 685.8
    assert wall_text({"started": 100.0, "ended": 131.25}) == "31.2 s"


def test_the_summary_names_the_device_and_dtypes_each_replica_used(tmp_path) -> None:
    """Each replica logs a ``device`` event (run/replica.device_record); the summary prints one
    line per distinct setup, naming the replicas only when they differ."""
    from composer_replication.config import load_config
    from composer_replication.run.driver import summary_text
    from composer_replication.run.folder import RunFolder
    from composer_replication.run.report import device_lines

    gpu = {
        "kind": "event",
        "event": "device",
        "device": "cuda:0",
        "device_name": "NVIDIA H200",
        "param_dtype": "bfloat16",
        "autocast": "bfloat16",
        "gradient_checkpointing": True,
        "generation": "generate",
    }
    records = [{**gpu, "replica": r, "time": 1.0} for r in (0, 1)]
    line = (
        "cuda:0 (NVIDIA H200), weights bfloat16, autocast bfloat16, gradient checkpointing on, "
        "generation generate"
    )
    assert device_lines(records) == [line]
    assert summarize(records)["devices"] == [line]
    # a replica restarted on a CPU: its latest report counts, and the lines name the replicas
    cpu = {
        **gpu,
        "replica": 1,
        "time": 2.0,
        "device": "cpu",
        "device_name": "",
        "param_dtype": "float32",
        "autocast": "none",
        "gradient_checkpointing": False,
    }
    lines = device_lines([*records, cpu])
    assert lines == [
        f"{line} (replica 0)",
        "cpu, weights float32, autocast none, gradient checkpointing off, generation generate "
        "(replica 1)",
    ]
    text = summary_text(RunFolder(tmp_path / "r"), "finished", {"devices": [line]}, load_config())
    assert text.splitlines()[1] == f"  device           {line}"
    assert "device" not in summary_text(RunFolder(tmp_path / "r"), "finished", {}, load_config())


def test_a_replica_reports_its_trainers_device_and_dtypes(tmp_path) -> None:
    """device_record reads the built trainer: on a CPU the tiny model trains in float32 without
    autocast or recomputation (test_trainer_gpu.py checks the CUDA side)."""
    pytest.importorskip("trl")
    import torch

    from composer_replication.assembly.build import build_model, build_task, build_trainer
    from composer_replication.config import load_config
    from composer_replication.run.replica import device_record

    config = load_config(overrides=["task.n_train=32", "task.n_eval=2", "train.generation=paged"])
    model, tok = build_model(config)
    trainer = build_trainer(
        config,
        model=model,
        tokenizer=tok,
        task=build_task(config),
        max_steps=1,
        seed=0,
        output_dir=str(tmp_path),
    )
    record = device_record(trainer, config.train.generation)
    if torch.cuda.is_available():
        assert record["device"].startswith("cuda") and record["device_name"]
    else:
        assert record == {
            "device": "cpu",
            "device_name": "",
            "param_dtype": "float32",
            "autocast": "none",
            "gradient_checkpointing": False,
            "generation": "paged",
        }


def test_the_out_of_distribution_row_is_reported_beside_the_held_out_one() -> None:
    records = [
        {
            "kind": "eval",
            "replica": 0,
            "step": 0,
            "eval/accuracy": 0.0,
            "eval/n": 256.0,
            "eval/ood_accuracy": 0.0,
            "eval/ood_n": 256.0,
        },
        {
            "kind": "eval",
            "replica": 0,
            "step": 20,
            "eval/accuracy": 0.8,
            "eval/n": 256.0,
            "eval/ood_accuracy": 0.05,
            "eval/ood_n": 256.0,
        },
    ]
    s = summarize(records)
    assert (s["eval_ood_accuracy_first"], s["eval_ood_accuracy_last"], s["eval_ood_n"]) == (
        0.0,
        0.05,
        256,
    )
    assert s["eval_accuracy_last"] == 0.8  # the held-out row is unchanged by it
    # a task without an out-of-distribution split logs no such keys: no row
    plain = [{k: v for k, v in r.items() if "ood" not in k} for r in records]
    assert "eval_ood_accuracy_last" not in summarize(plain)


def test_the_summary_keeps_its_metrics_table_in_one_piece(tmp_path) -> None:
    """The note on rising channel 2/3 losses comes after the table: a paragraph between two
    rows split it in two (the health row then rendered as text)."""
    from composer_replication.run.folder import RunFolder
    from composer_replication.run.report import (
        HEALTH_STATES,
        LOSS_RISE_NOTE,
        losses_rose,
        summary_markdown,
    )

    summary = {
        "loss_sdpo_first10": 0.01,
        "loss_sdpo_last10": 0.3,
        "loss_replay_first10": 0.8,
        "loss_replay_last10": 1.0,
        "health_seconds": {name: 1.0 for name in HEALTH_STATES},
    }
    assert losses_rose(summary)
    text = summary_markdown(RunFolder(tmp_path / "r"), summary, [], {})
    lines = text.splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("|")]
    assert rows == list(range(rows[0], rows[-1] + 1)), "the metrics table is split"
    assert lines[rows[-1]].startswith("| run health")
    assert lines.index(LOSS_RISE_NOTE) > rows[-1]


def test_the_learning_signal_is_in_the_summary_and_the_printout() -> None:
    """Entropy, the share of zero-advantage groups and channel 2's teacher advantage and gate,
    first and last 10% of steps (pooled over replicas), in summary.md's table and the
    end-of-run lines; absent metrics leave no row."""
    from composer_replication.run.report import headline_lines

    records = [
        {
            "kind": "train",
            "replica": replica,
            "step": step,
            "reward": 0.5,
            "entropy": 2.0 if step <= 2 else 0.5,
            "frac_reward_zero_std": 0.0 if step <= 2 else 0.75,
            "sdpo/teacher_advantage": -0.2 if step <= 2 else 0.3,
            "sdpo/gate_open": 0.0 if step <= 2 else 1.0,
        }
        for replica in (0, 1)
        for step in range(1, 21)
    ]
    out = summarize(records)
    assert (out["entropy_first10"], out["entropy_last10"]) == (2.0, 0.5)
    assert (out["zero_std_share_first10"], out["zero_std_share_last10"]) == (0.0, 0.75)
    assert (out["teacher_advantage_first10"], out["teacher_advantage_last10"]) == (-0.2, 0.3)
    # the whole run: 2 of 20 steps at -0.2, 18 at 0.3
    assert out["teacher_advantage_run"] == pytest.approx((2 * -0.2 + 18 * 0.3) / 20)
    assert out["gate_open_last10"] == 1.0 and out["gate_open_run"] == pytest.approx(0.9)
    lines = headline_lines(out)
    (teacher,) = [line for line in lines if "teacher adv." in line]
    assert "-0.200" in teacher and "0.300" in teacher and "gate open in 100%" in teacher
    assert "whole run: 0.250" in teacher
    bare = summarize([{k: v for k, v in r.items() if not k.startswith("sdpo/")} for r in records])
    assert "teacher_advantage_first10" not in bare
    assert not [line for line in headline_lines(bare) if "teacher adv." in line]
