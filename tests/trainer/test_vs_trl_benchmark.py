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


def test_trl_trainers_get_the_same_settings_as_ours(tmp_path):
    """What the docs claim for the comparison: TRL's GRPO and SDPO configs carry our run's
    optimizer, batch and generation settings and channel 1, and SDPO's distillation is our
    channel 2's (weight ratio alpha : 1, the same JSD, a live teacher, threshold 0.5)."""
    pytest.importorskip("trl")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import vs_trl
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from trl import GRPOConfig

    from composer_replication.assembly.build import channel1_args, trainer_args, trl_training_args
    from composer_replication.config import load_config

    config = load_config(overrides=["loss.alpha_sdpo=0.25", "loss.sdpo_jsd_beta=0.3"])
    ours = trainer_args(config, str(tmp_path), 50, 7)
    common = trl_training_args(config, str(tmp_path), 50, 7)
    grpo = GRPOConfig(**common, **channel1_args(config))
    sdpo = vs_trl._trl_sdpo_args(config, common)
    shared = ("learning_rate", "lr_scheduler_type", "max_grad_norm", "per_device_train_batch_size",
              "gradient_accumulation_steps", "num_generations", "max_completion_length",
              "temperature", "seed", "max_steps", "loss_type", "epsilon", "beta",
              "scale_rewards", "num_iterations", "top_k", "top_p")  # fmt: skip
    for name in shared:
        assert getattr(grpo, name) == getattr(ours, name), name
        assert getattr(sdpo, name) == getattr(ours, name), name
    # epsilon_high unset means epsilon: GRPO's trainer resolves it, SDPOConfig already did
    assert ours.epsilon_high is None and grpo.epsilon_high is None
    assert sdpo.epsilon_high == ours.epsilon
    assert ours.num_generations == 2 and ours.per_device_train_batch_size == 32  # the default
    # (1 - w) * policy + w * distill  ==  (policy + alpha * distill) / (1 + alpha)
    w = sdpo.distillation_weight
    # float64: alpha / (1 + alpha), then 1 - w and the quotient: four roundings of 2**-53
    assert w / (1 - w) == pytest.approx(0.25, rel=4 * 2.0**-53, abs=0)
    assert sdpo.distillation_alpha == 0.3 and sdpo.distillation_mode == "full_logits"
    assert sdpo.teacher_model_kind == "live" and sdpo.success_reward_threshold == 0.5
    assert sdpo.include_environment_feedback is False and sdpo.distillation_is_clip is None
    with pytest.raises(ValueError, match="sdpo_wrapper"):
        vs_trl._trl_sdpo_args(load_config(overrides=["loss.sdpo_wrapper=entropy_opd"]), common)
