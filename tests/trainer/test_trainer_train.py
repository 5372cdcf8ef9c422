"""A real train() run with TRL's multi-step machinery: num_iterations, accumulation, KL."""

from __future__ import annotations

import math

from _trainer_helpers import G, config, make_trainer, oracle_store


def test_train_with_num_iterations_accumulation_and_kl(tmp_path):
    args = config(
        tmp_path,
        per_device_train_batch_size=G,  # one prompt group per micro-batch
        gradient_accumulation_steps=2,
        num_iterations=2,
        loss_type="grpo",
        beta=0.04,  # KL reference = frozen copy of the in-memory model
        max_steps=2,
    )
    trainer = make_trainer(
        tmp_path, store=oracle_store(), args=args, alpha_sdpo=0.5, beta_replay=0.5
    )
    assert trainer.ref_model is not None and trainer.replay_reference is trainer.ref_model
    trainer.train()
    # 2 optimizer steps x 2 micro-batches, all from ONE generation batch reused twice.
    assert trainer._step == 4
    buffered = trainer._buffered_inputs
    assert len(buffered) == 2 and "old_per_token_logps" in buffered[0]
    assert "sdpo_teacher_input_ids" in buffered[0] and "replay_pair_mask" in buffered[0]
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["loss"]) and row["kl"] is not None
        assert row["sdpo/active"] > 0 and row["replay/active"] > 0
        assert row["loss/sdpo"] > 0 and row["loss/replay"] > 0
