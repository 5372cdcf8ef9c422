"""The one composer batch (docs/api.md) as trainers use it: rollout pairs, global normalisers,
the public per-channel terms and the log-prob helpers."""

from __future__ import annotations

import pytest
import torch
from _loss_tolerance import TOY_N, TOY_OPS, approx, assert_close
from test_loss_compose import _grads, _run

from composer_replication.loss import (
    completion_logps,
    compose_loss,
    replay_term,
    sdpo_term,
    selective_log_softmax,
)
from composer_replication.loss.compose import REPLAY_KEYS

PAIR_ROWS = [0, 2]


def _rollout_form(batch, chosen_len=4, seed=7):
    """``batch`` with channel 3 as rollout pairs on PAIR_ROWS (rejected = the row's rollout)."""
    g = torch.Generator().manual_seed(seed)
    B = batch["completion_ids"].shape[0]
    out = {k: v for k, v in batch.items() if not k.startswith("replay_")}
    pair_mask = torch.zeros(B, dtype=torch.bool)
    pair_mask[PAIR_ROWS] = True
    chosen = torch.randint(0, 11, (B, chosen_len), generator=g)
    chosen_mask = torch.ones(B, chosen_len, dtype=torch.long)
    chosen_mask[2, chosen_len - 1 :] = 0  # right padding
    out.update(
        replay_pair_mask=pair_mask,
        replay_chosen_ids=chosen,
        replay_chosen_mask=chosen_mask,
        replay_ref_chosen_logps=-torch.rand(B, generator=g) * 10,
        replay_ref_rejected_logps=-torch.rand(B, generator=g) * 10,
    )
    return out


def _explicit_form(rollout):
    """The same pairs written out as full sequences (explicit-pairs form)."""
    rows = torch.tensor(PAIR_ROWS)
    p_ids, p_mask = rollout["prompt_ids"][rows], rollout["prompt_mask"][rows]
    out = {k: v for k, v in rollout.items() if not k.startswith("replay_")}
    sides = {
        "chosen": (rollout["replay_chosen_ids"][rows], rollout["replay_chosen_mask"][rows]),
        "rejected": (rollout["completion_ids"][rows], rollout["completion_mask"][rows]),
    }
    for side, (ids, mask) in sides.items():
        out[f"replay_{side}_input_ids"] = torch.cat([p_ids, ids], 1)
        out[f"replay_{side}_attention_mask"] = torch.cat([p_mask, mask], 1)
        out[f"replay_{side}_loss_mask"] = torch.cat([torch.zeros_like(p_mask), mask], 1)
    out["replay_ref_chosen_logps"] = rollout["replay_ref_chosen_logps"][rows]
    out["replay_ref_rejected_logps"] = rollout["replay_ref_rejected_logps"][rows]
    return out


@pytest.mark.parametrize("dpo_variant", ["dpo", "simpo"])
def test_rollout_pairs_equal_explicit_pairs(lm, batch, dpo_variant):
    rollout = _rollout_form(batch)
    kw = dict(alpha_sdpo=0.0, beta_replay=0.6, dpo_variant=dpo_variant)
    lm.calls.clear()
    loss_r, m_r, grads_r = _run(lm, rollout, **kw)
    # student forward + ONE chosen forward on the paired rows (the rejected side is free)
    assert [c[0][0] for c in lm.calls] == [3, 2] and all(c[1] for c in lm.calls)
    loss_e, m_e, grads_e = _run(lm, _explicit_form(rollout), **kw)
    # the same log-probs from differently shaped forwards: the toy LM's float32 budget, each
    # value on the scale of what it sums (a pair margin: its log-prob sums times beta)
    scale = abs(float(loss_e)) + abs(m_e["replay/margin"]) + 1.0
    assert_close(loss_r, loss_e, n=TOY_N, ops=TOY_OPS, scale=scale)
    for a, b in zip(grads_r, grads_e):
        assert_close(a, b, n=TOY_N, ops=TOY_OPS)
    for key in ("loss/replay", "replay/margin"):
        assert m_r[key] == approx(m_e[key], n=TOY_N, ops=TOY_OPS, scale=scale), key
    assert m_r["replay/accuracy"] == m_e["replay/accuracy"]  # a count / pairs
    assert m_r["replay/pairs"] == 2.0 and m_r["replay/active"] == 1.0


def test_rollout_pairs_by_hand(lm, batch):
    """DPO on rollout pairs, every number recomputed with plain log_softmax."""
    rollout = _rollout_form(batch)
    rows = torch.tensor(PAIR_ROWS)
    P = batch["prompt_ids"].shape[1]

    def summed(ids, mask):
        logits = lm(
            torch.cat([rollout["prompt_ids"][rows], ids], 1),
            torch.cat([rollout["prompt_mask"][rows], mask], 1),
        ).logits[:, P - 1 : -1]
        tok = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
        return (tok * mask).sum(-1)

    with torch.no_grad():
        chosen = summed(rollout["replay_chosen_ids"][rows], rollout["replay_chosen_mask"][rows])
        rejected = summed(rollout["completion_ids"][rows], rollout["completion_mask"][rows])
        z = 0.1 * (
            (chosen - rollout["replay_ref_chosen_logps"][rows])
            - (rejected - rollout["replay_ref_rejected_logps"][rows])
        )
        expected = -torch.nn.functional.logsigmoid(z).mean()
    _, m, _ = _run(lm, rollout, alpha_sdpo=0.0, beta_replay=1.0)
    assert m["loss/replay"] == approx(float(expected), n=TOY_N, ops=TOY_OPS)


def test_normalisers_give_global_sums_so_accumulation_agrees(lm, batch):
    """With sdpo_num_tokens / replay_num_pairs = the whole batch's counts, per-row micro-batches
    add up to the whole batch (1 x B and B x 1 accumulation agree); without them the channels are
    micro-batch means."""
    # No left padding: the toy LM, unlike a RoPE model, would see trimmed padding columns.
    batch["prompt_mask"] = torch.ones_like(batch["prompt_mask"])
    inputs = _rollout_form(batch)
    kw = dict(alpha_sdpo=0.4, beta_replay=0.3)
    tokens = (batch["completion_mask"].bool() & batch["sdpo_sample_mask"][:, None]).sum()
    counted = dict(inputs, sdpo_num_tokens=tokens.float(), replay_num_pairs=torch.tensor(2.0))
    whole, m_whole, g_whole = _run(lm, counted, **kw)
    plain, m_plain, _ = _run(lm, inputs, **kw)
    # one micro-batch: the mean vs sum / count, a couple of roundings on the loss's scale
    assert_close(whole, plain, n=2, ops=4)
    assert m_whole["loss/sdpo"] == m_plain["loss/sdpo"]  # the metric is the mean itself

    B = batch["completion_ids"].shape[0]
    lm.zero_grad()
    total = torch.zeros(())
    for i in range(B):
        micro = {k: v[i : i + 1] if v.dim() > 0 else v for k, v in counted.items()}
        micro["num_items_in_batch"] = batch["completion_mask"].sum()
        loss, _ = compose_loss(lm, micro, **kw)
        loss.backward()
        total = total + loss.detach()
    whole_g = dict(counted, num_items_in_batch=batch["completion_mask"].sum())
    expected, _, expected_g = _run(lm, whole_g, **kw)
    # B micro-batch losses summed (B more terms) vs one batch: the toy budget, on the scale of
    # the summed parts (each micro-batch's loss) and of each gradient's largest entry
    assert_close(total, expected, n=TOY_N + B, ops=TOY_OPS, scale=float(abs(expected)) + 1.0)
    for a, b in zip(_grads(lm), expected_g):
        assert_close(a, b, n=TOY_N + B, ops=TOY_OPS)

    doubled = dict(counted, sdpo_num_tokens=2 * tokens.float(), replay_num_pairs=torch.tensor(4.0))
    half, m_half, _ = _run(lm, doubled, **kw)
    grpo = m_whole["loss/grpo"]
    # differences of float32 totals: rounding on the totals' scale
    size = abs(float(half)) + abs(float(whole))
    assert float(half) - grpo == approx((float(whole) - grpo) / 2, n=3, ops=6, scale=size)
    assert m_half["loss/sdpo"] == m_whole["loss/sdpo"]  # still the mean, the same bits


def test_terms_are_the_channels_of_compose_loss(lm, batch, make_lm):
    inputs = _rollout_form(batch)
    kw = dict(alpha_sdpo=0.4, beta_replay=0.3, sdpo_wrapper="taid", taid_t=0.6)
    total, metrics = compose_loss(lm, inputs, **kw)
    P = batch["prompt_ids"].shape[1]
    logits = lm(
        torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
        torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
    ).logits[:, P - 1 : -1]
    sdpo, m2 = sdpo_term(lm, inputs, logits, **kw)
    replay, m3 = replay_term(lm, inputs, logits, **kw)
    parts = (metrics["loss/grpo"], 0.4 * float(sdpo.detach()), 0.3 * float(replay.detach()))
    # the same float32 terms summed in float32 vs float64: a few roundings on their scale
    assert metrics["loss/total"] == approx(sum(parts), n=3, ops=4, scale=sum(map(abs, parts)))
    assert m2["taid/t"] == 0.6 and m2["loss/sdpo"] == metrics["loss/sdpo"]
    assert m3["loss/replay"] == metrics["loss/replay"]
    # A separate teacher (an EMA copy, say) is the one that scores the hinted contexts.
    other = make_lm(seed=1)
    lm.calls.clear()
    with_other, _ = sdpo_term(other, inputs, logits, **kw)
    assert lm.calls == [] and len(other.calls) == 1
    # a different teacher: far more than rounding apart
    assert float(with_other.detach()) != approx(float(sdpo.detach()), n=TOY_N, ops=TOY_OPS)
    # Off: weight 0, keys absent, nothing selected.
    assert sdpo_term(lm, inputs, logits, **{**kw, "alpha_sdpo": 0.0}) is None
    none_selected = dict(inputs, sdpo_sample_mask=torch.zeros(3, dtype=torch.bool))
    assert sdpo_term(lm, none_selected, logits, **kw) is None
    no_pairs = dict(inputs, replay_pair_mask=torch.zeros(3, dtype=torch.bool))
    assert replay_term(lm, no_pairs, logits, **kw) is None


class KeepingLM(torch.nn.Module):
    """Wraps a LinearLM and honours Hugging Face's ``logits_to_keep``; records what it got."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.kept: list[int | None] = []

    def forward(self, input_ids, attention_mask, logits_to_keep=None):
        self.kept.append(logits_to_keep)
        logits = self.inner(input_ids, attention_mask).logits
        return logits if logits_to_keep is None else logits[:, -logits_to_keep:]


def test_logits_to_keep_only_when_asked(lm, batch):
    inputs = _rollout_form(batch)
    model = KeepingLM(lm)
    P, T = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    student = lm(
        torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
        torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
    ).logits[:, P - 1 : -1]
    full, _ = sdpo_term(model, inputs, student)
    kept, _ = sdpo_term(model, inputs, student, logits_to_keep=True)
    assert model.kept == [None, T + 1]
    assert torch.equal(full, kept)  # the same logits sliced: the same bits
    model.kept.clear()
    c_full, _ = replay_term(model, inputs, student)
    c_kept, _ = replay_term(model, inputs, student, logits_to_keep=True)
    width = int(inputs["replay_chosen_mask"][PAIR_ROWS].sum(-1).max())
    assert model.kept == [None, width + 1]
    assert torch.equal(c_full, c_kept)


def test_completion_logps_and_left_padding_trim(lm):
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, 11, (2, 5), generator=g)
    ctx_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])  # two shared padding columns
    ids = torch.randint(0, 11, (2, 3), generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    lm.calls.clear()
    summed, mean = completion_logps(lm, ctx, ctx_mask, ids, mask)
    assert lm.calls == [((2, 6), True)]  # the all-padding columns are not run
    logits = lm(torch.cat([ctx[:, 2:], ids], 1), torch.cat([ctx_mask[:, 2:], mask], 1)).logits
    tok = torch.log_softmax(logits[:, 2:-1], -1).gather(-1, ids[..., None])[..., 0]
    # log-probs (V = 11 terms per log-sum-exp), summed over <= 3 tokens: float32 budget on the
    # magnitude of the summed log-probs
    size = float((tok * mask).detach().abs().sum(-1).max())
    assert_close(summed, (tok * mask).sum(-1), n=11 + 3, ops=8, scale=size)
    assert_close(mean, (tok * mask).sum(-1) / mask.sum(-1), n=11 + 3, ops=9, scale=size)
    assert_close(selective_log_softmax(logits[:, 2:-1], ids), tok, n=11, ops=8, scale=size)
    with pytest.raises(ValueError, match="C >= 1"):
        completion_logps(lm, ctx[:, :0], ctx_mask[:, :0], ids, mask)


def test_bad_batches_raise_naming_the_problem(lm, batch):
    rollout = _rollout_form(batch)
    student = torch.zeros(3, batch["completion_ids"].shape[1], 11)
    both = {**rollout, **{k: batch[k] for k in REPLAY_KEYS}}
    with pytest.raises(ValueError, match="both channel-3 forms"):
        compose_loss(lm, both)
    partial = {k: v for k, v in rollout.items() if k != "replay_chosen_mask"}
    with pytest.raises(ValueError, match="replay_chosen_mask"):
        compose_loss(lm, partial)
    with pytest.raises(ValueError, match="student_logits"):
        replay_term(lm, rollout, None)
    with pytest.raises(ValueError, match="student_logits"):
        sdpo_term(lm, rollout, student[:, :2])
    with pytest.raises(ValueError, match="sdpo_num_tokens"):
        compose_loss(lm, dict(rollout, sdpo_num_tokens=torch.tensor(0.0)))
    with pytest.raises(ValueError, match="replay_num_pairs"):
        compose_loss(lm, dict(rollout, replay_num_pairs=torch.tensor([1.0, 2.0])))
    no_ref = {k: v for k, v in rollout.items() if k != "replay_ref_rejected_logps"}
    with pytest.raises(ValueError, match="replay_ref_rejected_logps"):
        compose_loss(lm, no_ref)
    with pytest.raises(ValueError, match="replay_pair_mask must be"):
        compose_loss(lm, dict(rollout, replay_pair_mask=torch.ones(2, dtype=torch.bool)))
    with pytest.raises(ValueError, match="inputs must be a mapping"):
        sdpo_term(lm, [1, 2], student)
