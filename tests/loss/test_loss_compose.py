"""compose_loss / combine: the batch contract, channel switching and the DESIGN invariants."""

from __future__ import annotations

import math

import pytest
import torch
from _loss_tolerance import TOY_N, TOY_OPS, approx, assert_close, bound

import composer_replication
from composer_replication.loss import (
    assemble,
    combine,
    compose_loss,
    dpo_loss,
    generalized_jsd,
    grpo_loss,
)
from composer_replication.loss.compose import REPLAY_KEYS

CONTRACT_METRICS = {
    "loss/total",
    "loss/grpo",
    "loss/sdpo",
    "loss/replay",
    "sdpo/active",
    "sdpo/frac_samples",
    "replay/active",
    "replay/pairs",
    "replay/accuracy",
    "replay/margin",
    "replay/chosen_reward",
    "replay/rejected_reward",
    "grpo/clip_ratio",
}


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


def _run(model, inputs, **kw):
    model.zero_grad()
    loss, metrics = compose_loss(model, inputs, **kw)
    loss.backward()
    return loss.detach(), metrics, _grads(model)


def _without(batch, prefix):
    return {k: v for k, v in batch.items() if not k.startswith(prefix)}


def test_public_reexports():
    assert composer_replication.compose_loss is compose_loss
    import composer_replication.loss as loss_pkg

    assert loss_pkg.compose_loss is compose_loss


def test_alpha_sdpo_zero_is_channel1_bit_exact(lm, batch):
    ref_loss, _, ref_grads = _run(lm, _without(batch, "sdpo_"), beta_replay=0.0)
    lm.calls.clear()
    loss, metrics, grads = _run(lm, batch, alpha_sdpo=0.0, beta_replay=0.0)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert len(lm.calls) == 1  # the teacher forward is not even run
    assert metrics["sdpo/active"] == 0.0 and metrics["loss/sdpo"] == 0.0
    # and it is exactly grpo_loss on the completion log-probs
    logits = lm(
        torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
        torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
    ).logits[:, batch["prompt_ids"].shape[1] - 1 : -1]
    logps = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][..., None])[..., 0]
    direct, _ = grpo_loss(logps, None, batch["advantages"], batch["completion_mask"])
    # the toy LM's float32 budget (_loss_tolerance.TOY_*), on the scale of the advantages
    assert_close(loss, direct, n=TOY_N, ops=TOY_OPS, scale=float(batch["advantages"].abs().max()))


def test_beta_replay_zero_bit_exact(lm, batch):
    ref_loss, _, ref_grads = _run(lm, _without(batch, "replay_"), alpha_sdpo=0.3)
    lm.calls.clear()
    loss, metrics, grads = _run(lm, batch, alpha_sdpo=0.3, beta_replay=0.0)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert len(lm.calls) == 2  # student + teacher, no replay forwards
    assert metrics["replay/active"] == 0.0 and metrics["replay/pairs"] == 0.0


def test_taid_without_t_or_step_raises(lm, batch):
    with pytest.raises(ValueError, match="taid_t"):
        compose_loss(lm, batch, sdpo_wrapper="taid")
    with pytest.raises(ValueError, match="taid_total_steps"):
        compose_loss(lm, batch, sdpo_wrapper="taid", taid_schedule_step=3)


def test_compose_equals_forward_plus_combine(lm, batch):
    """The documented contract: one student forward on cat(prompt, completion), logits[:, P-1:-1],
    temperature for channel-1 log-probs, teacher logits[:, L-T-1:-1] under no_grad, replay labels
    shifted by one; then combine()."""
    kw = dict(temperature=0.7, alpha_sdpo=0.3, beta_replay=0.2, sdpo_temperature=1.3, kl_beta=0.0)
    lm.calls.clear()
    loss, metrics, grads = _run(lm, batch, **kw)
    assert lm.calls[0] == ((3, 9), True)  # ONE student forward on P + T tokens
    assert lm.calls[1] == ((2, 9), False)  # teacher: selected rows only, no grad
    assert [c[1] for c in lm.calls[2:]] == [True, True]  # chosen, rejected

    P, T = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    lm.zero_grad()
    logits = lm(
        torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
        torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
    ).logits
    student = logits[:, P - 1 : -1]
    logps = torch.log_softmax(student / 0.7, -1).gather(-1, batch["completion_ids"][..., None])[
        ..., 0
    ]
    L = batch["sdpo_teacher_input_ids"].shape[1]
    with torch.no_grad():
        teacher = lm(batch["sdpo_teacher_input_ids"], batch["sdpo_teacher_attention_mask"]).logits
    teacher = teacher[:, L - T - 1 : -1]

    def seq_logps(side):
        ids = batch[f"replay_{side}_input_ids"]
        lg = lm(ids, batch[f"replay_{side}_attention_mask"]).logits[:, :-1]
        tok = torch.log_softmax(lg, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return (tok * batch[f"replay_{side}_loss_mask"][:, 1:]).sum(-1)

    ref_loss, ref_metrics = combine(
        per_token_logps=logps,
        completion_mask=batch["completion_mask"],
        advantages=batch["advantages"],
        student_logits=student,
        teacher_logits=teacher,
        sdpo_mask=batch["sdpo_sample_mask"],
        chosen_logps=seq_logps("chosen"),
        rejected_logps=seq_logps("rejected"),
        ref_chosen_logps=batch["replay_ref_chosen_logps"],
        ref_rejected_logps=batch["replay_ref_rejected_logps"],
        **kw,
    )
    ref_loss.backward()
    # the same formulas on the same forwards, another path: the toy LM's float32 budget, each
    # value on its own scale (a gradient: its largest entry; a loss: the channels it sums)
    scale = sum(abs(ref_metrics[k]) for k in ("loss/grpo", "loss/sdpo", "loss/replay"))
    assert_close(loss, ref_loss, n=TOY_N, ops=TOY_OPS, scale=scale)
    for a, b in zip(grads, _grads(lm)):
        assert_close(a, b, n=TOY_N, ops=TOY_OPS)
    for key in CONTRACT_METRICS:
        size = max(abs(ref_metrics[key]), scale)
        assert metrics[key] == approx(ref_metrics[key], n=TOY_N, ops=TOY_OPS, scale=size), key
    assert metrics["sdpo/active"] == 1.0 and metrics["replay/active"] == 1.0
    assert metrics["sdpo/frac_samples"] == approx(2 / 3, n=3, ops=1)  # a float32 mean of 3 bools
    assert metrics["replay/pairs"] == 2.0
    assert all(isinstance(v, float) for v in metrics.values())
    assert CONTRACT_METRICS <= set(metrics)
    total = metrics["loss/grpo"] + 0.3 * metrics["loss/sdpo"] + 0.2 * metrics["loss/replay"]
    # float32 total vs the float64 sum of its float32 terms: a few roundings on the terms' scale
    assert metrics["loss/total"] == approx(total, n=3, ops=4, scale=scale)


def test_sdpo_channel_value_is_generalized_jsd(lm, batch):
    loss_on, m_on, _ = _run(lm, batch, alpha_sdpo=0.5, beta_replay=0.0, sdpo_jsd_beta=0.2)
    loss_off, _, _ = _run(lm, batch, alpha_sdpo=0.0, beta_replay=0.0)
    # loss_on = grpo + 0.5 * sdpo in float32: the sum rounds on the scale of loss_on
    assert float(loss_on - loss_off) == approx(
        0.5 * m_on["loss/sdpo"], n=2, ops=3, scale=abs(float(loss_on)) + abs(float(loss_off))
    )
    assert m_on["jsd/tokens"] == float(
        (batch["completion_mask"].bool() & batch["sdpo_sample_mask"][:, None]).sum()
    )


def test_sdpo_off_when_no_sample_selected(lm, batch):
    batch["sdpo_sample_mask"] = torch.zeros(3, dtype=torch.bool)
    ref, _, _ = _run(lm, batch, alpha_sdpo=0.0)
    lm.calls.clear()
    loss, metrics, _ = _run(lm, batch, alpha_sdpo=0.5)
    assert torch.equal(loss, ref)
    assert metrics["sdpo/active"] == 0.0 and metrics["sdpo/frac_samples"] == 0.0
    assert all(shape != (3, 9) or grad for shape, grad in lm.calls)  # no teacher forward
    assert len(lm.calls) == 3


def test_precomputed_teacher_logits_replace_teacher_forward(lm, batch):
    _, m_fwd, _ = _run(lm, batch, beta_replay=0.0)
    T = batch["completion_ids"].shape[1]
    L = batch["sdpo_teacher_input_ids"].shape[1]
    with torch.no_grad():
        full = lm(batch["sdpo_teacher_input_ids"], batch["sdpo_teacher_attention_mask"]).logits
    pre = {k: v for k, v in batch.items() if not k.startswith("sdpo_teacher_")}
    pre["sdpo_teacher_logits"] = full[:, L - T - 1 : -1]
    lm.calls.clear()
    _, m_pre, _ = _run(lm, pre, beta_replay=0.0)
    assert len(lm.calls) == 1
    # the same teacher logits (one forward here, trimmed columns there): the toy budget
    assert m_pre["loss/sdpo"] == approx(m_fwd["loss/sdpo"], n=TOY_N, ops=TOY_OPS)


def test_replay_off_when_absent_or_empty(lm, batch):
    _, m, _ = _run(lm, _without(batch, "replay_"), alpha_sdpo=0.0)
    assert m["replay/active"] == 0.0
    empty = dict(batch)
    for key in REPLAY_KEYS:
        empty[key] = batch[key][:0]
    empty["replay_ref_chosen_logps"] = batch["replay_ref_chosen_logps"][:0]
    empty["replay_ref_rejected_logps"] = batch["replay_ref_rejected_logps"][:0]
    loss, m, _ = _run(lm, empty, alpha_sdpo=0.0)
    ref, _, _ = _run(lm, batch, alpha_sdpo=0.0, beta_replay=0.0)
    assert m["replay/active"] == 0.0 and torch.equal(loss, ref)


def test_dpo_without_reference_logps_raises_naming_keys(lm, batch):
    del batch["replay_ref_chosen_logps"]
    with pytest.raises(ValueError, match="replay_ref_chosen_logps"):
        compose_loss(lm, batch)
    # SimPO needs no reference
    loss, m = compose_loss(lm, batch, dpo_variant="simpo")
    assert m["replay/active"] == 1.0 and math.isfinite(float(loss.detach()))


def test_simpo_channel_uses_length_normalised_logps(lm, batch):
    kw = dict(alpha_sdpo=0.0, dpo_variant="simpo", simpo_beta=2.0, simpo_gamma=0.5, beta_replay=1.0)
    _, m, _ = _run(lm, batch, **kw)

    def avg(side):
        ids = batch[f"replay_{side}_input_ids"]
        lg = lm(ids, batch[f"replay_{side}_attention_mask"]).logits[:, :-1]
        tok = torch.log_softmax(lg, -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = batch[f"replay_{side}_loss_mask"][:, 1:]
        return (tok * mask).sum(-1) / mask.sum(-1)

    with torch.no_grad():
        expected = -torch.nn.functional.logsigmoid(2.0 * (avg("chosen") - avg("rejected")) - 0.5)
    assert m["loss/replay"] == approx(float(expected.mean()), n=TOY_N, ops=TOY_OPS)


def test_taid_schedule_step_sets_linear_t(lm, batch):
    _, m, _ = _run(lm, batch, sdpo_wrapper="taid", taid_schedule_step=25, taid_total_steps=100)
    t_tol = bound(torch.float64, n=1, ops=4, scale=1)  # python floats: t0 + (t1 - t0) * s / n
    assert m["taid/t"] == pytest.approx(0.4 + 0.6 * 0.25, abs=t_tol)
    _, m, _ = _run(
        lm, batch, sdpo_wrapper="taid", taid_t=0.9, taid_schedule_step=1, taid_total_steps=2
    )
    assert m["taid/t"] == 0.9  # explicit t wins, unchanged


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"sdpo_wrapper": "bogus"}, "sdpo_wrapper"),
        ({"dpo_variant": "ipo"}, "dpo_variant"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"sdpo_jsd_beta": 1.5}, "sdpo_jsd_beta"),
        ({"taid_t": 1.2, "sdpo_wrapper": "taid"}, "taid_t"),
        ({"label_smoothing": 0.5}, "label_smoothing"),
        ({"replay_dpo_beta": 0.0}, "replay_dpo_beta"),
        ({"temperature": 0.0}, "temperature"),
        ({"alpha_sdpo": float("nan")}, "alpha_sdpo"),
        ({"not_a_knob": 1}, "not_a_knob"),
    ],
)
def test_bad_keywords_raise_naming_argument(lm, batch, kw, name):
    with pytest.raises(ValueError, match=name):
        compose_loss(lm, batch, **kw)
    with pytest.raises(ValueError, match=name):
        combine(
            per_token_logps=torch.zeros(2, 3),
            completion_mask=torch.ones(2, 3),
            advantages=torch.zeros(2),
            **kw,
        )


def test_missing_channel1_key_raises(lm, batch):
    del batch["advantages"]
    with pytest.raises(ValueError, match="advantages"):
        compose_loss(lm, batch)


def test_combine_sdpo_token_mask_and_off_switches():
    g = torch.Generator().manual_seed(3)
    B, T, V = 2, 4, 6
    student = torch.randn(B, T, V, generator=g, requires_grad=True)
    teacher = torch.randn(B, T, V, generator=g)
    logps = torch.log_softmax(student, -1)[..., 0]
    mask = torch.ones(B, T)
    base = dict(per_token_logps=logps, completion_mask=mask, advantages=torch.tensor([1.0, -1.0]))
    loss, m = combine(**base, student_logits=student, teacher_logits=teacher, alpha_sdpo=1.0)
    jsd, _ = generalized_jsd(student, teacher)
    assert m["loss/sdpo"] == float(jsd.detach())  # the same call: the same bits
    token_mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    _, m2 = combine(**base, student_logits=student, teacher_logits=teacher, sdpo_mask=token_mask)
    jsd2, _ = generalized_jsd(student, teacher, mask=token_mask)
    assert m2["loss/sdpo"] == float(jsd2.detach())
    assert m2["sdpo/frac_samples"] == 0.5
    _, m3 = combine(**base, student_logits=student, teacher_logits=None)
    assert m3["sdpo/active"] == 0.0
    with pytest.raises(ValueError, match="sdpo_mask"):
        combine(**base, student_logits=student, teacher_logits=teacher, sdpo_mask=torch.ones(3))


def test_assemble_is_the_one_total():
    """``assemble`` on the channels' own results gives combine's total bit for bit (the trainer
    and the recipes form their totals with it), ``metrics=False`` the same tensor, and a channel
    that is off adds nothing at all."""
    g = torch.Generator().manual_seed(4)
    B, T, V = 2, 4, 6
    student = torch.randn(B, T, V, generator=g, requires_grad=True)
    teacher = torch.randn(B, T, V, generator=g)
    logps = torch.log_softmax(student, -1)[..., 0]
    mask = torch.ones(B, T)
    adv = torch.tensor([1.0, -0.5])
    chosen, rejected = torch.tensor([-3.0, -4.0]), torch.tensor([-5.0, -3.5])
    ref_c, ref_r = torch.tensor([-3.5, -4.2]), torch.tensor([-4.0, -3.0])
    knobs = dict(alpha_sdpo=0.3, beta_replay=0.2, sdpo_jsd_beta=0.4, replay_dpo_beta=0.1)
    total, metrics = combine(
        per_token_logps=logps,
        completion_mask=mask,
        advantages=adv,
        student_logits=student,
        teacher_logits=teacher,
        chosen_logps=chosen,
        rejected_logps=rejected,
        ref_chosen_logps=ref_c,
        ref_rejected_logps=ref_r,
        **knobs,
    )
    grpo = grpo_loss(logps, None, adv, mask, loss_type="dapo", epsilon_low=0.2)
    sdpo_loss, sdpo_m = generalized_jsd(student, teacher, beta=0.4)
    sdpo = (sdpo_loss, {**sdpo_m, "loss/sdpo": float(sdpo_loss.detach())})
    replay_loss, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.1)
    replay = (replay_loss, {"loss/replay": float(replay_loss.detach())})
    ours, ours_m = assemble(grpo, sdpo, replay, **knobs)
    assert torch.equal(ours, total)  # the same operations in the same order: bit-exact
    assert ours_m["loss/total"] == metrics["loss/total"] and ours_m["sdpo/active"] == 1.0
    bare, empty = assemble(grpo, sdpo, replay, metrics=False, **knobs)
    assert torch.equal(bare, total) and empty == {}
    off, off_m = assemble(grpo, None, None, **knobs)
    assert torch.equal(off, grpo[0]) and off_m["sdpo/active"] == off_m["replay/active"] == 0.0
    # combine with a channel 2 computed by the caller (recipes/verl's sampled-token form)
    given, given_m = combine(
        per_token_logps=logps,
        completion_mask=mask,
        advantages=adv,
        sdpo_result=sdpo,
        chosen_logps=chosen,
        rejected_logps=rejected,
        ref_chosen_logps=ref_c,
        ref_rejected_logps=ref_r,
        **knobs,
    )
    assert torch.equal(given, total) and given_m["sdpo/active"] == 1.0
    with pytest.raises(ValueError, match="not both"):
        combine(
            per_token_logps=logps,
            completion_mask=mask,
            advantages=adv,
            sdpo_result=sdpo,
            student_logits=student,
            teacher_logits=teacher,
        )


def test_end_to_end_tiny_qwen2_model(make_batch_fn):
    pytest.importorskip("transformers")
    from composer_replication.models import build_tiny_model, build_tokenizer

    model = build_tiny_model(build_tokenizer(), hidden_size=32, num_layers=1, seed=0)
    batch = make_batch_fn(vocab=model.config.vocab_size)
    for kw in ({}, {"sdpo_wrapper": "taid", "taid_t": 0.5, "dpo_variant": "simpo"}):
        model.zero_grad()
        loss, metrics = compose_loss(model, batch, **kw)
        loss.backward()
        assert metrics["sdpo/active"] == 1.0 and metrics["replay/active"] == 1.0
        assert math.isfinite(metrics["loss/total"])
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        assert any(float(g.abs().sum()) > 0 for g in grads)


def test_partial_channel_keys_raise_naming_the_missing_key(lm, batch):
    no_mask = {k: v for k, v in batch.items() if k != "sdpo_sample_mask"}
    with pytest.raises(ValueError, match="sdpo_sample_mask"):
        compose_loss(lm, no_mask)
    no_attn = {k: v for k, v in batch.items() if k != "sdpo_teacher_attention_mask"}
    with pytest.raises(ValueError, match="sdpo_teacher_attention_mask"):
        compose_loss(lm, no_attn)
    partial = {k: v for k, v in batch.items() if k != "replay_rejected_loss_mask"}
    with pytest.raises(ValueError, match="replay_rejected_loss_mask"):
        compose_loss(lm, partial)
    short = dict(batch, sdpo_teacher_input_ids=batch["sdpo_teacher_input_ids"][:, :5])
    short["sdpo_teacher_attention_mask"] = batch["sdpo_teacher_attention_mask"][:, :5]
    with pytest.raises(ValueError, match="L > T"):
        compose_loss(lm, short)
    # with the channel weight at 0 the channel's keys are not read at all
    compose_loss(lm, no_mask, alpha_sdpo=0.0)
    compose_loss(lm, partial, beta_replay=0.0)


def test_selective_log_softmax_matches_log_softmax_and_gradcheck():
    from composer_replication.loss._logprobs import selective_log_softmax

    g = torch.Generator().manual_seed(5)
    full = torch.randn(2, 7, 9, generator=g, dtype=torch.float64, requires_grad=True)
    logits = full[:, 1:-1]  # non-contiguous, as logits[:, P-1:-1]
    ids = torch.randint(0, 9, (2, 5), generator=g)
    ours = selective_log_softmax(logits, ids, 0.7)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[..., None])[..., 0]
    # float64: a 9-term log-sum-exp and a few element-wise operations, on the logits' scale
    assert_close(ours, ref, n=9, ops=6, scale=float(logits.detach().abs().max()) / 0.7 + 3)
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x[:, 1:-1], ids, 0.7), (full,))
    bf16 = selective_log_softmax(logits.detach().to(torch.bfloat16), ids)
    assert bf16.dtype == torch.float32  # log-probs come back in fp32 for low-precision logits
