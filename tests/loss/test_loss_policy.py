"""Channel 1: grpo_loss against TRL 1.16's GRPOTrainer._compute_loss, and dppo_mask."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch
from _loss_tolerance import bound

from composer_replication.loss import dppo_mask, grpo_loss

# A GRPO token term is a chain of ~12 float32 operations (log-ratio, exp, clamps, min, times the
# advantage, the k3 KL: exp, subtractions, times beta); the loss sums B*T of them and divides.
GRPO_OPS = 12


def _grpo_scales(logps, old, ref, adv, mask, beta):
    """``(term, kl)``: the largest |token term| (and |k3 KL|). Every loss type is a weighted mean
    of the token terms with weights summing to <= 1 (each weight <= 1), so the loss, and each
    entry of its gradient, is within ``bound(n = B*T, ops = GRPO_OPS, scale = term)``."""
    lp = logps.detach()
    ratio = torch.exp(lp - (lp if old is None else old)).clamp(min=1.0)
    a = adv.abs()[:, None] if adv.dim() == 1 else adv.abs()
    term = a * ratio
    kl = torch.zeros_like(lp)
    if beta and ref is not None:
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        term = term + beta * (kl.abs() + (1 - torch.exp(ref - lp)).abs())
    return float((term * mask).max()), float((kl * mask).abs().max())


grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")


class _Accelerator:
    num_processes = 1
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _trl_grpo_loss(
    logps,
    old,
    advantages,
    mask,
    *,
    loss_type,
    eps_low,
    eps_high,
    delta,
    ref,
    beta,
    max_len,
    num_items,
):
    """Run TRL's own GRPOTrainer._compute_loss on fixed log-probs via a minimal stand-in self."""
    B, T = logps.shape
    stand_in = types.SimpleNamespace(
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        accelerator=_Accelerator(),
        max_completion_length=max_len,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=types.SimpleNamespace(
            use_bias_correction_kl=False, delta=delta, steps_per_generation=1
        ),
    )
    stand_in._get_per_token_logps_and_entropies = (
        lambda model, input_ids, attention_mask, logits_to_keep, **kw: (
            logps,
            torch.zeros_like(logps),
            None,
        )
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": torch.tensor(float(num_items)),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = grpo_trainer.GRPOTrainer._compute_loss(stand_in, None, inputs)
    return loss, stand_in._metrics["train"]


def _case(seed, B, T, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, T, generator=g, dtype=dtype) * 3).requires_grad_(True)
    old = logps.detach() + torch.randn(B, T, generator=g, dtype=dtype) * 0.3
    ref = logps.detach() + torch.randn(B, T, generator=g, dtype=dtype) * 0.2
    adv = torch.randn(B, generator=g, dtype=dtype)
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    mask[0] = 1
    return logps, old, ref, adv, mask


PARITY = [
    # loss_type, (B, T), eps_low, eps_high, delta, kl_beta, use_old, num_items_scale, max_len
    ("grpo", (4, 7), 0.2, None, None, 0.0, True, 1, None),
    ("grpo", (3, 11), 0.1, 0.28, None, 0.04, True, 1, None),
    ("bnpo", (4, 7), 0.2, 0.3, 1.5, 0.0, True, 1, None),
    ("bnpo", (2, 5), 0.2, None, None, 0.1, False, 1, None),
    ("dr_grpo", (4, 7), 0.2, None, None, 0.0, True, 1, 16),
    ("dr_grpo", (5, 3), 0.3, 0.3, 2.0, 0.05, True, 1, None),
    ("dapo", (4, 7), 0.2, 0.28, None, 0.0, True, 1, None),
    ("dapo", (6, 9), 0.2, None, 1.8, 0.02, True, 3, None),
    ("dapo", (2, 4), 0.2, None, None, 0.0, False, 2, None),
]


@pytest.mark.parametrize(
    "loss_type, shape, eps_low, eps_high, delta, beta, use_old, scale, max_len", PARITY
)
def test_grpo_matches_trl_compute_loss(
    loss_type, shape, eps_low, eps_high, delta, beta, use_old, scale, max_len
):
    logps, old, ref, adv, mask = _case(hash((loss_type, shape)) % 1000, *shape)
    old = old if use_old else None
    num_items = int(mask.sum()) * scale
    ours, metrics = grpo_loss(
        logps,
        old,
        adv,
        mask,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        delta=delta,
        ref_per_token_logps=ref if beta else None,
        kl_beta=beta,
        max_completion_length=max_len,
        num_items_in_batch=num_items if scale != 1 else None,
    )
    (g_ours,) = torch.autograd.grad(ours, logps)
    theirs, trl_metrics = _trl_grpo_loss(
        logps,
        old,
        adv,
        mask,
        loss_type=loss_type,
        eps_low=eps_low,
        eps_high=eps_low if eps_high is None else eps_high,
        delta=delta,
        ref=ref,
        beta=beta,
        max_len=shape[1] if max_len is None else max_len,
        num_items=num_items,
    )
    (g_theirs,) = torch.autograd.grad(theirs, logps)
    n_tok = int(mask.numel())
    term, kl = _grpo_scales(logps, old, ref, adv, mask, beta)
    tol = bound(torch.float32, n=n_tok, ops=GRPO_OPS, scale=term)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=tol)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=tol)
    # a fraction of counted tokens: float32 rounding of k / n
    assert metrics["grpo/clip_ratio"] == pytest.approx(
        trl_metrics["clip_ratio/region_mean"][0], abs=bound(torch.float32, n=n_tok, ops=2, scale=1)
    )
    if beta:  # a token mean of k3 terms
        assert metrics["grpo/kl"] == pytest.approx(
            trl_metrics["kl"][0], abs=bound(torch.float32, n=n_tok, ops=GRPO_OPS, scale=kl)
        )


def test_grpo_defaults_are_dapo_with_local_token_count():
    logps, old, _, adv, mask = _case(1, 3, 6)
    default, _ = grpo_loss(logps, old, adv, mask)
    bnpo, _ = grpo_loss(logps, old, adv, mask, loss_type="bnpo")
    explicit, _ = grpo_loss(logps, old, adv, mask, num_items_in_batch=int(mask.sum()))
    term, _ = _grpo_scales(logps, old, None, adv, mask, 0.0)
    tol = bound(torch.float32, n=int(mask.numel()), ops=GRPO_OPS, scale=term)
    torch.testing.assert_close(default, bnpo, rtol=0, atol=tol)
    torch.testing.assert_close(default, explicit, rtol=0, atol=tol)
    doubled, _ = grpo_loss(logps, old, adv, mask, num_items_in_batch=2.0 * mask.sum())
    torch.testing.assert_close(doubled * 2, default, rtol=0, atol=tol)


def test_grpo_on_policy_ratio_one_gives_advantage_weighted_logprob_gradient():
    logps, _, _, adv, mask = _case(2, 3, 5)
    loss, metrics = grpo_loss(logps, None, adv, mask, loss_type="bnpo")
    (g,) = torch.autograd.grad(loss, logps)
    expected = -adv[:, None] * mask / mask.sum()
    # ratio exp(0) = 1 exactly: each entry is -adv / N up to a few roundings
    entry = float(adv.abs().max() / mask.sum())
    torch.testing.assert_close(
        g, expected.to(g.dtype), rtol=0, atol=bound(torch.float32, n=1, ops=GRPO_OPS, scale=entry)
    )
    assert metrics["grpo/clip_ratio"] == 0.0


def test_grpo_accepts_per_token_advantages():
    logps, old, _, adv, mask = _case(3, 3, 5)
    a, _ = grpo_loss(logps, old, adv, mask)
    b, _ = grpo_loss(logps, old, adv[:, None].expand(3, 5), mask)
    term, _ = _grpo_scales(logps, old, None, adv, mask, 0.0)
    torch.testing.assert_close(
        a, b, rtol=0, atol=bound(torch.float32, n=15, ops=GRPO_OPS, scale=term)
    )


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_all_false_mask_zero_loss_zero_grad(loss_type):
    logps, old, _, adv, _ = _case(4, 3, 5)
    mask = torch.zeros(3, 5)
    old = old.clone()
    old[0, 0] = float("nan")  # padding may hold anything
    loss, metrics = grpo_loss(logps, old, adv, mask, loss_type=loss_type)
    (g,) = torch.autograd.grad(loss, logps)
    assert float(loss.detach()) == 0.0 and torch.count_nonzero(g) == 0
    assert metrics["grpo/empty_mask"] == 1.0


def test_grpo_gradcheck_float64():
    logps, old, ref, adv, mask = _case(5, 3, 4, dtype=torch.float64)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        torch.autograd.gradcheck(
            lambda x, lt=loss_type: grpo_loss(
                x, old, adv, mask, loss_type=lt, ref_per_token_logps=ref, kl_beta=0.1, delta=3.0
            )[0],
            (logps,),
        )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"loss_type": "cispo"}, "loss_type"),
        ({"epsilon_low": 1.0}, "epsilon_low"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"delta": 1.0}, "delta"),
        ({"kl_beta": -1.0}, "kl_beta"),
        ({"kl_beta": 0.1}, "ref_per_token_logps"),
        ({"num_items_in_batch": -3}, "num_items_in_batch"),
    ],
)
def test_grpo_bad_arguments_raise(kwargs, name):
    logps, old, _, adv, mask = _case(6, 2, 3)
    with pytest.raises(ValueError, match=name):
        grpo_loss(logps, old, adv, mask, **kwargs)


def test_grpo_bad_tensors_raise():
    logps, old, _, adv, mask = _case(7, 2, 3)
    with pytest.raises(ValueError, match="old_per_token_logps"):
        grpo_loss(logps, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="completion_mask"):
        grpo_loss(logps, old, adv, mask[:1])
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logps, old, adv[:1], mask)
    bad = logps.detach().clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="per_token_logps"):
        grpo_loss(bad, old, adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logps, old, torch.tensor([float("inf"), 0.0]), mask)


def _prime_rl_keep(trainer_lp, inference_lp, adv, loss_mask, low=0.2, high=0.2):
    """PRIME-RL's default-loss DPPO mask, restated per element in plain python."""
    keep = torch.zeros_like(loss_mask, dtype=torch.bool)
    for i in range(trainer_lp.numel()):
        d = float(trainer_lp.view(-1)[i].exp() - inference_lp.view(-1)[i].exp())
        a = float(adv.reshape(-1)[i])
        invalid = d > high if a > 0 else d < -low
        keep.view(-1)[i] = bool(loss_mask.view(-1)[i]) and not invalid
    return keep


def test_dppo_prob_difference_mask_matches_prime_rl_rule():
    g = torch.Generator().manual_seed(0)
    trainer = torch.log(torch.rand(4, 9, generator=g))
    inference = torch.log(torch.rand(4, 9, generator=g))
    adv = torch.randn(4, generator=g)
    adv[1] = 0.0  # zero advantage falls in the "low" branch as in PRIME-RL
    mask = torch.rand(4, 9, generator=g) > 0.2
    keep = dppo_mask(trainer, inference, mask, advantages=adv)
    expected = _prime_rl_keep(trainer, inference, adv[:, None].expand(4, 9), mask)
    assert torch.equal(keep, expected)
    assert 0 < int(keep.sum()) < int(mask.sum())  # the case exercises both outcomes
    # 1-D per-sample tensors, as PRIME-RL passes them
    keep1 = dppo_mask(trainer[0], inference[0], mask[0], advantages=adv[0].expand(9))
    assert torch.equal(keep1, expected[0])


def test_dppo_log_ratio_bounds():
    trainer = torch.tensor([[0.0, -1.0, -9.0, -0.5]])
    inference = torch.tensor([[-5.0, -1.5, -4.0, -0.5]])
    keep = dppo_mask(
        trainer,
        inference,
        None,
        prob_diff_low=None,
        prob_diff_high=None,
        log_ratio_low=-4.0,
        log_ratio_high=4.0,
    )
    assert keep.tolist() == [[False, True, False, True]]
    keep_all = dppo_mask(trainer, inference, prob_diff_low=None, prob_diff_high=None)
    assert bool(keep_all.all())
    nan = dppo_mask(
        torch.tensor([float("nan")]), torch.tensor([0.0]), prob_diff_low=None, prob_diff_high=None
    )
    assert not bool(nan.any())
    with pytest.raises(ValueError, match="advantages"):
        dppo_mask(trainer, inference)
