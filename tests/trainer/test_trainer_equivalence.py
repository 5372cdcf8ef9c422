"""Channels 2 and 3 off: ComposerReplicationTrainer is GRPOTrainer, bit for bit, per loss_type.

And the logits-capturing student forward (used when channels 2/3 are on) gives channel 1 the
same loss and gradients as TRL's fused log-prob head, within float tolerance.
"""

from __future__ import annotations

import pytest
import torch
from _trainer_helpers import config, generation_batch, loss_and_grads, make_trainer, plain_reward
from trl import GRPOTrainer

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_channels_off_equals_grpo_trainer(tmp_path, loss_type):
    args = dict(loss_type=loss_type, beta=0.04)
    composer = make_trainer(
        tmp_path,
        reward=plain_reward,
        args=config(tmp_path, **args),
        alpha_sdpo=0.0,
        beta_replay=0.0,
    )
    plain = make_trainer(
        tmp_path,
        reward=plain_reward,
        args=config(tmp_path, **args),
        cls=GRPOTrainer,
        save_to=tmp_path / "ref",
    )
    inputs = generation_batch(composer)
    assert inputs["advantages"].abs().sum() > 0  # the policy term is really exercised
    assert not any(k.startswith(("sdpo_", "replay_")) for k in inputs)
    loss_c, grads_c = loss_and_grads(composer, inputs)
    loss_p, grads_p = loss_and_grads(plain, inputs)
    assert torch.equal(loss_c, loss_p)
    assert grads_c.keys() == grads_p.keys() and grads_c
    for name in grads_c:
        assert torch.equal(grads_c[name], grads_p[name]), name

    # The capture path (one plain forward, logits kept for channels 2/3) vs TRL's fused head.
    capturing = make_trainer(
        tmp_path, reward=plain_reward, args=config(tmp_path, **args), alpha_sdpo=0.1
    )
    capturing.model.zero_grad(set_to_none=True)
    capturing._capture_logits = True
    loss_k = GRPOTrainer._compute_loss(capturing, capturing.model, inputs)
    assert capturing._captured_logits is not None and not capturing._capture_logits
    loss_k.backward()
    torch.testing.assert_close(loss_k.detach(), loss_p, rtol=1e-5, atol=1e-6)
    for name, param in capturing.model.named_parameters():
        torch.testing.assert_close(param.grad, grads_p[name], rtol=1e-4, atol=1e-6)
