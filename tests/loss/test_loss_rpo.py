"""Channel 3's optional NLL term (``rpo_alpha``, RPO; TRL's ``DPOConfig.rpo_alpha`` and
``CPOConfig.cpo_alpha``): ``replay = preference + rpo_alpha * NLL(chosen)``, the NLL being the
token mean of the cross-entropy over the chosen completions. Checked against an independent
reference: ``F.cross_entropy`` over the chosen tokens (padding ignored), as TRL computes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _loss_tolerance import TOY_N, TOY_OPS, approx, assert_close
from test_loss_batch_format import PAIR_ROWS, _explicit_form, _rollout_form
from test_loss_compose import _run

from composer_replication.loss import ComposeConfig, combine, replay_preference
from composer_replication.loss._channels import replay_nll


def _reference_nll(lm, rollout):
    """TRL's ``policy_nll_loss``: cross-entropy over every chosen token (padding ignored), one
    mean over all of them; computed from the model's logits, not from our log-prob helpers."""
    rows = torch.tensor(PAIR_ROWS)
    P = rollout["prompt_ids"].shape[1]
    ids = rollout["replay_chosen_ids"][rows]
    mask = rollout["replay_chosen_mask"][rows]
    logits = lm(
        torch.cat([rollout["prompt_ids"][rows], ids], 1),
        torch.cat([rollout["prompt_mask"][rows], mask], 1),
    ).logits[:, P - 1 : -1]
    labels = ids.masked_fill(mask == 0, -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.mark.parametrize("form", ["rollout", "explicit"])
@pytest.mark.parametrize("dpo_variant", ["dpo", "simpo"])
def test_rpo_adds_alpha_times_the_token_mean_nll_of_the_chosen_traces(lm, batch, form, dpo_variant):
    rollout = _rollout_form(batch)
    inputs = rollout if form == "rollout" else _explicit_form(rollout)
    kw = dict(alpha_sdpo=0.0, beta_replay=0.7, dpo_variant=dpo_variant)
    alpha = 0.5
    loss0, m0, grads0 = _run(lm, inputs, **kw)
    loss1, m1, grads1 = _run(lm, inputs, rpo_alpha=alpha, **kw)
    assert "replay/nll" not in m0  # rpo_alpha=0: the term does not exist (bit-exact off)

    lm.zero_grad()
    nll = _reference_nll(lm, rollout)
    (0.7 * alpha * nll).backward()
    ref_grads = [p.grad.detach().clone() for p in lm.parameters()]
    # float32 rounding of the toy LM's forward; a difference of two totals is on their scale
    nll = nll.detach()
    assert m1["replay/nll"] == approx(float(nll), n=TOY_N, ops=TOY_OPS)
    scale = abs(float(loss1)) + abs(float(loss0))
    assert_close(loss1 - loss0, 0.7 * alpha * nll.detach(), n=TOY_N, ops=TOY_OPS, scale=scale)
    replay_scale = abs(m1["loss/replay"]) + abs(m0["loss/replay"])
    assert m1["loss/replay"] == approx(
        m0["loss/replay"] + alpha * float(nll), n=TOY_N, ops=TOY_OPS, scale=replay_scale
    )
    for g1, g0, ref in zip(grads1, grads0, ref_grads):
        g_scale = float(torch.maximum(g1.abs().max(), g0.abs().max()))
        assert_close(g1 - g0, ref, n=TOY_N, ops=TOY_OPS, scale=g_scale)


def test_nll_is_a_token_mean_not_a_mean_of_sequence_means():
    """Two chosen traces of 1 and 3 tokens: -(sum of all 4 log-probs) / 4, whatever form."""
    sums = torch.tensor([-1.0, -6.0])
    tokens = torch.tensor([1, 3])
    assert float(replay_nll(sums, tokens, summed=True)) == pytest.approx(7.0 / 4)
    means = sums / tokens
    assert float(replay_nll(means, tokens, summed=False)) == pytest.approx(7.0 / 4)
    assert float(replay_nll(sums[:0], tokens[:0], summed=True)) == 0.0  # no pair: 0, not NaN


def test_combine_takes_chosen_lengths_and_names_them_when_missing():
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(2, 5, generator=g)
    mask = torch.ones(2, 5)
    adv = torch.tensor([1.0, -1.0])
    chosen = -torch.rand(3, generator=g) * 5
    rejected = -torch.rand(3, generator=g) * 5
    lengths = torch.tensor([2, 4, 3])
    common = dict(
        per_token_logps=lp,
        completion_mask=mask,
        advantages=adv,
        chosen_avg_logps=chosen / lengths,
        rejected_avg_logps=rejected / lengths,
        dpo_variant="simpo",
        beta_replay=1.0,
        alpha_sdpo=0.0,
    )
    base, _ = combine(**common)
    with_nll, m = combine(**common, rpo_alpha=2.0, chosen_lengths=lengths)
    expected = 2.0 * float(-chosen.sum() / lengths.sum())
    assert float(with_nll - base) == pytest.approx(expected, rel=1e-6)
    assert m["replay/nll"] == pytest.approx(float(-chosen.sum() / lengths.sum()), rel=1e-6)
    with pytest.raises(ValueError, match="rpo_alpha=2.0 needs 'chosen_lengths'"):
        combine(**common, rpo_alpha=2.0)
    with pytest.raises(ValueError, match="chosen_tokens has shape"):
        combine(**common, rpo_alpha=2.0, chosen_lengths=lengths[:2])


def test_replay_preference_rejects_negative_alpha_and_counts():
    with pytest.raises(ValueError, match="rpo_alpha must be in"):
        ComposeConfig(rpo_alpha=-1.0)
    cfg = ComposeConfig(rpo_alpha=1.0, dpo_variant="simpo")
    x = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="chosen_tokens must be >= 0"):
        replay_preference(cfg, x, x, None, None, ("a", "b"), torch.tensor([-2]))
