"""Channel 2: generalized JSD (vs TRL), TAID, entropy-OPD, TAIDScheduler, chunking, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _loss_tolerance import bound, divergence_bounds

from composer_replication.loss import (
    TAIDScheduler,
    entropy_opd_loss,
    generalized_jsd,
    taid_loss,
)

gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")


def _logits(seed, B, T, V, dtype=torch.float32, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(B, T, V, generator=g, dtype=dtype) * scale).requires_grad_(True)
    t = torch.randn(B, T, V, generator=g, dtype=dtype) * scale
    return s, t


def _mask(seed, B, T):
    g = torch.Generator().manual_seed(seed + 100)
    m = torch.rand(B, T, generator=g) > 0.3
    m[0, 0] = True
    return m


# ---------------------------------------------------------------- generalized JSD vs TRL GKD
@pytest.mark.parametrize(
    "shape, beta, temperature",
    [
        ((2, 5, 11), 0.0, 1.0),
        ((2, 5, 11), 1.0, 1.0),
        ((3, 4, 17), 0.5, 1.0),
        ((1, 7, 32), 0.1, 2.0),
        ((2, 3, 50), 0.9, 0.7),
        ((4, 2, 8), 0.5, 1.5),
    ],
)
def test_generalized_jsd_matches_trl_gkd(shape, beta, temperature):
    s, t = _logits(sum(shape), *shape)
    mask = _mask(sum(shape), *shape[:2])
    ours, metrics = generalized_jsd(
        s, t, beta=beta, temperature=temperature, mask=mask, chunk_size=3
    )
    (g_ours,) = torch.autograd.grad(ours, s)
    labels = torch.where(mask, 1, -100)
    theirs = gkd.GKDTrainer.generalized_jsd_loss(
        s, t, labels=labels, beta=beta, temperature=temperature
    )
    (g_theirs,) = torch.autograd.grad(theirs, s)
    # float32 rounding of two implementations of one divergence (_loss_tolerance)
    value_tol, grad_tol = divergence_bounds(s, t, mask, temperature, extra_ops=4)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=value_tol)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=grad_tol)
    assert metrics["jsd/tokens"] == float(mask.sum())
    assert metrics["jsd/empty_mask"] == 0.0


S_VEC = [0.5, 2.0, -1.0, 0.0]
T_VEC = [2.0, 0.1, 0.3, -0.5]
REF_DIGITS = 5e-11  # reference values printed to 10 decimals (loss.md)
F64_SMALL = bound(torch.float64, n=4, ops=30, scale=4)  # float64, V=4 sums of O(1) terms


@pytest.mark.parametrize(
    "beta, temperature, expected",
    [
        (0.0, 1.0, 0.9942240132),
        (1.0, 1.0, 1.1179250329),
        (0.1, 1.0, 0.0869919445),
        (0.5, 1.0, 0.2359791576),
        (0.9, 1.0, 0.0944512102),
        (0.5, 2.0, 0.0659354889),
    ],
)
def test_generalized_jsd_reference_vectors(beta, temperature, expected):
    s = torch.tensor([[S_VEC]], dtype=torch.float64)
    t = torch.tensor([[T_VEC]], dtype=torch.float64)
    loss, _ = generalized_jsd(s, t, beta=beta, temperature=temperature)
    # the vectors are printed to 10 decimals (+-5e-11); float64 rounding of a V=4 sum is far below
    assert float(loss.detach()) == pytest.approx(expected, abs=REF_DIGITS + F64_SMALL)


def test_jsd_convention_beta0_forward_beta1_reverse():
    s = torch.tensor([[S_VEC]], dtype=torch.float64)
    t = torch.tensor([[T_VEC]], dtype=torch.float64)
    q, p = F.softmax(s, -1), F.softmax(t, -1)
    forward = (p * (p.log() - q.log())).sum()  # KL(teacher || student)
    reverse = (q * (q.log() - p.log())).sum()  # KL(student || teacher)
    # float64, two computations of a V=4 divergence
    assert float(generalized_jsd(s, t, beta=0.0)[0]) == pytest.approx(float(forward), abs=F64_SMALL)
    assert float(generalized_jsd(s, t, beta=1.0)[0]) == pytest.approx(float(reverse), abs=F64_SMALL)


def test_teacher_never_gets_gradient():
    s, t = _logits(1, 2, 3, 9)
    t.requires_grad_(True)
    loss, _ = generalized_jsd(s, t)
    loss.backward()
    assert t.grad is None and s.grad is not None


# ------------------------------------------------------------------- top-k vs TRL's SDPO helpers
@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_matches_trl_sdpo_topk_loss(add_tail, beta):
    loss_utils = pytest.importorskip("trl.experimental.sdpo.loss_utils")
    s, t = _logits(7, 2, 4, 30)
    ours, _ = generalized_jsd(s, t, beta=beta, top_k=5, add_tail=add_tail, chunk_size=3)
    (g_ours,) = torch.autograd.grad(ours, s)
    per_token = loss_utils.compute_topk_self_distillation_loss(
        s, t, distillation_topk=5, distillation_alpha=beta, distillation_add_tail=add_tail
    )
    theirs = per_token.mean()
    (g_theirs,) = torch.autograd.grad(theirs, s)
    # the top-k log-probs are full-vocabulary ones (the divergence bound), then the tail bucket
    # log(1 - sum of the k probabilities) divides their error by the tail mass (>= `tail` here)
    top = torch.softmax(s.detach(), -1).topk(5, -1).values.sum(-1)
    tail = float((1 - top).min())
    value_tol, grad_tol = divergence_bounds(s, t, extra_ops=10)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=value_tol / tail)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=grad_tol / tail)


def test_topk_full_vocab_with_tail_equals_full_divergence():
    s, t = _logits(8, 2, 3, 12, dtype=torch.float64)
    full, _ = generalized_jsd(s, t, beta=0.3)
    topk, _ = generalized_jsd(s, t, beta=0.3, top_k=12, add_tail=False)
    # float64: the renormalisation adds one more V-term log-sum-exp per side
    value_tol, _ = divergence_bounds(s, t, extra_ops=2 * 12)
    torch.testing.assert_close(full, topk, rtol=0, atol=value_tol)


# -------------------------------------------------------------------------- chunking, clipping
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_equals_unchunked(beta):
    s, t = _logits(9, 3, 13, 40, dtype=torch.float64)
    mask = _mask(9, 3, 13)
    results = []
    for chunk in (1, 4, 7, 10_000, None):
        loss, _ = generalized_jsd(s, t, beta=beta, mask=mask, chunk_size=chunk, temperature=1.3)
        (g,) = torch.autograd.grad(loss, s)
        results.append((loss, g))
    # float64: the same kernel per token, the token sums in another order
    value_tol, grad_tol = divergence_bounds(s, t, mask, 1.3)
    for loss, g in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=0, atol=value_tol)
        torch.testing.assert_close(g, results[0][1], rtol=0, atol=grad_tol)


def test_non_contiguous_student_slice_like_compose_uses():
    g = torch.Generator().manual_seed(10)
    full = torch.randn(2, 9, 15, generator=g, requires_grad=True)
    t = torch.randn(2, 5, 15, generator=g)
    sliced = full[:, 3:8]  # a non-contiguous view, as logits[:, P-1:-1]
    ours, _ = generalized_jsd(sliced, t, chunk_size=2)
    (g_ours,) = torch.autograd.grad(ours, full)
    ref = gkd.GKDTrainer.generalized_jsd_loss(sliced, t, labels=torch.zeros(2, 5, dtype=torch.long))
    (g_ref,) = torch.autograd.grad(ref, full)
    _, grad_tol = divergence_bounds(sliced, t, extra_ops=4)  # float32, vs TRL's formula
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=grad_tol)


def test_token_clip_caps_each_token_and_drops_its_gradient():
    s, t = _logits(11, 1, 6, 10, dtype=torch.float64)
    per_token = []
    for i in range(6):
        per_token.append(
            float(generalized_jsd(s[:, i : i + 1], t[:, i : i + 1], beta=0.5)[0].detach())
        )
    clip = sorted(per_token)[3]
    loss, metrics = generalized_jsd(s, t, beta=0.5, token_clip=clip)
    value_tol, _ = divergence_bounds(s, t)  # float64: per-token values summed two ways
    assert float(loss.detach()) == pytest.approx(
        sum(min(v, clip) for v in per_token) / 6, abs=value_tol
    )
    assert metrics["jsd/clip_frac"] == sum(v > clip for v in per_token) / 6  # a count / 6
    (g,) = torch.autograd.grad(loss, s)
    for i, v in enumerate(per_token):
        assert (float(g[0, i].abs().sum()) == 0.0) == (v > clip)


def test_all_false_mask_zero_loss_zero_grad_metric():
    for fn in (
        lambda s, t, m: generalized_jsd(s, t, mask=m),
        lambda s, t, m: generalized_jsd(s, t, mask=m, top_k=3),
        lambda s, t, m: taid_loss(s, t, 0.5, mask=m),
        lambda s, t, m: entropy_opd_loss(s, t, mask=m),
    ):
        s, t = _logits(12, 2, 3, 7)
        loss, metrics = fn(s, t, torch.zeros(2, 3, dtype=torch.bool))
        (g,) = torch.autograd.grad(loss, s)
        assert float(loss.detach()) == 0.0 and torch.count_nonzero(g) == 0
        assert [v for k, v in metrics.items() if k.endswith("/empty_mask")] == [1.0]


def test_bf16_logits_are_upcast():
    s, t = _logits(13, 2, 4, 64)
    ref, _ = generalized_jsd(s.to(torch.bfloat16).float(), t.to(torch.bfloat16).float())
    s16 = s.detach().to(torch.bfloat16).requires_grad_(True)
    loss, _ = generalized_jsd(s16, t.to(torch.bfloat16))
    loss.backward()
    assert s16.grad is not None and s16.grad.dtype == torch.bfloat16
    assert loss.dtype == torch.float32  # the loss value itself is kept in fp32
    # both computed in float32 from the same bf16-rounded logits: float32's bound, not bf16's
    value_tol, _ = divergence_bounds(s.to(torch.bfloat16).float(), t.to(torch.bfloat16).float())
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), abs=value_tol)


def test_gradcheck_float64_all_distillation_losses():
    s, t = _logits(14, 1, 3, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    losses = [
        lambda x: generalized_jsd(x, t, beta=0.0, temperature=1.5, mask=mask, chunk_size=1)[0],
        lambda x: generalized_jsd(x, t, beta=1.0, temperature=0.7, mask=mask)[0],
        lambda x: generalized_jsd(x, t, beta=0.3, temperature=1.3, mask=mask, chunk_size=2)[0],
        lambda x: generalized_jsd(x, t, beta=0.3, top_k=3, mask=mask, token_clip=0.5)[0],
        lambda x: generalized_jsd(x, t, beta=0.6, top_k=2, add_tail=False)[0],
        # t = 1: no stop-gradient inside, so the loss is an ordinary function of x
        lambda x: taid_loss(x, t, 1.0, mask=mask, temperature=1.2)[0],
        lambda x: entropy_opd_loss(x, t, h_max=1.2, temperature=1.1)[0],
        lambda x: entropy_opd_loss(x, t, h_max=1.2, mode="add", fkl_coef=0.7)[0],
    ]
    for fn in losses:
        assert torch.autograd.gradcheck(fn, (s,), fast_mode=True)


def test_backward_twice_with_retained_graph():
    s, t = _logits(15, 1, 3, 5)
    loss, _ = generalized_jsd(s, t)
    (g1,) = torch.autograd.grad(loss * 2, s, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, s)
    assert torch.equal(g1, 2 * g2)  # scaling by 2 is exact in binary floating point


# ------------------------------------------------------------------------------------- TAID
def _taid_reference(s, t, tt, mask):
    target = F.softmax((1 - tt) * s.detach() + tt * t, -1)
    per_token = -(target * F.log_softmax(s, -1)).sum(-1)
    return per_token[mask].mean()


@pytest.mark.parametrize("tt", [0.0, 0.4, 0.73, 1.0])
def test_taid_matches_straightforward_implementation(tt):
    s, t = _logits(16, 2, 5, 13)
    mask = _mask(16, 2, 5)
    ours, metrics = taid_loss(s, t, tt, mask=mask, chunk_size=2)
    (g_ours,) = torch.autograd.grad(ours, s)
    ref = _taid_reference(s, t, tt, mask)
    (g_ref,) = torch.autograd.grad(ref, s)
    # float32: a cross-entropy to the target softmax((1-t) s + t z), i.e. a divergence between
    # the student and those logits plus the target's entropy (same terms). At t = 0 the exact
    # gradient is 0 and each entry is the difference of two roundings of q: the absolute floor.
    target = ((1 - tt) * s + tt * t).detach()
    value_tol, grad_tol = divergence_bounds(s, target, mask, extra_ops=4)
    torch.testing.assert_close(ours, ref, rtol=0, atol=value_tol)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=grad_tol)
    assert metrics["taid/t"] == tt


def test_taid_reference_vectors():
    s = torch.tensor([[S_VEC]], dtype=torch.float64)
    t = torch.tensor([[T_VEC]], dtype=torch.float64)
    assert float(taid_loss(s, t, 0.4)[0]) == pytest.approx(1.3553625320, abs=REF_DIGITS + F64_SMALL)
    assert float(taid_loss(s, t, 1.0)[0]) == pytest.approx(1.9064890679, abs=REF_DIGITS + F64_SMALL)


def test_taid_t0_zero_teacher_gradient():
    s, t = _logits(17, 2, 4, 9, dtype=torch.float64)
    loss, _ = taid_loss(s, t, 0.0)
    (g,) = torch.autograd.grad(loss, s)
    # target = the student itself: nothing to learn; each entry is q minus a second rounding of q
    value_tol, grad_tol = divergence_bounds(s, s)
    assert float(g.abs().max()) <= grad_tol
    other, _ = taid_loss(s, t * -3 + 1, 0.0)
    assert float(loss.detach()) == float(other.detach())  # the teacher does not enter at all


def test_taid_t1_gradient_equals_forward_kl():
    s, t = _logits(18, 2, 4, 9, dtype=torch.float64)
    mask = _mask(18, 2, 4)
    taid, _ = taid_loss(s, t, 1.0, mask=mask)
    (g_taid,) = torch.autograd.grad(taid, s)
    fkl, _ = generalized_jsd(s, t, beta=0.0, mask=mask)
    (g_fkl,) = torch.autograd.grad(fkl, s)
    value_tol, grad_tol = divergence_bounds(s, t, mask)  # float64, two formulas
    torch.testing.assert_close(g_taid, g_fkl, rtol=0, atol=grad_tol)
    p = F.softmax(t, -1)
    entropy = -(p * p.log()).sum(-1)[mask].mean()  # CE = KL + teacher entropy
    # three divergence-sized sums (CE, KL, the entropy), each within the value bound
    assert float((taid - fkl).detach()) == pytest.approx(float(entropy), abs=3 * value_tol)


# ------------------------------------------------------------------------------ TAIDScheduler
def _scheduler_reference(losses, steps, total, t0=0.4, t1=1.0, a=5e-4, b=0.99):
    """The TAID paper code's update_t, restated."""
    t, m, prev, out = t0, 0.0, math.inf, []
    for loss, step in zip(losses, steps):
        if prev == math.inf:
            prev = loss
            out.append(t)
            continue
        rel = (prev - loss) / (prev + 1e-15)
        m = b * m + (1 - b) * rel
        dt = a * (1 / (1 + math.exp(-m))) * (1 - t)
        t = min(t1, max(t0 + (t1 - t0) * step / total, t + dt))
        prev = loss
        out.append(t)
    return out


def test_taid_scheduler_trajectory():
    losses = [3.0, 2.5, 2.6, 2.0, 1.0, 1.0, 0.9, 5.0, 0.5, 0.4] * 3
    total = 40
    sched = TAIDScheduler()
    got = [sched.step(loss, step, total) for step, loss in enumerate(losses)]
    expected = _scheduler_reference(losses, range(len(losses)), total)
    # python floats (float64): a recurrence of ~10 operations per step over 30 steps on values <= 5
    assert got == pytest.approx(expected, abs=bound(torch.float64, n=30, ops=10 * 30, scale=5))
    assert got[0] == 0.4  # first call only records the loss
    assert all(b >= a for a, b in zip(got, got[1:]))  # monotone
    assert got[-1] >= 0.4 + 0.6 * 29 / 40  # never below the linear floor
    # adaptive part: with a large alpha, a falling loss pushes t above the linear floor
    fast = TAIDScheduler(alpha=0.5)
    ts = [fast.step(10.0 / (i + 1), i, 1000) for i in range(5)]
    assert ts[-1] > 0.4 + 0.6 * 4 / 1000 + 0.1
    assert max(TAIDScheduler(alpha=1.0).step(1.0 / (i + 1), i, 10) for i in range(50)) <= 1.0
    lin = TAIDScheduler(adaptive=False)
    linear = [lin.step(1.0, s, 10) for s in (0, 5, 10)]  # t0 + (t1 - t0) * s / total: 4 ops
    assert linear == pytest.approx([0.4, 0.7, 1.0], abs=bound(torch.float64, n=1, ops=4, scale=1))


def test_taid_scheduler_state_roundtrip_and_validation():
    a = TAIDScheduler()
    for i, loss in enumerate([2.0, 1.5, 1.2]):
        a.step(torch.tensor(loss), i, 100)
    b = TAIDScheduler()
    b.load_state_dict(a.state_dict())
    assert a.step(1.0, 3, 100) == b.step(1.0, 3, 100)
    for kwargs, name in [
        ({"t_start": 1.0}, "t_start"),
        ({"t_end": 0.0}, "t_end"),
        ({"alpha": 2.0}, "alpha"),
        ({"beta": -0.1}, "beta"),
    ]:
        with pytest.raises(ValueError, match=name):
            TAIDScheduler(**kwargs)
    with pytest.raises(ValueError, match="loss"):
        TAIDScheduler().step(float("nan"), 0, 10)


# ------------------------------------------------------------------------------ entropy-OPD
def _eopd_reference(s, t, h_max, mask, mode="switch", coef=1.0, temperature=1.0):
    log_q = F.log_softmax(s / temperature, -1)
    log_p = F.log_softmax(t / temperature, -1)
    p, q = log_p.exp(), log_q.exp()
    entropy = -(p * log_p).sum(-1)
    fkl = (p * (log_p - log_q)).sum(-1)
    rkl = (q * (log_q - log_p)).sum(-1)
    gate = (entropy > h_max).to(s.dtype)
    per_token = gate * fkl + (1 - gate) * rkl if mode == "switch" else rkl + coef * gate * fkl
    return per_token[mask].mean(), gate[mask].mean()


@pytest.mark.parametrize("mode, coef, temperature", [("switch", 1.0, 1.0), ("add", 0.5, 1.4)])
def test_entropy_opd_matches_straightforward_implementation(mode, coef, temperature):
    s, t = _logits(19, 3, 6, 10, scale=1.5)
    mask = _mask(19, 3, 6)
    # pick h_max at the median teacher entropy so both branches are exercised
    p = F.softmax(t / temperature, -1)
    h = -(p * p.log()).sum(-1)[mask]
    hs = h.sort().values
    mid = len(hs) // 2
    h_max = float(hs[mid - 1] + hs[mid]) / 2  # between two entropies: no float tie at the gate
    ours, metrics = entropy_opd_loss(
        s,
        t,
        h_max=h_max,
        mask=mask,
        mode=mode,
        fkl_coef=coef,
        temperature=temperature,
        chunk_size=4,
    )
    (g_ours,) = torch.autograd.grad(ours, s)
    ref, gate_frac = _eopd_reference(s, t, h_max, mask, mode, coef, temperature)
    (g_ref,) = torch.autograd.grad(ref, s)
    # float32; "add" sums two divergences (the second times coef <= 1): twice the bounds
    value_tol, grad_tol = divergence_bounds(s, t, mask, temperature)
    torch.testing.assert_close(ours, ref, rtol=0, atol=2 * value_tol)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=2 * grad_tol)
    assert 0.0 < metrics["eopd/gate_frac"] < 1.0
    assert metrics["eopd/gate_frac"] == float(gate_frac)  # a count over the same tokens
    # the entropy is a divergence-sized V-term sum of p log p (scale: max |log p| <= the value's)
    assert metrics["eopd/teacher_entropy"] == pytest.approx(float(h.mean()), abs=value_tol)


def test_entropy_opd_zero_when_student_equals_teacher():
    s, _ = _logits(20, 2, 5, 11)
    for mode, h_max in (("switch", 0.5), ("switch", 100.0), ("add", 0.0)):
        loss, _ = entropy_opd_loss(s, s.detach().clone(), h_max=h_max, mode=mode)
        (g,) = torch.autograd.grad(loss, s)
        value_tol, grad_tol = divergence_bounds(s, s)  # exact value 0: the floor (E = 0)
        assert abs(float(loss.detach())) <= value_tol and float(g.abs().max()) <= grad_tol


# ------------------------------------------------------------------------------- bad input
def test_shape_and_vocab_mismatch_raise():
    s, t = _logits(21, 2, 3, 7)
    for fn in (
        lambda a, b, **k: generalized_jsd(a, b, **k),
        lambda a, b, **k: taid_loss(a, b, 0.5, **k),
        lambda a, b, **k: entropy_opd_loss(a, b, **k),
    ):
        with pytest.raises(ValueError, match="vocab mismatch"):
            fn(s, t[..., :5])
        with pytest.raises(ValueError, match="teacher_logits"):
            fn(s, t[:, :2])
        with pytest.raises(ValueError, match="student_logits"):
            fn(s[0], t[0])
        with pytest.raises(ValueError, match="mask"):
            fn(s, t, mask=torch.ones(2, 4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", ["student_logits", "teacher_logits"])
def test_non_finite_logits_raise_naming_argument(bad, which):
    s, t = _logits(22, 2, 3, 7)
    s = s.detach().clone()
    (s if which == "student_logits" else t)[1, 2, 4] = bad
    for fn in (
        lambda: generalized_jsd(s, t, beta=0.0),
        lambda: generalized_jsd(s, t, beta=1.0),
        lambda: generalized_jsd(s, t, beta=0.5),
        lambda: taid_loss(s, t, 0.5),
        lambda: entropy_opd_loss(s, t),
    ):
        with pytest.raises(ValueError, match=which):
            fn()
    # masked-out positions may hold anything
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    assert math.isfinite(float(generalized_jsd(s, t, mask=mask)[0]))


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda s, t: generalized_jsd(s, t, beta=1.2), "beta"),
        (lambda s, t: generalized_jsd(s, t, beta=-0.1), "beta"),
        (lambda s, t: generalized_jsd(s, t, temperature=0.0), "temperature"),
        (lambda s, t: generalized_jsd(s, t, token_clip=0.0), "token_clip"),
        (lambda s, t: generalized_jsd(s, t, top_k=0), "top_k"),
        (lambda s, t: generalized_jsd(s, t, top_k=8), "top_k"),
        (lambda s, t: generalized_jsd(s, t, chunk_size=0), "chunk_size"),
        (lambda s, t: taid_loss(s, t, 1.5), "t"),
        (lambda s, t: taid_loss(s, t, -0.1), "t"),
        (lambda s, t: entropy_opd_loss(s, t, h_max=-1.0), "h_max"),
        (lambda s, t: entropy_opd_loss(s, t, mode="mix"), "mode"),
    ],
)
def test_out_of_range_arguments_raise(call, name):
    s, t = _logits(23, 1, 2, 7)
    with pytest.raises(ValueError, match=name):
        call(s, t)


def test_no_grad_mode_builds_no_gradient_and_same_value():
    s, t = _logits(24, 2, 3, 9)
    loss, _ = generalized_jsd(s, t)
    with torch.no_grad():
        loss_ng, _ = generalized_jsd(s, t)
    assert not loss_ng.requires_grad
    assert float(loss_ng) == float(loss.detach())  # the same operations; the gradient only adds


def test_worker_threads_give_identical_results_and_propagate_errors():
    """With >1 torch threads, chunks run on the loss worker pool; results must not change."""
    from composer_replication.loss._logprobs import selective_log_softmax

    s, t = _logits(25, 2, 9, 13)
    mask = _mask(25, 2, 9)
    ids = torch.randint(0, 13, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)  # the autouse fixture restores the setting
        loss, metrics = entropy_opd_loss(s, t, mask=mask, chunk_size=2, h_max=2.0)
        (g,) = torch.autograd.grad(loss, s)
        logps = selective_log_softmax(s, ids, 0.9)
        (g2,) = torch.autograd.grad(logps.sum(), s)
        results.append((loss.detach(), g, metrics, logps.detach(), g2))
    (l1, g1, m1, p1, q1), (l2, g2_, m2, p2, q2) = results
    assert torch.equal(l1, l2) and torch.equal(g1, g2_) and m1 == m2
    assert torch.equal(p1, p2) and torch.equal(q1, q2)
    bad = t.clone()
    bad[1, 8, 3] = float("nan")
    with pytest.raises(ValueError, match="teacher_logits"):
        generalized_jsd(s, bad, chunk_size=1)


_FORK_SCRIPT = """
import os, sys, torch
from composer_replication.loss import generalized_jsd
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
s, t = torch.randn(1, 6, 9, generator=g), torch.randn(1, 6, 9, generator=g)
parent = float(generalized_jsd(s, t, chunk_size=1)[0])  # creates the worker pool
pid = os.fork()
if pid == 0:  # the child inherits the pool object but not its threads
    child = float(generalized_jsd(s, t, chunk_size=1)[0])
    os._exit(0 if child == parent else 3)  # the same computation: the same bits
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_worker_pool_survives_fork():
    """A forked child (e.g. a fork-started data worker) must get its own pool, not hang on the
    parent's thread-less one. Runs in a fresh interpreter so no foreign threads are forked."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], timeout=240, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
