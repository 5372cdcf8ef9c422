"""Channel 2 fused with the output layer: ``fused_linear_jsd`` and ``fused_sdpo_term``.

The reference is ``generalized_jsd`` on materialised logits ``h @ W.T + b`` (itself checked
against TRL in test_loss_distill.py), with autograd through the matmul for the hidden-state,
weight and bias gradients. Tolerances come from `_fused_bounds` (float arithmetic, see
_loss_tolerance.py); float64 runs are compared at float64's bound, float32 at float32's.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from _loss_tolerance import bound, unit_roundoff

from composer_replication.loss import (
    FUSED_JSD_BACKENDS,
    _fused_backends,
    fused_linear_jsd,
    fused_sdpo_term,
    generalized_jsd,
    sdpo_term,
)
from composer_replication.loss._fused_math import FusedProblem

B, T, H, V = 2, 5, 16, 257  # V odd: vocabulary chunks of 64 leave a ragged last chunk


def _inputs(seed, dtype=torch.float64, *, bias=False, teacher_head=False, Ht=H):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    ht = torch.randn(B, T, Ht, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4).to(dtype).requires_grad_(True)
    b = None
    if bias:
        b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.3).to(dtype).requires_grad_(True)
    wt = bt = None
    if teacher_head:
        wt = (torch.randn(V, Ht, generator=g, dtype=torch.float64) * 0.4).to(dtype)
        bt = (torch.randn(V, generator=g, dtype=torch.float64) * 0.3).to(dtype) if bias else None
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    return hs, ht, w, b, wt, bt, mask


def _reference(hs, ht, w, b, wt, bt, mask, **kw):
    """generalized_jsd on materialised logits; gradients by autograd through the matmul."""
    zs = hs @ w.t() + (b if b is not None else 0.0)
    teacher_w = w if wt is None else wt
    teacher_b = (b if wt is None else bt) if (b is not None or bt is not None) else None
    zt = (ht @ teacher_w.t() + (teacher_b if teacher_b is not None else 0.0)).detach()
    zs.retain_grad()
    loss, metrics = generalized_jsd(zs, zt, mask=mask, **kw)
    params = [x for x in (hs, w, b) if x is not None]
    grads = torch.autograd.grad(loss, params + [zs], allow_unused=True)
    return loss.detach(), metrics, grads[:-1], grads[-1], zs.detach(), zt


def _fused_bounds(dtype, hs, ht, w, b, wt, bt, mask, zs, zt, g_logits, temperature):
    """Largest differences float arithmetic allows between two correct computations.

    Per log-prob ``z/tau - logsumexp(z/tau)``: the logit is an H-term dot product plus the bias,
    off by at most ``(H + 2) u Z`` (``Z = max sum_k |h_k w_k| + |b|``), the V-term sum of the
    exponentials (positive terms) by ``(V + 4) u`` relative, i.e. an absolute error of its log,
    and the subtraction by ``2 u |z| / tau``: together ``e_lp``. A per-token divergence
    ``sum_v p (log p - log q)`` (or with ``log m``) moves by at most ``e_lp`` per unit of weight
    (p and q sum to 1: 2 e_lp) plus ``e_lp`` times ``E = sum_v (p + q) |log p - log q|`` (the
    relative error of p or q multiplies the log-ratio), plus its own V-term sum, ``(V + 2) u E``.
    A logits-gradient entry (``(q - p)``, or ``q (log q - log m - c)``, over ``tau N``) is off by at
    most ``e_lp (q + p) (3 + |log q - log p| + E)`` over ``tau N`` (the row's constant c is a
    divergence, off by the value bound); the hidden gradient ``g @ W`` sums V such entries, the
    weight gradient ``g^T @ h`` and the bias gradient sum N (tokens), each with its own
    ``(n + 2) u`` sum error. Two implementations: twice each bound. All magnitudes are taken
    from the actual tensors, so the bounds hold on any CPU whatever order it sums in.
    """
    u = unit_roundoff(dtype)
    m = mask.reshape(-1)
    hs_ = hs.detach().reshape(-1, hs.shape[-1])[m]
    ht_ = ht.detach().reshape(-1, ht.shape[-1])[m]
    tw = w if wt is None else wt
    tb = (b if wt is None else bt) if (b is not None or bt is not None) else None
    mags = []
    for h, ww, bb in ((hs_, w.detach(), b), (ht_, tw.detach(), tb)):
        mag = h.abs() @ ww.abs().t() + (bb.detach().abs() if bb is not None else 0.0)
        mags.append(float(mag.max()))
    z_max = max(float(zs.abs().max()), float(zt.abs().max())) / temperature
    Hs, N = hs.shape[-1], int(m.sum())
    lq = torch.log_softmax(zs.reshape(-1, V)[m] / temperature, -1)
    lp = torch.log_softmax(zt.reshape(-1, V)[m] / temperature, -1)
    q, p = lq.exp(), lp.exp()
    ratio = (lq - lp).abs()
    E = float(((q + p) * ratio).sum(-1).max())
    e_lp = u * ((Hs + 2) * max(mags) / temperature + (V + 4) + 2 * z_max)
    A = (q + p) * (3 + ratio + E) * e_lp / (temperature * N)  # per logits-gradient entry
    g = g_logits.reshape(-1, V)[m].abs()
    wa, ha = w.detach().abs(), hs_.abs()
    return {
        "value": 2 * (e_lp * (2 + E) + (V + 2) * u * E),
        "hidden": 2 * (float((A @ wa).max()) + (V + 2) * u * float((g @ wa).max())),
        "weight": 2 * (float((A.t() @ ha).max()) + (N + 2) * u * float((g.t() @ ha).max())),
        "bias": 2 * (float(A.sum(0).max()) + (N + 2) * u * float(g.sum(0).max())),
    }


def _median_clip(hs, ht, w, b, mask, beta, temperature=1.0):
    """A token clip between the two middle per-token divergences (so some tokens are clipped,
    some not, and none sits at the clip where rounding could decide)."""
    zs = (hs @ w.t() + (b if b is not None else 0.0)).detach()
    zt = (ht @ w.t() + (b if b is not None else 0.0)).detach()
    per_token = [
        float(
            generalized_jsd(
                zs[i : i + 1, j : j + 1],
                zt[i : i + 1, j : j + 1],
                beta=beta,
                temperature=temperature,
            )[0]
        )
        for i in range(B)
        for j in range(T)
        if mask[i, j]
    ]
    values = sorted(per_token)
    clip = (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    return clip, sum(v > clip for v in per_token) / len(per_token)


def _check(fused, ref, bounds, names=("hidden", "weight", "bias")):
    loss, grads = fused
    ref_loss, ref_grads = ref
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype), rtol=0, atol=bounds["value"])
    for name, got, want in zip(names, grads, ref_grads, strict=False):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=0, atol=bounds[name], msg=name)


# ------------------------------------------------------------------ exact vs materialised logits
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_matches_generalized_jsd_on_logits(dtype, beta, temperature, bias):
    hs, ht, w, b, _, _, mask = _inputs(int(beta * 10 + temperature * 3 + bias), dtype, bias=bias)
    kw = dict(beta=beta, temperature=temperature)
    loss, metrics = fused_linear_jsd(
        hs, ht, w, b, mask=mask, chunk_size=3, vocab_chunk_size=64, backend="torch", **kw
    )
    params = [x for x in (hs, w, b) if x is not None]
    grads = torch.autograd.grad(loss, params)
    ref_loss, ref_metrics, ref_grads, g_logits, zs, zt = _reference(
        hs, ht, w, b, None, None, mask, **kw
    )
    bounds = _fused_bounds(dtype, hs, ht, w, b, None, None, mask, zs, zt, g_logits, temperature)
    _check((loss, grads), (ref_loss, ref_grads), bounds)
    assert metrics["jsd/tokens"] == ref_metrics["jsd/tokens"] == float(mask.sum())
    assert metrics["jsd/clip_frac"] == 0.0 and metrics["jsd/empty_mask"] == 0.0
    assert loss.dtype == dtype


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_token_clip_matches(beta):
    hs, ht, w, b, _, _, mask = _inputs(3, torch.float64, bias=True)
    clip, frac = _median_clip(hs, ht, w, b, mask, beta)
    kw = dict(beta=beta, token_clip=clip)
    loss, metrics = fused_linear_jsd(
        hs, ht, w, b, mask=mask, chunk_size=4, vocab_chunk_size=50, **kw
    )
    grads = torch.autograd.grad(loss, [hs, w, b])
    ref_loss, ref_metrics, ref_grads, g_logits, zs, zt = _reference(
        hs, ht, w, b, None, None, mask, **kw
    )
    bounds = _fused_bounds(torch.float64, hs, ht, w, b, None, None, mask, zs, zt, g_logits, 1.0)
    _check((loss, grads), (ref_loss, ref_grads), bounds)
    assert metrics["jsd/clip_frac"] == ref_metrics["jsd/clip_frac"] == frac  # counts / tokens
    assert 0 < metrics["jsd/clip_frac"] < 1


def test_fused_separate_teacher_head_of_another_width():
    """A teacher with its own output layer (and hidden size): only the student's get gradients."""
    hs, ht, w, b, wt, bt, mask = _inputs(5, torch.float64, bias=True, teacher_head=True, Ht=24)
    wt.requires_grad_(True)
    ht.requires_grad_(True)
    loss, _ = fused_linear_jsd(
        hs, ht, w, b, teacher_weight=wt, teacher_bias=bt, mask=mask, beta=0.3, chunk_size=4
    )
    loss.backward()
    assert wt.grad is None and ht.grad is None
    grads = (hs.grad, w.grad, b.grad)
    ref_loss, _, ref_grads, g_logits, zs, zt = _reference(
        hs.detach().requires_grad_(True),
        ht.detach(),
        w.detach().requires_grad_(True),
        b.detach().requires_grad_(True),
        wt.detach(),
        bt,
        mask,
        beta=0.3,
    )
    bounds = _fused_bounds(torch.float64, hs, ht, w, b, wt, bt, mask, zs, zt, g_logits, 1.0)
    _check((loss.detach(), grads), (ref_loss, ref_grads), bounds)


def test_fused_tied_weights_gradient_reaches_the_embedding():
    """A tied model (embedding = output layer): the weight gradient is added to the embedding's."""
    g = torch.Generator().manual_seed(11)
    emb = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4).requires_grad_(True)
    mix = torch.randn(H, H, generator=g, dtype=torch.float64) * 0.3
    ids = torch.randint(0, V, (B, T), generator=g)
    t_ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)

    def body(x):
        return torch.tanh(emb[x] @ mix)

    loss, _ = fused_linear_jsd(body(ids), body(t_ids).detach(), emb, mask=mask, vocab_chunk_size=40)
    (g_fused,) = torch.autograd.grad(loss, emb)
    zs = body(ids) @ emb.t()
    zt = (body(t_ids) @ emb.t()).detach()
    ref, _ = generalized_jsd(zs, zt)
    (g_ref,) = torch.autograd.grad(ref, emb)
    # float64: the bound of a few hundred operations at unit roundoff 2^-53 on O(1) values
    torch.testing.assert_close(
        g_fused, g_ref, rtol=0, atol=bound(torch.float64, n=V, ops=50, scale=1)
    )
    assert float(g_fused.abs().max()) > 1e-3  # both routes (embedding and head) contribute


def test_fused_gradcheck_float64():
    """Closed-form gradients against finite differences (hidden states, weight and bias)."""
    g = torch.Generator().manual_seed(2)
    hs = torch.randn(1, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ht = torch.randn(1, 3, 4, generator=g, dtype=torch.float64)
    w = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    # the teacher's head is a fixed copy: with the default (the student's own weight) moving the
    # weight would move the teacher too, which the gradient deliberately ignores
    wt, bt = w.detach().clone(), b.detach().clone()
    for beta in (0.0, 0.4, 1.0):
        fn = lambda h, ww, bb, beta=beta: fused_linear_jsd(  # noqa: E731
            h,
            ht,
            ww,
            bb,
            teacher_weight=wt,
            teacher_bias=bt,
            beta=beta,
            temperature=1.3,
            chunk_size=2,
            vocab_chunk_size=3,
        )[0]
        assert torch.autograd.gradcheck(fn, (hs, w, b))


def test_fused_chunking_changes_nothing_but_rounding():
    hs, ht, w, b, _, _, mask = _inputs(8, torch.float64, bias=True)
    results = []
    for chunk, vchunk in ((None, None), (1, 1), (3, 64), (10, 257), (2, 100)):
        loss, _ = fused_linear_jsd(
            hs, ht, w, b, mask=mask, chunk_size=chunk, vocab_chunk_size=vchunk
        )
        results.append((loss.detach(), *torch.autograd.grad(loss, [hs, w, b])))
    for other in results[1:]:
        for x, y in zip(results[0], other, strict=True):
            # float64, sums of at most V terms reordered: (V + ops) u of O(1) magnitudes
            torch.testing.assert_close(
                x, y, rtol=0, atol=bound(torch.float64, n=V, ops=20, scale=4)
            )


def test_fused_empty_mask_gives_zero_loss_and_zero_gradient():
    hs, ht, w, b, _, _, _ = _inputs(9, torch.float64, bias=True)
    mask = torch.zeros(B, T, dtype=torch.bool)
    loss, metrics = fused_linear_jsd(hs, ht, w, b, mask=mask)
    loss.backward()
    assert (
        float(loss.detach()) == 0.0
        and metrics["jsd/empty_mask"] == 1.0
        and metrics["jsd/tokens"] == 0
    )
    assert all(float(x.grad.abs().max()) == 0.0 for x in (hs, w, b))


def test_fused_no_grad_builds_no_gradient_and_same_value():
    hs, ht, w, b, _, _, mask = _inputs(10, torch.float64, bias=True)
    with torch.no_grad():
        plain, _ = fused_linear_jsd(hs, ht, w, b, mask=mask)
    loss, _ = fused_linear_jsd(hs, ht, w, b, mask=mask)
    assert float(plain) == float(loss.detach())  # the same passes; pass C only adds gradients


def test_fused_retained_graph_and_second_backward():
    hs, ht, w, _, _, _, mask = _inputs(12, torch.float64)
    loss, _ = fused_linear_jsd(hs, ht, w, mask=mask)
    g1 = torch.autograd.grad(loss * 2.0, [hs, w], retain_graph=True)
    g2 = torch.autograd.grad(loss * 2.0, [hs, w], retain_graph=True)
    g3 = torch.autograd.grad(loss * 2.0, [hs, w])
    for a, b_, c in zip(g1, g2, g3, strict=True):
        assert torch.equal(a, b_) and torch.equal(
            a, c
        )  # the buffers are scaled copies until the last
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(loss, [hs, w])
    loss, _ = fused_linear_jsd(hs, ht, w, mask=mask)
    with pytest.raises(RuntimeError, match="create_graph=True is not supported"):
        torch.autograd.grad(loss, [hs], create_graph=True)


# ------------------------------------------------------------------------------------- bfloat16
def test_fused_bfloat16_measured_tolerance():
    """bf16 hidden states and weight: the logits are computed in float32 from the bf16 operands
    (products exact), so against a float64 reference on the same bf16 values the loss is float32-
    accurate; the gradients pass through one bf16 rounding of the logits' gradient tile (relative
    2^-8 per entry) and of the result (2^-8): 2 x 2^-8 relative to their scale (|g| @ |W|).
    Measured here (V=257, H=16): loss 2e-8 absolute, hidden gradient 1.1e-3 of its largest entry,
    weight gradient 1.0e-3. Against ``generalized_jsd`` on bf16-rounded logits (what a
    materialised bf16 path computes) the loss differs by the logits' own rounding: 2.4e-3 here.
    """
    hs, ht, w, _, _, _, mask = _inputs(4, torch.bfloat16)
    loss, _ = fused_linear_jsd(hs, ht, w, mask=mask, beta=0.5, chunk_size=4, vocab_chunk_size=64)
    g_h, g_w = torch.autograd.grad(loss, [hs, w])
    assert loss.dtype == torch.float32 and g_h.dtype == g_w.dtype == torch.bfloat16
    h64 = hs.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    ref_loss, _, (r_h, r_w), g_logits, zs, zt = _reference(
        h64, ht.double(), w64, None, None, None, mask, beta=0.5
    )
    bounds = _fused_bounds(
        torch.float32, h64, ht.double(), w64, None, None, None, mask, zs, zt, g_logits, 1.0
    )
    assert abs(float(loss) - float(ref_loss)) <= bounds["value"]
    u = unit_roundoff(torch.bfloat16)
    m = mask.reshape(-1)
    g = g_logits.reshape(-1, V)[m].abs()
    scale_h = float((g @ w64.detach().abs()).max())
    scale_w = float((g.t() @ h64.detach().reshape(-1, H)[m].abs()).max())
    assert float((g_h.double() - r_h).abs().max()) <= 2 * 2 * u * scale_h
    assert float((g_w.double() - r_w).abs().max()) <= 2 * 2 * u * scale_w
    bf16_logits, _ = generalized_jsd(
        (hs @ w.t()).detach(), (ht @ w.t()).detach(), beta=0.5, mask=mask
    )
    # the materialised bf16 path rounds every logit (|z| <= Z) by 2^-8 relative: D-sized moves
    assert abs(float(bf16_logits) - float(ref_loss)) <= 4 * u * float(zs.abs().max())


# ---------------------------------------------------------------------------- backends, registry
def _problem(device="cpu", dtype=torch.float32, **kw):
    x = torch.zeros(2, 4, dtype=dtype, device=device)
    w = torch.zeros(5, 4, dtype=dtype, device=device)
    base = dict(
        hs=x,
        ht=x,
        weight=w,
        bias=None,
        teacher_weight=w,
        teacher_bias=None,
        beta=0.5,
        temperature=1.0,
        token_clip=None,
        need_hidden=True,
        need_weight=True,
        need_bias=False,
        token_chunk=None,
        vocab_chunk=None,
    )
    base.update(kw)
    return FusedProblem(**base)


def test_backend_registry_picks_and_explains(monkeypatch):
    assert FUSED_JSD_BACKENDS == ("auto", "torch", "triton", "liger")
    assert set(_fused_backends.BACKENDS) == set(FUSED_JSD_BACKENDS) - {"auto"}
    # auto on the CPU is PyTorch, even with Triton's interpreter switched on (tests only)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _fused_backends.select_backend(_problem(), "auto").name == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    hs, ht, w, b, _, _, mask = _inputs(1, torch.float32, bias=True)
    with pytest.raises(
        ValueError,
        match="backend 'triton' cannot run this problem: .*(CUDA|Triton is not installed)",
    ):
        fused_linear_jsd(hs, ht, w, mask=mask, backend="triton")
    with pytest.raises(ValueError, match="no output-layer bias|not installed|CUDA"):
        fused_linear_jsd(hs, ht, w, b, mask=mask, backend="liger")
    with pytest.raises(ValueError, match="backend must be one of auto, torch, triton, liger"):
        fused_linear_jsd(hs, ht, w, mask=mask, backend="cuda")
    reason = _fused_backends.BACKENDS["liger"].unsupported(_problem(token_clip=0.5), explicit=True)
    assert reason is not None


def test_bad_inputs_name_the_argument():
    hs, ht, w, b, _, _, mask = _inputs(1, torch.float32, bias=True)
    with pytest.raises(ValueError, match="student_hidden must have 3 dimensions"):
        fused_linear_jsd(hs[0], ht, w)
    with pytest.raises(ValueError, match="weight is \\(V, H\\)"):
        fused_linear_jsd(hs, ht, w[:, :3])
    with pytest.raises(ValueError, match="vocab mismatch"):
        fused_linear_jsd(hs, ht, w, teacher_weight=w[:10])
    with pytest.raises(ValueError, match="bias must be None or a \\(V,\\)"):
        fused_linear_jsd(hs, ht, w, b[:3])
    with pytest.raises(ValueError, match="share \\(B, T\\)"):
        fused_linear_jsd(hs, ht[:, :2], w)
    with pytest.raises(ValueError, match="beta"):
        fused_linear_jsd(hs, ht, w, beta=1.5)
    with pytest.raises(ValueError, match="vocab_chunk_size must be a positive int"):
        fused_linear_jsd(hs, ht, w, vocab_chunk_size=0)
    bad = hs.detach().clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="student_hidden contains NaN or Inf"):
        fused_linear_jsd(bad, ht, w, mask=mask)
    bad[0, 0, 0] = 0.0
    bad[1, 4, 0] = float("inf")  # outside nothing: position (1, 4) is masked out below
    m = mask.clone()
    m[1, 4] = False
    fused_linear_jsd(bad, ht, w, mask=m)  # padding may hold anything


# ------------------------------------------------- our Triton kernels and Liger-Kernel's
# They run compiled on a CUDA device. On the CPU they run in Triton's interpreter, which must be
# switched on before anything imports triton (triton.language's own functions are decorated at
# import): `test_kernels_in_the_triton_interpreter` runs the tests below in a fresh process with
# TRITON_INTERPRET=1, where they run on the CPU.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernel_device = pytest.mark.skipif(
    not (torch.cuda.is_available() or _INTERPRETED),
    reason="no CUDA device: run by test_kernels_in_the_triton_interpreter (TRITON_INTERPRET=1)",
)


@pytest.mark.slow  # a fresh interpreter process: ~1-2 min on 2 loaded cores
def test_kernels_in_the_triton_interpreter():
    if torch.cuda.is_available() or _INTERPRETED:
        pytest.skip("the kernel tests run directly here (CUDA, or already interpreted)")
    pytest.importorskip("triton", reason="Triton is not installed (extra 'gpu')")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    cmd += ["-k", "triton_kernels or liger_backend"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, out
    assert " passed" in out and " failed" not in out, out


def _on_device(hs, ht, w, b, mask):
    to = lambda x: None if x is None else x.detach().to(_DEVICE).requires_grad_(True)  # noqa: E731
    return to(hs), ht.to(_DEVICE), to(w), to(b), mask.to(_DEVICE)


@kernel_device
@pytest.mark.parametrize(
    "beta, temperature, bias, clip",
    [(0.0, 1.0, True, False), (0.5, 1.7, False, True), (1.0, 0.8, True, False)],
)
def test_triton_kernels_match_the_reference(beta, temperature, bias, clip):
    pytest.importorskip("triton", reason="Triton is not installed (extra 'gpu')")
    hs, ht, w, b, mask = _on_device(*_pick(_inputs(20 + int(beta * 10), torch.float32, bias=bias)))
    token_clip = _median_clip(hs, ht, w, b, mask, beta, temperature)[0] if clip else None
    kw = dict(beta=beta, temperature=temperature, token_clip=token_clip)
    loss, metrics = fused_linear_jsd(
        hs, ht, w, b, mask=mask, chunk_size=4, vocab_chunk_size=100, backend="triton", **kw
    )
    params = [x for x in (hs, w, b) if x is not None]
    grads = torch.autograd.grad(loss, params)
    ref_loss, ref_metrics, ref_grads, g_logits, zs, zt = _reference(
        hs, ht, w, b, None, None, mask, **kw
    )
    bounds = _fused_bounds(
        torch.float32, hs, ht, w, b, None, None, mask, zs, zt, g_logits, temperature
    )
    _check((loss, grads), (ref_loss, ref_grads), bounds)
    assert metrics["jsd/clip_frac"] == ref_metrics["jsd/clip_frac"]
    if clip:
        assert 0 < metrics["jsd/clip_frac"] < 1


@kernel_device
def test_triton_kernels_bfloat16_match_the_torch_backend():
    """The same tiles and the same rounding of the gradient tile to bf16: the two backends differ
    by the float32 element-wise math before that rounding (a few u, far below one bf16 ulp), so
    each gradient entry by at most one bf16 ulp of the largest entry (2 u_bf16 relative), and the
    loss by the float32 bound of a V-term sum."""
    pytest.importorskip("triton", reason="Triton is not installed (extra 'gpu')")
    hs, ht, w, _, mask = _on_device(*_pick(_inputs(30, torch.bfloat16)))
    out = {}
    for backend in ("torch", "triton"):
        loss, _ = fused_linear_jsd(hs, ht, w, mask=mask, vocab_chunk_size=64, backend=backend)
        out[backend] = (loss.detach(), *torch.autograd.grad(loss, [hs, w]))
    tol = bound(torch.float32, n=V, ops=20, scale=4)
    torch.testing.assert_close(out["triton"][0], out["torch"][0], rtol=0, atol=tol)
    u16 = unit_roundoff(torch.bfloat16)
    for got, want in zip(out["triton"][1:], out["torch"][1:], strict=True):
        scale = float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= 2 * u16 * scale


@kernel_device
@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 1.7), (1.0, 0.8)])
def test_liger_backend_has_our_conventions(beta, temperature):
    """Liger-Kernel's LigerFusedLinearJSD through our adapter equals our PyTorch backend: the same
    sign convention (beta 0 forward KL), mixture, temperature (no T^2) and token mean. Both are
    float32 computations of one formula: the bounds of `_fused_bounds` against the reference."""
    pytest.importorskip("liger_kernel", reason="Liger-Kernel is not installed (extra 'gpu')")
    hs, ht, w, _, mask = _on_device(*_pick(_inputs(40, torch.float32)))
    kw = dict(beta=beta, temperature=temperature)
    loss, _ = fused_linear_jsd(hs, ht, w, mask=mask, backend="liger", **kw)
    grads = torch.autograd.grad(loss, [hs, w])
    ref_loss, _, ref_grads, g_logits, zs, zt = _reference(hs, ht, w, None, None, None, mask, **kw)
    bounds = _fused_bounds(
        torch.float32, hs, ht, w, None, None, None, mask, zs, zt, g_logits, temperature
    )
    _check((loss, grads), (ref_loss, ref_grads), bounds, names=("hidden", "weight"))


def _pick(inputs):
    hs, ht, w, b, _, _, mask = inputs
    return hs, ht, w, b, mask


# ------------------------------------------------------------------- channel 2 on the batch
def _split_lm():
    """A tiny body + tied linear head (a `HiddenStateLM` and its `CausalLM`)."""
    g = torch.Generator().manual_seed(0)
    vocab, hidden = 11, 8
    emb = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
    mix = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)

    class Out:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    def body(input_ids, attention_mask, **_):
        h = emb[input_ids] * attention_mask.unsqueeze(-1).to(emb.dtype)
        csum = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype).view(1, -1, 1)
        return Out(last_hidden_state=torch.tanh(h + csum @ mix))

    def model(input_ids, attention_mask, **_):
        return Out(logits=body(input_ids, attention_mask).last_hidden_state @ emb.t())

    return body, model, emb, mix


@pytest.mark.parametrize(
    "knobs", [dict(sdpo_jsd_beta=0.3), dict(sdpo_jsd_beta=1.0, sdpo_temperature=2.0)]
)
def test_fused_sdpo_term_equals_sdpo_term(make_batch_fn, knobs):
    body, model, emb, mix = _split_lm()
    batch = make_batch_fn()
    P = batch["prompt_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    hidden = body(ids, attn).last_hidden_state[:, P - 1 : -1]
    fused = fused_sdpo_term(body, batch, hidden, emb, alpha_sdpo=0.5, **knobs)
    assert fused is not None
    g_fused = torch.autograd.grad(fused[0], [emb, mix])
    logits = model(ids, attn).logits[:, P - 1 : -1]
    plain = sdpo_term(model, batch, logits, alpha_sdpo=0.5, **knobs)
    assert plain is not None
    g_plain = torch.autograd.grad(plain[0], [emb, mix])
    # float32, V = 11, H = 8, O(1) values through a dozen operations: (V + ops) u, doubled
    tol = bound(torch.float32, n=11, ops=30, scale=4)
    torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=tol)
    for a, b_ in zip(g_fused, g_plain, strict=True):
        torch.testing.assert_close(a, b_, rtol=0, atol=tol)
    assert fused[1].keys() == plain[1].keys()
    for key, value in plain[1].items():
        assert fused[1][key] == pytest.approx(value, rel=0, abs=tol), key


def test_fused_sdpo_term_declines_what_it_cannot_fuse(make_batch_fn):
    body, _, emb, _ = _split_lm()
    batch = make_batch_fn()
    hidden = torch.zeros(3, 5, 8)
    with pytest.raises(ValueError, match="sdpo_top_k=5 use sdpo_term"):
        fused_sdpo_term(body, batch, hidden, emb, sdpo_top_k=5)
    with pytest.raises(ValueError, match="sdpo_wrapper='taid'"):
        fused_sdpo_term(body, batch, hidden, emb, sdpo_wrapper="taid", taid_t=0.5)
    with pytest.raises(ValueError, match="sdpo_teacher_logits"):
        fused_sdpo_term(body, {**batch, "sdpo_teacher_logits": torch.zeros(3, 5, 11)}, hidden, emb)
    assert fused_sdpo_term(body, batch, hidden, emb, alpha_sdpo=0.0) is None


def test_fused_sdpo_term_on_a_qwen2_with_shared_prefix(make_batch_fn):
    """A Hugging Face model: the body is ``model.base_model``, the head its tied ``lm_head``; the
    shared-prefix teacher forward works on the body too (its cache is the same)."""
    pytest.importorskip("transformers")
    from composer_replication.models import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=16, num_layers=1, seed=0)
    vocab = model.config.vocab_size
    batch = make_batch_fn(vocab=vocab, B=3, P=4, T=5, L=12)
    # rows sharing a context prefix, so that sharing saves tokens
    batch["sdpo_teacher_input_ids"][:, :5] = batch["sdpo_teacher_input_ids"][0, :5]
    batch["sdpo_sample_mask"] = torch.tensor([True, True, True])
    P = batch["prompt_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, P - 1 : -1]
    w = model.lm_head.weight
    fused = fused_sdpo_term(model.base_model, batch, hidden, w, share_prefix=True, alpha_sdpo=1.0)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1 : -1]
    plain = sdpo_term(model, batch, logits, share_prefix=True, alpha_sdpo=1.0)
    assert fused is not None and plain is not None
    # float32, V ~ 100, H = 16 through one transformer layer: (V + ops) u of O(1) values, doubled
    tol = bound(torch.float32, n=vocab, ops=100, scale=4)
    torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=tol)
    g_f = torch.autograd.grad(fused[0], w)[0]
    g_p = torch.autograd.grad(plain[0], w)[0]
    torch.testing.assert_close(g_f, g_p, rtol=0, atol=tol)
    assert math.isfinite(float(fused[0])) and float(fused[0]) > 0
