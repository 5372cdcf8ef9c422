"""`ComposerReplicationTrainer.set_loss_probe`: the loss terms a probe sees before backward."""

from __future__ import annotations

import torch
from _trainer_helpers import config, generation_batch, make_trainer, oracle_store


def _probed_step(trainer):
    inputs = generation_batch(trainer)
    seen: list[dict] = []
    grads: dict[str, list[torch.Tensor]] = {}
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def probe(terms):
        seen.append({k: None if v is None else v.detach().clone() for k, v in terms.items()})
        # a probe may differentiate the terms (retain_graph) without disturbing the real step
        grads["total"] = list(
            torch.autograd.grad(terms["total"], params, retain_graph=True, allow_unused=True)
        )

    trainer.set_loss_probe(probe)
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), seen, grads["total"], params


def test_probe_sees_every_channel_term_and_their_sum(tmp_path):
    trainer = make_trainer(
        tmp_path,
        args=config(tmp_path, beta=0.0),
        store=oracle_store(),
        alpha_sdpo=0.5,
        beta_replay=2.0,
        dpo_variant="simpo",
    )
    loss, seen, total_grads, params = _probed_step(trainer)
    assert len(seen) == 1
    terms = seen[0]
    assert terms["sdpo"] is not None and terms["replay"] is not None
    assert torch.equal(terms["total"], loss)
    # the trainer adds the terms in this order: the same two roundings, exact
    assert torch.equal(terms["grpo"] + terms["sdpo"] + terms["replay"], loss)
    # the probe's gradient of the total is the gradient the optimizer then gets: the same
    # graph differentiated twice, the same kernels in the same order, exact
    for g, p in zip(total_grads, params, strict=True):
        expected = torch.zeros_like(p) if p.grad is None else p.grad
        assert torch.equal(torch.zeros_like(p) if g is None else g, expected)
    # the terms carry their weights: channel 3 at beta 2.0 is twice channel 3 at beta 1.0
    trainer1 = make_trainer(
        tmp_path,
        args=config(tmp_path, beta=0.0),
        store=oracle_store(),
        alpha_sdpo=0.5,
        beta_replay=1.0,
        dpo_variant="simpo",
    )
    _, seen1, _, _ = _probed_step(trainer1)
    # same seed, batch and arithmetic; the weight multiplies the same value and 2.0 is exact
    assert torch.equal(seen1[0]["replay"] * 2.0, terms["replay"])
    assert torch.equal(seen1[0]["sdpo"], terms["sdpo"])


def test_probe_gets_none_for_a_channel_that_is_off(tmp_path):
    trainer = make_trainer(
        tmp_path, args=config(tmp_path, beta=0.0), alpha_sdpo=0.0, beta_replay=0.0
    )
    loss, seen, _, _ = _probed_step(trainer)
    assert seen[0]["sdpo"] is None and seen[0]["replay"] is None
    assert torch.equal(seen[0]["grpo"], loss) and torch.equal(seen[0]["total"], loss)
    trainer.set_loss_probe(None)
    trainer.compute_loss(trainer.model, generation_batch(trainer))
    assert len(seen) == 1  # removed
