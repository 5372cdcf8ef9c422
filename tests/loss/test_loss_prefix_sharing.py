"""Channel 2's teacher forward with shared context prefixes, and the hinted-context cap.

Shared prefixes (`loss._prefix`): the teacher logits, the JSD loss and the student gradient must
equal the unshared forward's on a real tiny Qwen2 model, with hinted contexts written by the
default hint template and the chat template, left padding, rows without a hint, a row alone in
its group, and the fallbacks (nothing to share, a model that fills no cache).
Tolerance: the two forwards compute the same attention over the same keys and values with
matmuls of other shapes, so they differ by float32 rounding only: a first-order budget of
``(n + ops) u`` per value (``_loss_tolerance.bound``) with n = the longest reduction (the MLP's
4 x 64 = 256 intermediate features; attention sums at most ~120 positions) and ~60 rounded
operations along the 2-layer chain (norms, projections, softmax, residuals, head, log-softmax),
on the scale of the logits; the divergence and its gradient then move as `divergence_bounds`
says for teacher log-probs that far apart. Measured: log-probs ~3e-7 apart.

The cap (`sdpo_max_context_length`): contexts lose their middle, never the completion; checked
against contexts cut by hand in Python.
"""

from __future__ import annotations

import pytest
import torch
from _loss_tolerance import bound, divergence_bounds

from composer_replication.loss import ComposeConfig, sdpo_term
from composer_replication.loss._logprobs import cap_context, completion_logits
from composer_replication.loss._prefix import plan_groups, shared_prefix_completion_logits

pytest.importorskip("transformers")

T = 9  # completion tokens
TINY_N, TINY_OPS = 256, 60  # the tiny Qwen2's float32 rounding budget (module docstring)


def _left(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


@pytest.fixture(scope="module")
def tiny():
    from composer_replication.models import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=0)
    model.train()  # as the trainer's policy teacher (no dropout in the tiny config)
    return tok, model


def _teacher_scale(model, batch) -> float:
    """The largest |logit| of the teacher over the hinted rows (the scale of its log-probs)."""
    with torch.no_grad():
        out = model(
            input_ids=batch["sdpo_teacher_input_ids"],
            attention_mask=batch["sdpo_teacher_attention_mask"],
        )
    return float(out.logits.abs().max())


def _hinted_batch(tok, vocab: int) -> dict[str, torch.Tensor]:
    """Two prompt groups of 4 rollouts; hints as the trainer writes them (default template)."""
    from composer_replication.data.hints import HintTemplate

    template = HintTemplate()
    g = torch.Generator().manual_seed(0)

    def ctx(prompt: str, solution: str | None = None, feedback: str | None = None) -> list[int]:
        text = template.render_text(prompt, solution, feedback) if solution or feedback else prompt
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return tok(chat, add_special_tokens=False)["input_ids"]

    contexts = [
        ctx("3+4="),  # row 0: the successful sibling (no hint, not selected)
        ctx("3+4=", "7", "expected 7, got '8'"),  # rows 1-3: same sibling, own feedback
        ctx("3+4=", "7", "expected 7, got '12 '"),
        ctx("3+4=", "7", "expected 7, got 'seven'"),
        ctx("12+9=", None, "expected 21, got '3'"),  # row 4: feedback only: alone
        ctx("12+9="),  # rows 5-7: no hint (not selected)
        ctx("12+9="),
        ctx("12+9="),
    ]
    B = len(contexts)
    completion_ids = torch.randint(5, vocab, (B, T), generator=g)
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[2, T - 3 :] = 0  # right padding
    completion_mask[4, T - 1 :] = 0
    ctx_ids, ctx_mask = _left(contexts)
    return {
        "prompt_ids": ctx_ids[:, -4:],
        "prompt_mask": ctx_mask[:, -4:],
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.zeros(B),
        "sdpo_teacher_input_ids": torch.cat([ctx_ids, completion_ids], 1),
        "sdpo_teacher_attention_mask": torch.cat([ctx_mask, completion_mask], 1),
        "sdpo_sample_mask": torch.tensor([False, True, True, True, True, False, False, False]),
    }


def _contexts(batch: dict[str, torch.Tensor], rows: list[int]) -> list[list[int]]:
    ids, mask = batch["sdpo_teacher_input_ids"][:, :-T], batch["sdpo_teacher_attention_mask"]
    return [ids[i][mask[i, :-T].bool()].tolist() for i in rows]


def test_plan_groups_shares_the_longest_common_prefixes() -> None:
    a = [1, 2, 3, 4, 5, 6]
    contexts = [a + [9], [7, 7, 7], a + [8, 8], a, [7, 7, 1]]
    plan = plan_groups(contexts)
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(plan.group):
        groups.setdefault(g, []).append(row)
    assert sorted(groups.values()) == [[0, 2, 3], [1, 4]]
    g_a, g_7 = plan.group[0], plan.group[1]
    assert plan.prefix[g_a] == 5  # the common 6 tokens, capped at the shortest row minus one
    assert plan.prefix[g_7] == 2
    # identical rows share all but their last token; a row alone takes as much as fits
    same = plan_groups([[4, 5, 6], [4, 5, 6], [1, 2, 3, 4, 5, 6, 7]])
    assert same.prefix[same.group[0]] == 2 and same.group[0] == same.group[1]
    assert same.prefix[same.group[2]] == 2
    with pytest.raises(ValueError, match="at least one token"):
        plan_groups([[1], []])


@pytest.mark.parametrize("logits_to_keep", [False, True])
def test_shared_teacher_logits_equal_the_unshared_forward(tiny, logits_to_keep) -> None:
    tok, model = tiny
    batch = _hinted_batch(tok, model.config.vocab_size)
    rows = [1, 2, 3, 4]
    contexts = _contexts(batch, rows)
    plan = plan_groups(contexts)
    shared_rows = [r for r, g in zip(rows, plan.group) if plan.group.count(g) > 1]
    assert shared_rows == [1, 2, 3] and len(set(map(len, contexts))) > 1  # left padding
    assert plan.prefix[plan.group[0]] > 60  # chat header, question, sibling, feedback header
    ids, mask = batch["sdpo_teacher_input_ids"][rows], batch["sdpo_teacher_attention_mask"][rows]
    parts = (ids[:, :-T], mask[:, :-T], ids[:, -T:], mask[:, -T:])
    with torch.no_grad():
        plain = completion_logits(model, *parts, logits_to_keep=logits_to_keep)
        shared = shared_prefix_completion_logits(model, *parts, logits_to_keep=logits_to_keep)
    assert shared is not None and shared.shape == plain.shape
    real = parts[3].bool()
    diff = (shared.log_softmax(-1) - plain.log_softmax(-1))[real].abs().max()
    scale = float(plain[real].abs().max())  # the logits' scale (log-probs: a shift of them)
    assert float(diff) <= bound(torch.float32, n=TINY_N, ops=TINY_OPS, scale=scale)


def test_sdpo_loss_and_gradient_equal_with_and_without_sharing(tiny) -> None:
    tok, model = tiny
    batch = _hinted_batch(tok, model.config.vocab_size)
    batch["sdpo_num_tokens"] = torch.tensor(40.0)
    calls: list[dict] = []

    def counting(**kw):
        calls.append(kw)
        return model(**kw)

    results = {}
    for share in (False, True):
        student = torch.randn(
            8, T, model.config.vocab_size, generator=torch.Generator().manual_seed(1)
        )
        student.requires_grad_(True)
        calls.clear()
        loss, metrics = sdpo_term(counting, batch, student, share_prefix=share, logits_to_keep=True)
        loss.backward()
        results[share] = (loss.detach(), student.grad, metrics, len(calls))
    (l0, g0, m0, n0), (l1, g1, m1, n1) = results[False], results[True]
    assert (n0, n1) == (1, 2)  # one forward unshared; prefix batch + suffix batch shared
    # teacher log-probs apart by at most `lp` (first test); the divergence moves by <= 2 lp per
    # token (p sums to 1) plus the log-ratio-weighted term (as divergence_bounds), gradient entries
    # (q - p) / N by p * lp / N; on top, each side's own rounding (divergence_bounds)
    value_tol, grad_tol = divergence_bounds(student, student)  # its own rounding floor
    z_t = _teacher_scale(model, batch)
    lp = bound(torch.float32, n=TINY_N, ops=TINY_OPS, scale=z_t)
    ratio = 2 * (float(student.detach().abs().max()) + z_t)  # |log q - log p| <= 2 |z_s| + 2 |z_t|
    assert torch.allclose(l0, l1, rtol=0, atol=value_tol + lp * (2 + ratio))
    assert torch.allclose(g0, g1, rtol=0, atol=grad_tol + lp)
    assert m0["sdpo/frac_samples"] == m1["sdpo/frac_samples"] == 0.5
    # the teacher side has no gradient path: the model's parameters got none
    assert all(p.grad is None for p in model.parameters())


def test_falls_back_when_nothing_is_shared_or_no_cache_is_filled(tiny) -> None:
    tok, model = tiny
    batch = _hinted_batch(tok, model.config.vocab_size)
    ids, mask = batch["sdpo_teacher_input_ids"], batch["sdpo_teacher_attention_mask"]
    distinct = [0, 4]  # two unrelated contexts: sharing would not save padded tokens
    parts = (ids[distinct, :-T], mask[distinct, :-T], ids[distinct, -T:], mask[distinct, -T:])
    with torch.no_grad():
        assert shared_prefix_completion_logits(model, *parts) is None
    # gradient checkpointing in training mode drops the cache: detected, not silently wrong
    from composer_replication.models import build_tiny_model

    ckpt = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=0)
    ckpt.gradient_checkpointing_enable()
    ckpt.train()
    rows = [1, 2, 3]
    parts = (ids[rows, :-T], mask[rows, :-T], ids[rows, -T:], mask[rows, -T:])
    with torch.no_grad():
        assert shared_prefix_completion_logits(ckpt, *parts) is None
        # a wrapper hiding the flag: the prefix forward runs, its empty cache is detected
        assert shared_prefix_completion_logits(lambda **kw: ckpt(**kw), *parts) is None
    student = torch.randn(8, T, ckpt.config.vocab_size)
    a, _ = sdpo_term(ckpt, batch, student, share_prefix=True)
    b, _ = sdpo_term(ckpt, batch, student, share_prefix=False)
    assert torch.equal(a, b)


def test_cap_context_cuts_the_middle_and_keeps_short_rows() -> None:
    rows = [list(range(10, 20)), list(range(30, 37)), [5, 6, 7]]
    ids, mask = _left(rows)
    out_ids, out_mask = cap_context(ids, mask, 6)
    assert out_ids.shape == (3, 6)
    kept = [out_ids[i][out_mask[i].bool()].tolist() for i in range(3)]
    assert kept == [[10, 11, 12, 17, 18, 19], [30, 31, 32, 34, 35, 36], [5, 6, 7]]
    assert out_mask[2].tolist() == [0, 0, 0, 1, 1, 1]  # re-left-padded
    odd_ids, odd_mask = cap_context(ids, mask, 5)  # head 2, tail 3
    assert odd_ids[0][odd_mask[0].bool()].tolist() == [10, 11, 17, 18, 19]
    same = cap_context(ids, mask, 10)
    assert same[0] is ids and same[1] is mask  # nothing over the cap: untouched
    with pytest.raises(ValueError, match=">= 1"):
        cap_context(ids, mask, 0)


@pytest.mark.parametrize("cap", [1, 7, 40])
def test_sdpo_max_context_length_equals_contexts_cut_by_hand(tiny, cap) -> None:
    tok, model = tiny
    batch = _hinted_batch(tok, model.config.vocab_size)
    contexts = _contexts(batch, list(range(8)))
    head = cap // 2
    cut = [c if len(c) <= cap else c[:head] + c[len(c) - (cap - head) :] for c in contexts]
    ctx_ids, ctx_mask = _left(cut)
    by_hand = dict(
        batch,
        sdpo_teacher_input_ids=torch.cat([ctx_ids, batch["completion_ids"]], 1),
        sdpo_teacher_attention_mask=torch.cat([ctx_mask, batch["completion_mask"]], 1),
    )
    student = torch.randn(8, T, model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    for share in (False, True):
        capped, _ = sdpo_term(
            model, batch, student, sdpo_max_context_length=cap, share_prefix=share
        )
        expected, _ = sdpo_term(model, by_hand, student, share_prefix=share)
        # the same contexts, padded to other widths: the tiny model's budget on the divergence
        # (as in the test above)
        z_t = _teacher_scale(model, batch)
        lp = bound(torch.float32, n=TINY_N, ops=TINY_OPS, scale=z_t)
        ratio = 2 * (float(student.abs().max()) + z_t)
        value_tol, _ = divergence_bounds(student, student)
        assert torch.allclose(capped, expected, rtol=0, atol=value_tol + lp * (2 + ratio))
    uncapped, _ = sdpo_term(model, batch, student)
    assert not torch.allclose(uncapped, capped)  # the cap binds: every hinted row is longer


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "64"])
def test_bad_context_cap_is_rejected_naming_the_key(bad) -> None:
    with pytest.raises(ValueError, match="sdpo_max_context_length"):
        ComposeConfig(sdpo_max_context_length=bad)


def test_run_config_key_reaches_the_trainer_keywords() -> None:
    from composer_replication.assembly.build import composer_kwargs
    from composer_replication.config import ConfigError, load_config

    assert load_config().loss.sdpo_max_context_length == ComposeConfig().sdpo_max_context_length
    config = load_config(overrides=["loss.sdpo_max_context_length=96"])
    assert composer_kwargs(config)["sdpo_max_context_length"] == 96
    with pytest.raises(ConfigError, match="loss.sdpo_max_context_length"):
        load_config(overrides=["loss.sdpo_max_context_length=0"])
