"""The PRIME-RL custom loss: golden vectors, PRIME-RL's default loss, channels 2 and 3, errors.

Golden numbers are derived by hand in the comments (probabilities chosen so every term is a
closed form); the default-loss comparison re-types PRIME-RL 0.8's ``default_loss_fn`` formula
(src/prime_rl/trainer/rl/loss.py @559b447) in plain torch, independently of the recipe.

Tolerances: every tensor here is float64 (u = 2**-53) and every value comes from at most a few
dozen operations (exp/log within a few ulps each) on numbers no larger than e**5 ~ 150, so
rounding stays below ~50 * 2**-53 * 150 ~ 1e-12: ``abs=1e-12`` (``rel=1e-12`` for the values of
size e**5). The DPO golden value is written with 10 decimals (+-5e-11, times at most 3):
``abs=1e-9``. Counts are exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from composer_replication.recipes.prime_rl import LossInputs, PrimeRLLossConfig, loss_fn

LOG = math.log


def sample(lp, inf, adv, mask=None, ref=None, weights=None):
    lp_t = torch.tensor([LOG(p) for p in lp], dtype=torch.float64, requires_grad=True)
    return lp_t, LossInputs(
        trainer_logprobs=lp_t,
        inference_logprobs=torch.tensor([LOG(p) for p in inf], dtype=torch.float64),
        ref_logprobs=None
        if ref is None
        else torch.tensor([LOG(p) for p in ref], dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        loss_mask=torch.ones(len(lp), dtype=torch.bool)
        if mask is None
        else torch.tensor(mask, dtype=torch.bool),
        loss_weights=None if weights is None else torch.tensor(weights, dtype=torch.float64),
    )


# trainer p = (0.5, 0.3, 0.9), inference p = (0.5, 0.6, 0.4), advantages (+1, -1, +1):
#   t0: p - p_inf = 0 -> kept; ratio 1; pg term -A*r = -1; kl 0
#   t1: p - p_inf = -0.3 < -0.2 with A <= 0 -> masked (prob_diff); log r = ln 0.5
#   t2: p - p_inf = +0.5 > 0.2 with A > 0 -> masked (prob_diff);  log r = ln 2.25
# prob_diff total = -1 + 1e-3 * (ln(0.5)^2 + ln(2.25)^2)
# log_ratio [-4, 4] keeps all three: -1 + 0.5 - 2.25 + the same kl term
KL = 1e-3 * (LOG(0.5) ** 2 + LOG(2.25) ** 2)
GOLDEN = {"prob_diff": -1.0 + KL, "log_ratio": -2.75 + KL, "both": -1.0 + KL}


@pytest.mark.parametrize("mask", ["prob_diff", "log_ratio", "both"])
def test_golden_channel1(mask):
    lp, inputs = sample((0.5, 0.3, 0.9), (0.5, 0.6, 0.4), (1.0, -1.0, 1.0))
    out = loss_fn(inputs, mask=mask, alpha_sdpo=0.0, beta_replay=0.0)
    assert out.loss.dim() == 0
    assert float(out.loss.detach()) == pytest.approx(GOLDEN[mask], abs=1e-12)
    out.loss.backward()
    # d/dlp of -A*r is -A*r on kept tokens; d/dlp of kl_tau*(log r)^2 is 2*kl_tau*log r.
    kept = {"prob_diff": (1, 0, 0), "log_ratio": (1, 1, 1), "both": (1, 0, 0)}[mask]
    expected = [
        -1.0 * kept[0],
        0.5 * kept[1] + 2e-3 * LOG(0.5),
        -2.25 * kept[2] + 2e-3 * LOG(2.25),
    ]
    assert lp.grad.tolist() == pytest.approx(expected, abs=1e-12)
    masked = {"prob_diff": 2 / 3, "log_ratio": 0.0, "both": 2 / 3}[mask]
    # a float64 mean of 0/1 flags: 2.0 / 3.0 rounds like 2 / 3 here
    assert float(out.metrics["is_masked"]) == pytest.approx(masked, rel=2.0**-52, abs=0)
    assert float(out.metrics["sdpo/active"]) == 0.0 and float(out.metrics["replay/active"]) == 0.0


def test_log_ratio_bounds_drop_far_tokens():
    # ratio e^5 (log 5 > 4) and e^-5 are dropped; e^3 is kept.
    lp = torch.tensor([0.0, -10.0, -1.0], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        trainer_logprobs=lp,
        inference_logprobs=torch.tensor([-5.0, -5.0, -4.0], dtype=torch.float64),
        ref_logprobs=None,
        advantages=torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64),
        loss_mask=torch.ones(3, dtype=torch.bool),
    )
    out = loss_fn(inputs, mask="log_ratio", kl_tau=0.0, alpha_sdpo=0.0)
    assert float(out.loss.detach()) == pytest.approx(-math.exp(3.0), rel=1e-12)
    out = loss_fn(inputs, mask="log_ratio", kl_tau=0.0, log_ratio_low=-6.0, log_ratio_high=6.0)
    assert float(out.loss.detach()) == pytest.approx(
        -(math.exp(5) + math.exp(-5) + math.exp(3)), rel=1e-12
    )


def prime_rl_default_loss(
    lp, inf, adv, mask, weights=None, low=0.2, high=0.2, adv_tau=1.0, kl_tau=1e-3
):
    """PRIME-RL 0.8 default_loss_fn, re-typed from its source (the loss only)."""
    log_ratio = lp - inf
    ratio = torch.exp(log_ratio)
    diff = torch.exp(lp) - torch.exp(inf)
    invalid = torch.where(adv > 0, diff > high, diff < -low)
    keep = mask & ~invalid
    per_token = -(keep * (adv_tau * adv) * ratio) + kl_tau * (mask * log_ratio**2)
    if weights is not None:
        per_token = per_token * weights
    return per_token.sum()


@pytest.mark.parametrize("weighted", [False, True])
def test_defaults_equal_prime_rl_default_loss(weighted):
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        n = 37
        lp = (-torch.rand(n, generator=gen, dtype=torch.float64) * 3).requires_grad_()
        inf = lp.detach() + torch.randn(n, generator=gen, dtype=torch.float64) * 0.5
        adv = torch.randn(n, generator=gen, dtype=torch.float64)
        mask = torch.rand(n, generator=gen) > 0.2
        weights = torch.rand(n, generator=gen, dtype=torch.float64) if weighted else None
        expected = prime_rl_default_loss(lp, inf, adv, mask, weights)
        (g_expected,) = torch.autograd.grad(expected, lp)
        inputs = LossInputs(lp, inf, None, adv, mask, weights)
        # With no reference log-probs and no pairs the composer loss IS PRIME-RL's default loss.
        out = loss_fn(inputs)
        (g,) = torch.autograd.grad(out.loss, lp)
        assert float(out.loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-12)
        assert torch.allclose(g, g_expected, atol=1e-12)


def test_channel2_on_policy_is_sampled_reverse_kl():
    # On-policy (trainer == inference): ratio 1, nothing masked. Channel 2 adds
    # alpha * sum(lp - lp_ref) = alpha * (ln(.5/.25) + ln(.3/.6) + ln(.9/.9)) = alpha * 0
    # and its gradient alpha * (lp - lp_ref) = alpha * (ln 2, -ln 2, 0).
    p = (0.5, 0.3, 0.9)
    lp, inputs = sample(p, p, (0.0, 0.0, 0.0), ref=(0.25, 0.6, 0.9))
    out = loss_fn(inputs, alpha_sdpo=0.5, kl_tau=0.0)
    assert float(out.loss.detach()) == pytest.approx(0.0, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.5 * LOG(2), -0.5 * LOG(2), 0.0], abs=1e-12)
    assert float(out.metrics["sdpo/active"]) == 1.0
    assert float(out.metrics["sdpo/reverse_kl"]) == pytest.approx(0.0, abs=1e-12)

    # A single token: value alpha * ln(p / p_ref) = 0.5 * ln 2, the sampled reverse-KL estimate.
    lp, inputs = sample((0.5,), (0.5,), (0.0,), ref=(0.25,))
    out = loss_fn(inputs, alpha_sdpo=0.5, kl_tau=0.0)
    assert float(out.loss.detach()) == pytest.approx(0.5 * LOG(2), abs=1e-12)
    assert float(out.metrics["loss/sdpo"]) == pytest.approx(LOG(2), abs=1e-12)


def test_channel2_off_policy_ratio_and_dppo_mask():
    # trainer p (0.5, 0.9), inference p (0.25, 0.4), reference p (0.5, 0.45):
    #   signal = lp_ref - lp = (0, ln 0.5); ratio = (2, 2.25)
    #   t0: p - p_inf = 0.25 > 0.2 but the signal (0) is not > 0 -> low side: 0.25 > -0.2 kept;
    #       term -0 * 2 = 0
    #   t1: signal < 0 -> low side: 0.5 > -0.2 kept; term -(ln 0.5) * 2.25 = 2.25 ln 2
    lp, inputs = sample((0.5, 0.9), (0.25, 0.4), (0.0, 0.0), ref=(0.5, 0.45))
    out = loss_fn(inputs, alpha_sdpo=1.0, kl_tau=0.0, adv_tau=0.0)
    assert float(out.loss.detach()) == pytest.approx(2.25 * LOG(2), abs=1e-12)
    out.loss.backward()
    # gradient of -sg(s) * r is -s * r: (0, 2.25 ln 2)
    assert lp.grad.tolist() == pytest.approx([0.0, 2.25 * LOG(2)], abs=1e-12)
    # trainer p 0.1 vs inference 0.5 (diff -0.4) with a negative signal: dropped.
    lp, inputs = sample((0.1,), (0.5,), (0.0,), ref=(0.05,))
    out = loss_fn(inputs, alpha_sdpo=1.0, kl_tau=0.0, adv_tau=0.0)
    assert float(out.loss.detach()) == 0.0 and float(out.metrics["sdpo/is_masked"]) == 1.0


def test_channel2_needs_ref_logprobs_and_alpha():
    p = (0.5, 0.3)
    _, with_ref = sample(p, p, (1.0, -1.0), ref=(0.25, 0.6))
    _, without = sample(p, p, (1.0, -1.0))
    base = loss_fn(without, alpha_sdpo=0.5)
    assert float(base.metrics["sdpo/active"]) == 0.0
    off = loss_fn(with_ref, alpha_sdpo=0.0)
    assert float(off.metrics["sdpo/active"]) == 0.0
    assert torch.equal(off.loss, base.loss)  # bit-exact: channel 2 not computed at all


# DPO golden (reference/loss.md): beta .1, chosen/rejected -10/-12, refs -11/-11 -> 0.5981388694
# SimPO golden: beta 2, gamma 1, averages -1 / -1.5 -> -log sigmoid(2*0.5 - 1) = ln 2
DPO_PAIR = {
    "chosen_logps": torch.tensor([-10.0], dtype=torch.float64, requires_grad=True),
    "rejected_logps": torch.tensor([-12.0], dtype=torch.float64, requires_grad=True),
    "ref_chosen_logps": torch.tensor([-11.0], dtype=torch.float64),
    "ref_rejected_logps": torch.tensor([-11.0], dtype=torch.float64),
}


def test_channel3_dpo_and_simpo_golden():
    p = (0.5, 0.5, 0.5)
    _, inputs = sample(p, p, (0.0, 0.0, 0.0))
    base = float(loss_fn(inputs, beta_replay=0.0).loss.detach())
    assert base == 0.0
    # n = 3 tokens: beta * L * n  (PRIME-RL then divides by the token count)
    out = loss_fn(inputs, beta_replay=0.5, replay_dpo_beta=0.1, **DPO_PAIR)
    assert float(out.loss.detach()) == pytest.approx(0.5 * 0.5981388694 * 3, abs=1e-9)
    assert float(out.metrics["replay/active"]) == 1.0
    assert float(out.metrics["loss/replay"]) == pytest.approx(0.5981388694, abs=1e-9)
    assert float(out.metrics["replay/accuracy"]) == 1.0
    out.loss.backward()
    # d/dchosen of -log sig(z) with z = 0.1*((-10+11) - (-12+11)) = 0.2: -0.1 * sig(-0.2) * 1.5
    sig = 1 / (1 + math.exp(0.2))
    assert float(DPO_PAIR["chosen_logps"].grad) == pytest.approx(-0.1 * sig * 1.5, abs=1e-12)
    DPO_PAIR["chosen_logps"].grad = None
    DPO_PAIR["rejected_logps"].grad = None

    simpo = {
        "chosen_avg_logps": torch.tensor([-1.0], dtype=torch.float64),
        "rejected_avg_logps": torch.tensor([-1.5], dtype=torch.float64),
    }
    out = loss_fn(
        inputs, beta_replay=1.0, dpo_variant="simpo", simpo_beta=2.0, simpo_gamma=1.0, **simpo
    )
    assert float(out.loss.detach()) == pytest.approx(LOG(2) * 3, abs=1e-12)

    # loss_weights scale the token count n used for channel 3 (and every token term).
    _, weighted = sample(p, p, (0.0, 0.0, 0.0), weights=(0.5, 0.5, 0.0))
    out = loss_fn(weighted, beta_replay=1.0, dpo_variant="simpo", **simpo)
    assert float(out.loss.detach()) == pytest.approx(LOG(2) * 1.0, abs=1e-12)


def test_channel3_rpo_alpha_adds_the_chosen_traces_token_mean_nll():
    """rpo_alpha (RPO): L = DPO + rpo_alpha * (-sum log p(chosen) / chosen tokens); the chosen
    trace of DPO_PAIR has -10 over 4 tokens, so the NLL is 2.5."""
    p = (0.5, 0.5, 0.5)
    _, inputs = sample(p, p, (0.0, 0.0, 0.0))
    pair = {k: v.detach() for k, v in DPO_PAIR.items()}
    lengths = torch.tensor([4])
    out = loss_fn(inputs, beta_replay=0.5, rpo_alpha=0.2, chosen_lengths=lengths, **pair)
    assert float(out.metrics["loss/replay"]) == pytest.approx(0.5981388694 + 0.2 * 2.5, abs=1e-9)
    assert float(out.loss.detach()) == pytest.approx(0.5 * (0.5981388694 + 0.5) * 3, abs=1e-9)
    assert float(out.metrics["replay/nll"]) == pytest.approx(2.5, abs=1e-9)  # as the trainer's
    assert "replay/nll" not in loss_fn(inputs, beta_replay=0.5, **pair).metrics  # off: no key
    with pytest.raises(ValueError, match="needs 'chosen_lengths'"):
        loss_fn(inputs, beta_replay=0.5, rpo_alpha=0.2, **pair)


def test_channel3_off_without_pairs_or_weight():
    p = (0.5, 0.3)
    _, inputs = sample(p, (0.5, 0.4), (1.0, -1.0))
    base = loss_fn(inputs)
    off = loss_fn(inputs, beta_replay=0.0, **DPO_PAIR)
    assert torch.equal(base.loss, off.loss)
    assert float(off.metrics["replay/active"]) == 0.0
    empty = {k: v[:0] for k, v in DPO_PAIR.items()}
    assert torch.equal(loss_fn(inputs, **empty).loss, base.loss)


def test_loss_weights_scale_every_token_term():
    lp, inputs = sample((0.5, 0.3, 0.9), (0.5, 0.6, 0.4), (1.0, -1.0, 1.0), weights=(2.0, 1.0, 0.0))
    out = loss_fn(inputs, alpha_sdpo=0.0)
    # t0: 2 * -1; t1: masked pg, kl 1e-3 ln(.5)^2; t2: weight 0
    assert float(out.loss.detach()) == pytest.approx(-2.0 + 1e-3 * LOG(0.5) ** 2, abs=1e-12)


def test_empty_mask_and_padding_garbage():
    lp = torch.tensor([-0.5, float("nan"), float("inf")], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        trainer_logprobs=lp,
        inference_logprobs=torch.tensor([-0.5, float("-inf"), float("nan")], dtype=torch.float64),
        ref_logprobs=torch.tensor([-0.7, float("nan"), 3.0], dtype=torch.float64),
        advantages=torch.tensor([1.0, float("nan"), 2.0], dtype=torch.float64),
        loss_mask=torch.tensor([True, False, False]),
    )
    out = loss_fn(inputs, alpha_sdpo=1.0)
    out.loss.backward()
    assert math.isfinite(float(out.loss.detach())) and torch.isfinite(lp.grad).all()
    assert float(out.loss.detach()) == pytest.approx(-1.0 + (-0.5 + 0.7), abs=1e-12)
    assert all(torch.isfinite(v).all() for v in out.metrics.values())

    lp = torch.tensor([-0.5, -1.0], requires_grad=True)
    empty = LossInputs(lp, lp.detach(), None, torch.ones(2), torch.zeros(2, dtype=torch.bool))
    out = loss_fn(empty)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and lp.grad.abs().sum() == 0.0


def test_metrics_have_the_same_keys_on_every_call():
    p = (0.5, 0.3)
    _, plain = sample(p, p, (1.0, -1.0))
    _, full = sample(p, p, (1.0, -1.0), ref=(0.25, 0.6))
    a = loss_fn(plain).metrics
    b = loss_fn(full, **DPO_PAIR).metrics
    assert a.keys() == b.keys()
    assert all(v.dim() == 0 for v in b.values())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sdpo_top_k": 20}, "sdpo_top_k.*do not apply"),
        ({"loss_type": "grpo"}, "loss_type.*do not apply"),
        ({"clip_eps": 0.2}, "unknown.*clip_eps"),
        ({"mask": "clip"}, "mask must be one of"),
        ({"dppo_mask_low": -1}, "dppo_mask_low must be a number >= 0"),
        ({"log_ratio_low": 4.0, "log_ratio_high": -4.0}, "log_ratio_low"),
        ({"dpo_variant": "ipo"}, "dpo_variant"),
        ({"alpha_sdpo": "x"}, "alpha_sdpo"),
        ({"chosen_logps": [-1.0]}, "chosen_logps must be a .* tensor passed .* at call time"),
        ({"chosen_logps": DPO_PAIR["chosen_logps"]}, "not rejected_logps"),
        (
            {"chosen_avg_logps": torch.zeros(1), "rejected_avg_logps": torch.zeros(1)},
            "dpo_variant='dpo' reads",
        ),
        (
            {"dpo_variant": "simpo", "chosen_logps": torch.zeros(1)},
            "dpo_variant='simpo' reads",
        ),
    ],
)
def test_bad_kwargs_name_the_problem(kwargs, match):
    _, inputs = sample((0.5,), (0.5,), (1.0,))
    with pytest.raises(ValueError, match=match):
        loss_fn(inputs, **kwargs)


def test_bad_inputs_name_the_problem():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="trainer_logprobs must be 1-D"):
        loss_fn(LossInputs(lp, lp, None, lp, lp.bool()))
    lp = torch.zeros(3)
    with pytest.raises(ValueError, match="advantages has shape"):
        loss_fn(LossInputs(lp, lp, None, torch.zeros(2), lp.bool()))
    with pytest.raises(ValueError, match="ref_logprobs must be a torch.Tensor"):
        loss_fn(LossInputs(lp, lp, [0.0, 0.0, 0.0], lp, lp.bool()))


def test_config_defaults_come_from_their_sources():
    from composer_replication.loss import ComposeConfig
    from composer_replication.recipes.prime_rl.contract import PRIME_RL_DEFAULT_LOSS
    from composer_replication.recipes.sampled import SAMPLED_TOKEN_KEYS

    cfg = PrimeRLLossConfig()
    shared = ComposeConfig()
    for key in SAMPLED_TOKEN_KEYS:  # the loss library's SampledTokenSettings, inherited
        assert getattr(cfg, key) == getattr(shared, key)
    for key, value in PRIME_RL_DEFAULT_LOSS.items():
        assert getattr(cfg, key) == value
