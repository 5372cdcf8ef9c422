"""Channel 2 fused with the output layer inside the trainer (issue 24 item 2).

On a tiny Qwen2 (tied embeddings, float32, CPU) the trainer's loss and every parameter's
gradient with the fused path (the default where it applies) equal the logits path's
(``sdpo_fused=False``) on the same generation batch.

Tolerance: the two paths compute the same function with float32 operations in a different order
(logits tile by tile from the same hidden states, an online log-sum-exp, closed-form gradients
multiplied back through the output layer; TRL's fused LM head for channel 1 instead of our
selective log-softmax). Each float32 sum or dot product of n terms carries a relative error of at
most about log2(n) * 2^-24 of the sum of its terms' magnitudes (pairwise/blocked summation);
with V = 101, H = 32 and a few hundred tokens that is ~1e-6 of the terms' scale, and the
backward passes through two transformer layers more of the same. So the loss agrees to rtol
1e-5, the gradients to rtol 1e-4 with an absolute floor of 1e-6 x the largest gradient entry of
that parameter (entries that are ~0 in one path are rounding noise in the other). The divergence
itself (``loss/sdpo``) can be tiny (1e-4 here: the teacher is the student re-prompted) while each
log-prob it is made of carries an absolute rounding error: a logit is a dot product of H = 32
terms of magnitude ~0.02 (|h| ~ 1, |w| ~ 0.02 at init), so |dz| <= H * 2^-24 * 32 * 0.02 ~ 1e-6,
and KL = <p, log p - log q> moves by at most max |d(log p - log q)| ~ 2e-6 (p sums to 1): an
absolute tolerance of 2e-6 on it. Measured here: loss differences ~1e-7 relative, gradients
~1e-6, ``loss/sdpo`` ~1e-8 absolute.
"""

from __future__ import annotations

import pytest
import torch
from _trainer_helpers import config, generation_batch, loss_and_grads, make_trainer, oracle_store

from composer_replication.models import build_tiny_model, build_tokenizer
from composer_replication.trainer.fused_capture import hidden_state_source


def _assert_grads_close(fused: dict[str, torch.Tensor], plain: dict[str, torch.Tensor]) -> None:
    assert fused.keys() == plain.keys()
    for name, g in plain.items():
        floor = 1e-6 * float(g.abs().max()) + 1e-12
        torch.testing.assert_close(fused[name], g, rtol=1e-4, atol=floor, msg=name)


@pytest.mark.parametrize(
    "knobs",
    [
        # channel 2 alone: channel 1 runs TRL's fused LM head, no (B, T, V) logits at all
        dict(alpha_sdpo=0.5, beta_replay=0.0, sdpo_jsd_beta=0.5),
        # channels 2 and 3: the logits are kept for channel 3 (replay_fused off), channel 2
        # still fused
        dict(
            alpha_sdpo=0.5,
            beta_replay=0.7,
            sdpo_jsd_beta=0.0,
            sdpo_temperature=1.3,
            replay_fused=False,
        ),
        # channels 2 and 3 both fused: no (B, T, V) logits at all
        dict(alpha_sdpo=0.5, beta_replay=0.7, sdpo_jsd_beta=0.0, sdpo_temperature=1.3),
        # reverse KL with the EMA teacher (its own body and head)
        dict(
            alpha_sdpo=1.0,
            beta_replay=0.0,
            sdpo_jsd_beta=1.0,
            sdpo_teacher="ema",
            sdpo_ema_rate=0.5,
        ),
    ],
    ids=["channel2", "channels2and3", "channels2and3_fused", "reverse_ema"],
)
def test_fused_trainer_loss_and_grads_equal_the_logits_path(tmp_path, knobs):
    args = config(tmp_path, beta=0.0)
    fused = make_trainer(tmp_path, store=oracle_store(), args=args, **knobs)
    off = dict(knobs, sdpo_fused=False, replay_fused=False)
    plain = make_trainer(tmp_path, store=oracle_store(), args=args, **off)
    assert fused.channel2_fused and not plain.channel2_fused
    if knobs.get("sdpo_teacher") == "ema":  # a teacher that differs from the student
        with torch.no_grad():
            for t in (fused, plain):
                for p in t.ema_teacher.model.parameters():
                    p.mul_(0.9)
    inputs = generation_batch(fused)
    assert inputs["sdpo_sample_mask"].any()
    # the two trainers hold the same initial model: the same batch serves both
    for t in (fused, plain):
        t._metrics["train"].clear()
    loss_f, grads_f = loss_and_grads(fused, inputs)
    loss_p, grads_p = loss_and_grads(plain, inputs)
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-5, atol=1e-7)
    _assert_grads_close(grads_f, grads_p)
    mf = {k: v[-1] for k, v in fused._metrics["train"].items() if v}
    mp = {k: v[-1] for k, v in plain._metrics["train"].items() if v}
    assert mf["sdpo/active"] == mp["sdpo/active"] == 1.0
    assert mf["loss/sdpo"] == pytest.approx(mp["loss/sdpo"], rel=1e-5, abs=2e-6)
    assert mf["jsd/tokens"] == mp["jsd/tokens"] and mf["jsd/clip_frac"] == mp["jsd/clip_frac"]
    assert mf["loss/grpo"] == pytest.approx(mp["loss/grpo"], rel=1e-5, abs=1e-7)


def test_fused_channel2_alone_builds_no_logits(tmp_path):
    """With channel 3 off the student forward runs TRL's fused LM head and the teacher its body
    only: the output layer's module is never called (no (B, T, V) logits)."""
    trainer = make_trainer(tmp_path, args=config(tmp_path, beta=0.0), alpha_sdpo=0.5, beta_replay=0)
    inputs = generation_batch(trainer)
    head = trainer.model.get_output_embeddings()
    calls = []
    handle = head.register_forward_hook(lambda m, a, out: calls.append(tuple(out.shape)))
    try:
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(trainer.model, inputs)
    finally:
        handle.remove()
    assert calls == []
    assert trainer._metrics["train"]["sdpo/active"] == [1.0]
    loss.backward()
    assert head.weight.grad is not None and float(head.weight.grad.abs().sum()) > 0


def test_fused_path_applies_only_where_it_can(tmp_path):
    trainer = make_trainer(tmp_path, args=config(tmp_path, beta=0.0), alpha_sdpo=0.5, sdpo_top_k=5)
    assert not trainer.channel2_fused  # top-k distillation needs the logits
    trainer = make_trainer(
        tmp_path, args=config(tmp_path, beta=0.0), alpha_sdpo=0.5, sdpo_wrapper="taid", taid_t=0.5
    )
    assert not trainer.channel2_fused
    trainer = make_trainer(tmp_path, args=config(tmp_path, beta=0.0), alpha_sdpo=0.0)
    assert not trainer.channel2_fused  # channel 2 off
    with pytest.raises(ValueError, match="sdpo_fused_backend must be one of"):
        make_trainer(tmp_path, alpha_sdpo=0.5, sdpo_fused_backend="cuda")


def test_hidden_state_source_declines_logit_postprocessing():
    model = build_tiny_model(build_tokenizer(), hidden_size=16, num_layers=1)
    source, why = hidden_state_source(model)
    assert source is not None and why == ""
    assert source.body is model.model and source.head is model.lm_head
    model.config.final_logit_softcapping = 30.0
    assert hidden_state_source(model) == (
        None,
        "the model soft-caps its logits (final_logit_softcapping)",
    )
    model.config.final_logit_softcapping = None
    model.config.logit_scale = 0.5
    source, why = hidden_state_source(model)
    assert source is None and "logit_scale=0.5" in why


# ------------------------------------------------------------------------- channel 3 fused
@pytest.mark.parametrize(
    "knobs",
    [
        dict(dpo_variant="dpo"),
        dict(dpo_variant="simpo"),
        dict(dpo_variant="dpo", rpo_alpha=1.0),
        dict(dpo_variant="simpo", rpo_alpha=0.5),
    ],
    ids=["dpo", "simpo", "dpo_rpo", "simpo_rpo"],
)
def test_fused_channel3_loss_and_grads_equal_the_logits_path(tmp_path, knobs):
    """Channel 3 alone: the fused trainer (hidden states, TRL's fused LM head for channel 1)
    against ``replay_fused=False`` (the logits path) on the same generation batch."""
    args = config(tmp_path, beta=0.0)
    kw = dict(alpha_sdpo=0.0, beta_replay=0.7, **knobs)
    fused = make_trainer(tmp_path, store=oracle_store(), args=args, **kw)
    plain = make_trainer(tmp_path, store=oracle_store(), args=args, replay_fused=False, **kw)
    assert fused.channel3_fused and not plain.channel3_fused
    inputs = generation_batch(fused)
    assert inputs["replay_pair_mask"].any()
    for t in (fused, plain):
        t._metrics["train"].clear()
    loss_f, grads_f = loss_and_grads(fused, inputs)
    loss_p, grads_p = loss_and_grads(plain, inputs)
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-5, atol=1e-7)
    _assert_grads_close(grads_f, grads_p)
    mf = {k: v[-1] for k, v in fused._metrics["train"].items() if v}
    mp = {k: v[-1] for k, v in plain._metrics["train"].items() if v}
    assert mf["replay/active"] == mp["replay/active"] == 1.0
    for key in ("loss/replay", "replay/margin", "replay/chosen_reward", "loss/grpo"):
        assert mf[key] == pytest.approx(mp[key], rel=1e-5, abs=1e-6), key
    assert ("replay/nll" in mf) == bool(knobs.get("rpo_alpha"))
    if "replay/nll" in mf:
        assert mf["replay/nll"] == pytest.approx(mp["replay/nll"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("alpha_sdpo", [0.0, 0.5], ids=["channel3", "channels2and3"])
def test_fused_channel3_builds_no_logits(tmp_path, alpha_sdpo):
    """With channels 2 and 3 fused (or channel 2 off) the policy's output layer is never called
    in the loss step: channel 1 runs TRL's fused LM head, channel 3's chosen side the body."""
    trainer = make_trainer(
        tmp_path,
        store=oracle_store(),
        args=config(tmp_path, beta=0.0),
        alpha_sdpo=alpha_sdpo,
        beta_replay=0.7,
        dpo_variant="simpo",
    )
    inputs = generation_batch(trainer)
    head = trainer.model.get_output_embeddings()
    calls = []
    handle = head.register_forward_hook(lambda m, a, out: calls.append(tuple(out.shape)))
    try:
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(trainer.model, inputs)
    finally:
        handle.remove()
    assert calls == []
    assert trainer._metrics["train"]["replay/active"] == [1.0]
    loss.backward()
    assert head.weight.grad is not None and float(head.weight.grad.abs().sum()) > 0


def test_fused_channel3_applies_only_where_it_can(tmp_path):
    args = config(tmp_path, beta=0.0)
    trainer = make_trainer(tmp_path, store=oracle_store(), args=args, replay_fused=False)
    assert not trainer.channel3_fused
    trainer = make_trainer(tmp_path, store=oracle_store(), args=args, beta_replay=0.0)
    assert not trainer.channel3_fused  # channel 3 off
    trainer = make_trainer(tmp_path, args=args, beta_replay=0.5)
    assert not trainer.channel3_fused  # no trace store: channel 3 off
