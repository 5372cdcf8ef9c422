"""The headline numbers of a run: the held-out accuracy's 95 % interval and one line per loss
channel, from the metrics records."""

from __future__ import annotations

import pytest

from composer_replication.run.report import run_wall_seconds, summarize, wilson_interval


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
            records.append({"kind": "train", "replica": replica, "step": step, "reward": step / 20,
                            "loss/grpo": -0.01 * step, "loss/sdpo": 0.1, "loss/replay": 2.0 - step / 10})  # fmt: skip
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


def test_the_out_of_distribution_row_is_reported_beside_the_held_out_one() -> None:
    records = [
        {"kind": "eval", "replica": 0, "step": 0, "eval/accuracy": 0.0, "eval/n": 256.0,
         "eval/ood_accuracy": 0.0, "eval/ood_n": 256.0},
        {"kind": "eval", "replica": 0, "step": 20, "eval/accuracy": 0.8, "eval/n": 256.0,
         "eval/ood_accuracy": 0.05, "eval/ood_n": 256.0},
    ]  # fmt: skip
    s = summarize(records)
    assert (s["eval_ood_accuracy_first"], s["eval_ood_accuracy_last"], s["eval_ood_n"]) == (
        0.0, 0.05, 256,
    )  # fmt: skip
    assert s["eval_accuracy_last"] == 0.8  # the held-out row is unchanged by it
    # a task without an out-of-distribution split logs no such keys: no row
    plain = [{k: v for k, v in r.items() if "ood" not in k} for r in records]
    assert "eval_ood_accuracy_last" not in summarize(plain)
