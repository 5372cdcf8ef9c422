"""What the synchronous exchange screens: one test per sentence of docs/object-store.md's
"What is screened" section (the test names are the sentences).

Ranks are threads of one process sharing a file:// store (each with its own
ObjectStoreAllReduce, as separate processes would); a bad rank sends its payload through the
normal `allreduce` path, well-formed and correctly checksummed, as a buggy or hostile replica
would. Expected values are float64 means computed here from the honest tensors.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from allreduce_handles import exchange
from tolerances import assert_close

from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.contribution_screening import AggregatePolicy
from composer_replication.exchange.protocol import CorruptContributionError, commit_key
from composer_replication.exchange.store import ObjectStore

SHAPES = {"w": (16, 8), "b": (8,)}


def honest(rank: int, step: int = 0) -> dict[str, torch.Tensor]:
    """Correlated pseudo-gradients (a shared direction plus 10% noise), like DiLoCo's."""
    g = torch.Generator().manual_seed(step)
    common = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    g = torch.Generator().manual_seed(1000 + 17 * rank + step)
    return {k: common[k] + 0.1 * torch.randn(s, generator=g) for k, s in SHAPES.items()}


def mean_of(ranks, weights=None, step=0):
    ws = weights or {r: 1 / len(ranks) for r in ranks}
    return {k: sum(ws[r] * honest(r, step)[k].double() for r in ranks).float() for k in SHAPES}


def run(uri, payloads, *, step=0, tokens=None, inner_steps=None, **kwargs):
    """Every rank's allreduce in its own thread: {rank: (result or exception, last_result)};
    a rank whose payload is None is not started."""
    kwargs.setdefault("timeout_s", 10)
    kwargs.setdefault("poll_interval_s", 0.01)
    out = {}

    def go(r):
        ar = exchange(uri, len(payloads), r, **kwargs)
        try:
            res = ar.allreduce(
                payloads[r],
                step=step,
                tokens=None if tokens is None else tokens[r],
                inner_steps=None if inner_steps is None else inner_steps[r],
            )
            out[r] = (res, ar.last_result)
        except Exception as e:
            out[r] = (e, ar.last_result)
        finally:
            ar.close()

    ranks = [r for r, p in enumerate(payloads) if p is not None]
    threads = [threading.Thread(target=go, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def assert_all_equal(out, expected):
    """Bit-identical on every replica, and the float64 reference mean (rounded once) to the
    bound of a k-rank fp32 weighted sum (n = k + 1, tests/tolerances.py); k <= WORLD."""
    first = next(iter(out.values()))[0]
    for res, _ in out.values():
        assert not isinstance(res, Exception), res
        for k in SHAPES:
            assert torch.equal(res[k], first[k])  # bit-identical on every replica
            assert_close(res[k], expected[k], n=len(out) + 1, what=k)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_contribution_with_a_nan_or_infinite_value_is_left_out_of_the_round(tmp_path, bad):
    payloads = [honest(r) for r in range(4)]
    payloads[2]["w"][3, 4] = bad
    out = run(str(tmp_path), payloads, min_replicas=3)
    assert_all_equal(out, mean_of([0, 1, 3]))
    for _, sr in out.values():
        assert sr.included_ranks == [0, 1, 3]
        assert "non-finite values ('w': 1 of 128 values are NaN/inf)" in sr.rejected[2]


def test_a_finite_contribution_whose_norm_exceeds_outlier_ratio_times_the_median_is_left_out(
    tmp_path,
):
    payloads = [honest(r) for r in range(4)]
    payloads[0] = {k: torch.full(s, 1e30) for k, s in SHAPES.items()}  # the payload
    out = run(str(tmp_path), payloads, min_replicas=3)
    assert_all_equal(out, mean_of([1, 2, 3]))
    assert all("norm outlier" in sr.rejected[0] for _, sr in out.values())
    # a 5x larger contribution is within the default ratio (10) and stays in
    payloads = [honest(r, step=1) for r in range(4)]
    payloads[0] = {k: 5 * v for k, v in payloads[0].items()}
    out = run(str(tmp_path), payloads, step=1, min_replicas=3)
    assert all(sr.included_ranks == [0, 1, 2, 3] for _, sr in out.values())


def test_norm_screening_needs_three_contributions(tmp_path):
    payloads = [honest(0), {k: 100 * v for k, v in honest(1).items()}]
    out = run(str(tmp_path), payloads)
    assert all(sr.included_ranks == [0, 1] for _, sr in out.values())


def test_an_inconsistent_token_claim_is_left_out_and_a_large_claim_is_capped(tmp_path):
    payloads = [honest(r) for r in range(4)]
    policy = AggregatePolicy(weighting="tokens", max_tokens_per_step=100, max_inner_steps=10)
    tokens, steps = [900, 1000, 10**12, 800], [10, 10, 10, 10]
    out = run(
        str(tmp_path),
        payloads,
        tokens=tokens,
        inner_steps=steps,
        aggregate=policy,
        weighting="tokens",
        min_replicas=3,
    )
    w = {0: 900 / 2700, 1: 1000 / 2700, 3: 800 / 2700}
    assert_all_equal(out, mean_of([0, 1, 3], w))
    assert all(
        "inconsistent claim: 1000000000000 tokens" in sr.rejected[2] for _, sr in out.values()
    )
    # without bounds the claim is capped at token_cap (4) x the median claim instead
    capped = AggregatePolicy(weighting="tokens")
    out = run(
        str(tmp_path),
        payloads,
        step=1,
        tokens=[100, 100, 10**12, 100],
        aggregate=capped,
        weighting="tokens",
    )
    sr = out[0][1]
    assert sr.included_ranks == [0, 1, 2, 3]
    # the weights are float64 ratios of integer token counts: one rounding each (2**-53)
    assert sr.weights[2] == pytest.approx(400 / 700, rel=2.0**-52, abs=0)
    assert sr.weights[0] == pytest.approx(100 / 700, rel=2.0**-52, abs=0)


def test_every_exclusion_is_listed_with_its_rank_and_reason(tmp_path):
    payloads = [honest(r) for r in range(4)]
    payloads[1]["b"][0] = math.nan
    out = run(str(tmp_path), payloads, min_replicas=3)
    commit = ObjectStore(str(tmp_path)).get_json(commit_key(0))
    assert commit["excluded"]["1"].startswith("screened out: non-finite values")
    assert commit["decisions"]["1"]["included"] is False
    assert commit["decisions"]["0"]["norm"] > 0 and commit["aggregate"] == "mean"
    for _, sr in out.values():
        assert sr.rejected == {1: commit["excluded"]["1"]}


def test_too_few_contributions_left_after_screening_commit_nothing(tmp_path):
    payloads = [honest(r) for r in range(3)]
    payloads[0]["w"][0, 0] = math.inf
    out = run(str(tmp_path), payloads)  # min_replicas = 3
    for res, _ in out.values():
        assert isinstance(res, CorruptContributionError) and "nothing committed" in str(res)
        assert "non-finite" in str(res)
    assert ObjectStore(str(tmp_path)).get(commit_key(0)) is None


@pytest.mark.parametrize("method", ["trimmed_mean", "median", "norm_clip"])
def test_robust_merges_keep_one_scaled_contribution_close_to_the_honest_mean(tmp_path, method):
    """Screening off (outlier_ratio=0): the merge alone bounds one x1e6 contribution."""
    payloads = [honest(r) for r in range(4)]
    payloads[3] = {k: 1e6 * v for k, v in payloads[3].items()}
    policy = AggregatePolicy(aggregate=method, aggregate_outlier_ratio=0)
    out = run(str(tmp_path), payloads, aggregate=policy)
    ref = mean_of([0, 1, 2])
    first = out[0][0]
    for res, sr in out.values():
        assert sr.included_ranks == [0, 1, 2, 3] and sr.aggregate == method
        assert all(torch.equal(res[k], first[k]) for k in SHAPES)
    err = math.sqrt(sum(float((first[k] - ref[k]).pow(2).sum()) for k in SHAPES))
    size = math.sqrt(sum(float(ref[k].pow(2).sum()) for k in SHAPES))
    assert err < 0.1 * size, (method, err / size)
    # the plain mean is dragged 1e6/4 times away
    out = run(
        str(tmp_path), payloads, step=0 + 1, aggregate=AggregatePolicy(aggregate_outlier_ratio=0)
    )
    res = out[0][0]
    err = math.sqrt(
        sum(float((res[k] - mean_of([0, 1, 2], step=1)[k]).pow(2).sum()) for k in SHAPES)
    )
    assert err > 1e4 * size


def test_screen_loss_leaves_out_a_contribution_that_raises_the_held_out_loss(tmp_path):
    target = mean_of([0, 1, 2, 3])  # the direction that lowers the loss

    def probe(candidate):  # loss after one outer step from w=0 by -candidate: ||-c - t||^2
        return sum(float((-candidate[k] - (-target[k])).pow(2).sum()) for k in SHAPES)

    payloads = [honest(r) for r in range(4)]
    payloads[1] = {k: -3 * v for k, v in payloads[1].items()}  # a harmful direction
    policy = AggregatePolicy(screen="loss", aggregate_outlier_ratio=0)
    out = run(str(tmp_path), payloads, aggregate=policy, loss_probe=probe, min_replicas=3)
    assert_all_equal(out, mean_of([0, 2, 3]))
    assert all("harmful" in sr.rejected[1] for _, sr in out.values())


def test_a_published_global_state_with_a_non_finite_value_is_neither_published_nor_loaded(
    tmp_path,
):
    ar = ObjectStoreAllReduce(str(tmp_path), 2)
    with pytest.raises(ValueError, match="'w': 1 of 4 values are NaN/inf"):
        ar.publish_state({"w": torch.tensor([1.0, math.nan, 2.0, 3.0])}, round=1)
    assert ar.fetch_state() is None
    # planted by someone else, bypassing publish_state: refused when read
    from composer_replication.exchange.document_format import encode_state, state_key

    blob = encode_state({"w": torch.tensor([math.inf])}, name="global", round=2, extra={})
    assert ObjectStore(str(tmp_path)).put_if_absent(state_key("global", 2), blob)
    with pytest.raises(CorruptContributionError, match="round 2 is refused: 'w': 1 of 1"):
        ar.fetch_state()
