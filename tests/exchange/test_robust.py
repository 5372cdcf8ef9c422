"""exchange/contribution_screening.py: screening and robust merges, checked against independent
float64 references.

The references are written with numpy on float64 (sort, slice, mean), not with the module's own
helpers; the merges must match them to float32 rounding and be bit-identical when recomputed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerances import assert_close, tol

from composer_replication.exchange.contribution_screening import (
    AggregatePolicy,
    Candidate,
    Decision,
    combine,
    merge,
    screen,
    screen_state,
    tensor_stats,
    trim_count,
)

SHAPES = {"w": (7, 5), "b": (5,)}


def grads(n: int, seed: int = 0, noise: float = 0.1) -> list[dict[str, torch.Tensor]]:
    """n correlated pseudo-gradients: a shared direction plus per-rank noise (like DiLoCo's)."""
    g = torch.Generator().manual_seed(seed)
    common = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    return [
        {k: common[k] + noise * torch.randn(s, generator=g) for k, s in SHAPES.items()}
        for _ in range(n)
    ]


def cands(tensors, tokens=None, steps=None):
    return [
        Candidate(r, t, None if tokens is None else tokens[r], None if steps is None else steps[r])
        for r, t in enumerate(tensors)
    ]


def np_stack(tensors, name):
    return np.stack([t[name].double().numpy() for t in tensors])


def test_mean_matches_float64_reference_and_is_bit_stable():
    ts = grads(4)
    merged, decisions = merge(cands(ts), AggregatePolicy())
    assert [d.included for d in decisions] == [True] * 4
    for name in SHAPES:
        ref = np_stack(ts, name).mean(axis=0)
        # a 4-rank fp32 mean vs float64's: n = k + 1 (tests/tolerances.py)
        assert_close(merged[name], torch.from_numpy(ref).float(), n=5, what=name)
    again, _ = merge(cands(ts), AggregatePolicy())
    assert all(torch.equal(merged[n], again[n]) for n in SHAPES)


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_median_and_trimmed_mean_match_numpy(n):
    ts = grads(n, seed=n)
    k = trim_count(n, 0.25)
    assert k == min(math.ceil(0.25 * n), (n - 1) // 2)
    med, _ = merge(cands(ts), AggregatePolicy(aggregate="median", aggregate_outlier_ratio=0))
    trim, _ = merge(cands(ts), AggregatePolicy(aggregate="trimmed_mean", aggregate_outlier_ratio=0))
    for name in SHAPES:
        x = np.sort(np_stack(ts, name), axis=0)
        # a median is one input (odd n) or the halved sum of two (even n: one addition); the
        # trimmed mean sums n - 2k inputs and divides: n - 2k + 1 roundings
        median = torch.from_numpy(np.median(x, axis=0)).float()
        assert_close(med[name], median, n=2, what=f"median {name}")
        trimmed = torch.from_numpy(x[k : n - k].mean(axis=0)).float()
        assert_close(trim[name], trimmed, n=n - 2 * k + 1, what=f"trimmed {name}")


def test_coordinatewise_chunks_give_the_same_bits(monkeypatch):
    from composer_replication.exchange import merge_arithmetic

    ts = grads(5, seed=3)
    whole, _ = merge(cands(ts), AggregatePolicy(aggregate="trimmed_mean"))
    monkeypatch.setattr(merge_arithmetic, "CHUNK", 4)
    chunked, _ = merge(cands(ts), AggregatePolicy(aggregate="trimmed_mean"))
    assert all(torch.equal(whole[n], chunked[n]) for n in SHAPES)


def test_norm_clip_scales_to_clip_ratio_times_median():
    ts = grads(4, seed=1)
    ts[3] = {k: v * 50 for k, v in ts[3].items()}
    policy = AggregatePolicy(
        aggregate="norm_clip", aggregate_outlier_ratio=0, aggregate_clip_ratio=1.0
    )
    merged, decisions = merge(cands(ts), policy)
    norms = [math.sqrt(sum(float((v.double() ** 2).sum()) for v in t.values())) for t in ts]
    med = float(np.median(norms))
    scales = [min(1.0, med / x) for x in norms]
    # float32 norms over every element (N terms) against float64's, then a quotient: 2 gamma_{N+1}
    elements = sum(math.prod(s) for s in SHAPES.values())
    assert [d.scale for d in decisions] == pytest.approx(scales, rel=tol(elements + 1)["rtol"])
    assert "clipped" in decisions[3].note and decisions[3].included
    for name in SHAPES:
        ref = sum(s * np_stack(ts, name)[i] for i, s in enumerate(scales)) / 4
        # the scales' own rounding (N + 1, above) times each term, then the 4-rank mean (k + 1)
        assert_close(merged[name], torch.from_numpy(ref).float(), n=elements + 6, what=name)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_contribution_is_rejected_with_the_tensor_named(value):
    ts = grads(3)
    ts[1]["b"][2] = value
    merged, decisions = merge(cands(ts), AggregatePolicy())
    assert not decisions[1].included and "non-finite" in decisions[1].reason
    assert "'b': 1 of 5" in decisions[1].reason
    for name in SHAPES:
        ref = (np_stack(ts, name)[0] + np_stack(ts, name)[2]) / 2
        assert_close(merged[name], torch.from_numpy(ref).float(), n=3, what=name)  # k + 1


def test_huge_but_finite_values_are_rejected_as_norm_outliers():
    ts = grads(3)
    ts[2]["w"][0, 0] = 3e38  # finite float32 (the 1e30-style payload the issue describes)
    ts[2]["w"][0, 1] = 3e38
    stats = tensor_stats(ts[2])
    assert math.isfinite(stats.norm) and stats.nonfinite is None
    _, decisions = merge(cands(ts), AggregatePolicy())
    assert "norm outlier" in decisions[2].reason


def test_norm_outlier_against_the_round_median_is_rejected():
    ts = grads(4)
    ts[0] = {k: v * 1e30 for k, v in ts[0].items()}
    _, decisions = merge(cands(ts), AggregatePolicy(aggregate_outlier_ratio=10.0))
    assert [d.included for d in decisions] == [False, True, True, True]
    assert "norm outlier" in decisions[0].reason and "median" in decisions[0].reason
    # a 5x larger (honest but big) contribution stays in with the default ratio 10
    ts = grads(4)
    ts[0] = {k: v * 5 for k, v in ts[0].items()}
    assert all(d.included for d in screen(cands(ts), AggregatePolicy()))
    # two candidates: the median cannot tell which one is the outlier, so nothing is rejected
    assert all(
        d.included for d in screen(cands(grads(2))[:1] + [Candidate(1, ts[0])], AggregatePolicy())
    )


def test_token_claim_inconsistent_with_steps_is_rejected_and_big_claims_capped():
    ts = grads(4)
    policy = AggregatePolicy(weighting="tokens", max_tokens_per_step=100, max_inner_steps=10)
    tokens = [1000, 900, 10**12, 800]
    steps = [10, 10, 10, 10]
    merged, decisions = merge(cands(ts, tokens, steps), policy)
    assert not decisions[2].included
    assert "10 inner steps x 100 tokens per step allow at most 1000" in decisions[2].reason
    w = np.array([1000, 900, 800], dtype=float)
    # float64 quotients of integer token counts (their sum is exact): one rounding each
    assert [decisions[r].weight for r in (0, 1, 3)] == pytest.approx(
        list(w / w.sum()), rel=2.0**-52, abs=0
    )
    for name in SHAPES:
        x = np_stack(ts, name)
        ref = (w[0] * x[0] + w[1] * x[1] + w[2] * x[3]) / w.sum()
        # a 3-rank weighted fp32 sum (weights rounded to fp32 too): n = k + 2
        assert_close(merged[name], torch.from_numpy(ref).float(), n=5, what=name)
    # more inner steps than a round allows is an inconsistent claim too
    d = screen(cands(ts, [10] * 4, [10, 10, 11, 10]), policy)
    assert "11 inner steps, at most 10" in d[2].reason
    # without bounds: the claim is capped at token_cap x the median claim instead
    d = screen(cands(ts, [100, 100, 10**12, 100]), AggregatePolicy(weighting="tokens"))
    assert all(x.included for x in d) and "capped" in d[2].note
    assert d[2].weight == pytest.approx(400 / 700, rel=2.0**-52, abs=0)  # one float64 quotient
    # a missing token count under token weighting
    d = screen(cands(ts, [100, None, 100, 100]), AggregatePolicy(weighting="tokens"))
    assert not d[1].included and "no token count" in d[1].reason


def test_loss_screen_drops_the_harmful_contribution():
    target = {"w": torch.ones(7, 5), "b": torch.ones(5)}

    def probe(candidate):  # loss after one outer step from zeros: ||0 - lr*c - target||^2
        return sum(float(((-1.0 * candidate[k]) - target[k]).pow(2).sum()) for k in target)

    good = [{k: -v.clone() for k, v in target.items()} for _ in range(2)]
    bad = {k: v.clone() * 3 for k, v in target.items()}
    policy = AggregatePolicy(screen="loss", aggregate_outlier_ratio=0)
    merged, decisions = merge(cands([good[0], bad, good[1]]), policy, loss_probe=probe)
    assert [d.included for d in decisions] == [True, False, True]
    assert "harmful" in decisions[1].reason and decisions[1].loss_delta > 0
    assert decisions[0].loss_delta < 0
    assert torch.equal(merged["w"], -target["w"])
    with pytest.raises(ValueError, match="needs a loss_probe"):
        screen(cands(good), policy)


def test_decisions_round_trip_through_json():
    d = Decision(3, False, "non-finite values", 0.0, 1.0, math.nan, None, "")
    back = Decision.from_json(d.to_json())
    assert back.rank == 3 and back.norm is None and back.reason == "non-finite values"


def test_combine_uses_the_decisions_it_is_given():
    ts = grads(3)
    decisions = [
        Decision(0, True, weight=0.25),
        Decision(1, False, "x"),
        Decision(2, True, weight=0.75),
    ]
    out = combine(cands(ts), decisions, AggregatePolicy(weighting="tokens"))
    for name in SHAPES:
        x = np_stack(ts, name)
        # 0.25 x is exact, 0.75 x and the sum one rounding each: n = 2 (+1 for the reference)
        assert_close(out[name], torch.from_numpy(0.25 * x[0] + 0.75 * x[2]).float(), n=3)
    with pytest.raises(ValueError, match="no candidate is included"):
        combine(cands(ts), [Decision(r, False, "x") for r in range(3)], AggregatePolicy())


def test_policy_rejects_bad_values_naming_them():
    for kwargs, match in [
        ({"aggregate": "avg"}, "aggregate must be one of mean, trimmed_mean"),
        ({"aggregate_outlier_ratio": 0.5}, "aggregate_outlier_ratio must be > 1"),
        ({"aggregate_trim_fraction": 0.5}, "aggregate_trim_fraction"),
        ({"aggregate_clip_ratio": 0}, "aggregate_clip_ratio"),
        ({"aggregate_token_cap": 0.5}, "aggregate_token_cap"),
        ({"max_tokens_per_step": 0}, "max_tokens_per_step"),
        ({"screen": "gauntlet"}, "screen must be one of none, loss"),
    ]:
        with pytest.raises(ValueError, match=match):
            AggregatePolicy(**kwargs)


def test_screen_state_rejects_non_finite_floats_only():
    assert screen_state({"a": torch.ones(3), "step": torch.tensor([1], dtype=torch.int64)}) is None
    assert "'a': 1 of 3" in screen_state({"a": torch.tensor([1.0, math.nan, 2.0])})
