"""The decoupled synchronizer with robust aggregation (exchange.contribution_screening): screening
decisions recorded per push, robust merges, a byzantine learner."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from _decoupled_toy import Blocks, eval_loss, train_step
from tolerances import assert_close

from composer_replication.diloco.decoupled import DecoupledLearner, LearnerConfig
from composer_replication.diloco.decoupled.synchronizer import (
    MergeInput,
    Synchronizer,
    SynchronizerConfig,
    aggregate,
    combine_decided,
)
from composer_replication.exchange.store import ObjectStore


def _inputs(attack: float) -> tuple[list[MergeInput], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    common = torch.randn(200, generator=g)
    xs = [common + 0.05 * torch.randn(200, generator=g) for _ in range(4)]
    honest = sum(xs[:3]) / 3
    xs[3] = xs[3] * attack
    return [MergeInput(f"p{i}", 8.0, {"w": x}) for i, x in enumerate(xs)], honest


def test_a_pushed_pseudo_gradient_times_1e6_is_contained() -> None:
    inputs, honest = _inputs(1e6)
    merged, dec = aggregate(inputs, "mean")  # screening on: the outlier is refused, with why
    assert not dec["p3"]["included"] and dec["p3"]["reason"].startswith("norm outlier")
    assert float((merged["w"] - honest).norm()) < 1e-4
    for method in ("trimmed_mean", "median"):  # no screening: the merge itself is robust
        merged, dec = aggregate(inputs, method, outlier_ratio=0)
        assert all(d["included"] for d in dec.values())
        assert float((merged["w"] - honest).norm()) < 0.1 * float(honest.norm())
        assert torch.equal(combine_decided(inputs, dec, method)["w"], merged["w"])  # replay
    merged, _ = aggregate(inputs, "mean", outlier_ratio=0)  # plain mean: ruined
    assert float((merged["w"] - honest).norm()) > 1e4 * float(honest.norm())


def test_a_push_with_a_nan_is_left_out_with_its_reason() -> None:
    inputs, _ = _inputs(1.0)
    inputs[3].tensors["w"][5] = float("nan")
    merged, dec = aggregate(inputs, "mean")
    assert not dec["p3"]["included"] and dec["p3"]["reason"].startswith("non-finite values")
    honest = sum(i.tensors["w"] for i in inputs[:3]) / 3
    assert_close(merged["w"], honest, n=4)  # two fp32 3-term means: n = k + 1


def test_a_robust_merge_of_two_pushes_includes_neither() -> None:
    """With two pushes a trimmed mean trims nothing: an attacker among them would get in (the
    final merges of a run are often that small), so a robust merge refuses them both."""
    inputs, _ = _inputs(1e6)
    for method in ("trimmed_mean", "median", "norm_clip"):
        merged, dec = aggregate(inputs[2:], method, outlier_ratio=0)
        assert merged == {} and not any(d["included"] for d in dec.values())
        assert dec["p3"]["reason"].startswith("too few pushes for a robust merge (2 < 3")
    merged, dec = aggregate(inputs[1:], "trimmed_mean", outlier_ratio=0)  # 3: robust again
    assert all(d["included"] for d in dec.values()) and merged["w"].abs().max() < 10
    merged, dec = aggregate(inputs[2:], "mean", outlier_ratio=0)  # plain mean: as configured
    assert all(d["included"] for d in dec.values())


def test_a_huge_work_claim_is_capped_at_four_times_the_median() -> None:
    """A learner claiming 1e12 x the work of the others weighs 4 x the median, not ~1."""
    inputs, _ = _inputs(1.0)
    inputs[3] = MergeInput("p3", 8.0e12, inputs[3].tensors)
    merged, dec = aggregate(inputs, "mean")
    assert [round(dec[f"p{i}"]["weight"], 9) for i in range(4)] == [
        round(w / 7, 9) for w in (1, 1, 1, 4)
    ]
    assert "capped at 4 x median" in dec["p3"]["note"]
    expected = sum(w * i.tensors["w"] for w, i in zip((1, 1, 1, 4), inputs, strict=True)) / 7
    # 4 weighted fp32 terms (weights rounded to fp32) vs the fp32 formula here: n = k + 2
    assert_close(merged["w"], expected, n=6)


def _learner(uri: str, rank: int, out: dict, attack: float) -> None:
    model = Blocks(seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    learner = DecoupledLearner(
        ObjectStore(uri),
        learner=rank,
        n_learners=4,
        config=LearnerConfig(sync_every_h=8, fragments=4, poll_interval_s=0.02, drain_timeout_s=60),
        model=model,
        inner_optimizer=opt,
    )
    if attack != 1.0:  # a byzantine learner: every push scaled
        honest_push = learner.docs.push

        def push(tensors: dict, **kw: object) -> object:
            return honest_push({k: v * attack for k, v in tensors.items()}, **kw)

        learner.docs.push = push  # type: ignore[method-assign]
    with learner:
        for t in range(48):
            train_step(model, opt, rank, t)
    learner.load_global_weights()
    out[rank] = eval_loss(model)


def _run(tmp: Path, aggregate_: str, attack: float, outlier_ratio: float) -> float:
    uri = str(tmp / f"{aggregate_}-{attack}-{outlier_ratio}")
    cfg = SynchronizerConfig(
        quorum=4,
        aggregate=aggregate_,
        aggregate_outlier_ratio=outlier_ratio,
        poll_interval_s=0.02,
        max_steps=48,
    )
    sync = Synchronizer(ObjectStore(uri), cfg)
    st = threading.Thread(target=sync.run)
    st.start()
    out: dict = {}
    ts = [
        threading.Thread(target=_learner, args=(uri, r, out, attack if r == 3 else 1.0))
        for r in range(4)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    st.join(60)
    assert sync.finished and len(set(out.values())) == 1
    return out[0]


@pytest.mark.slow
def test_a_byzantine_learner_with_trimmed_mean_and_with_plain_mean(tmp_path: Path) -> None:
    start = eval_loss(Blocks(seed=5))  # every learner's model before training
    clean = _run(tmp_path, "mean", 1.0, SynchronizerConfig().aggregate_outlier_ratio)
    trimmed = _run(tmp_path, "trimmed_mean", 1e6, 0.0)
    plain = _run(tmp_path, "mean", 1e6, 0.0)
    assert clean < start  # the clean run learns (1.277 -> 1.025 measured)
    # Contained: the trimmed run keeps learning, at least half the clean run's gain over the
    # start. Not "as good as clean": which pushes make which merge depends on thread timing, and a
    # merge of fewer than 3 pushes is refused whole, so under load it ends up to ~8% worse than
    # clean (measured 1.107 vs 1.025 at load ~20; 1.024 vs 1.025 on a quiet machine). An attacker
    # that got in would send it up by orders of magnitude, like the plain mean below.
    assert start - trimmed > 0.5 * (start - clean), (start, clean, trimmed)
    assert not math.isfinite(plain) or plain > 10 * clean
