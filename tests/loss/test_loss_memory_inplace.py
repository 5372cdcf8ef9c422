"""The chunked distillation losses' backward: in place unless the graph is retained.

A backward that does not retain the graph scales the forward's gradient buffer in place and hands
it on (so the loss costs one gradient-sized buffer); a retained graph gets a scaled copy and can be
back-propagated again. Gradients are checked against plain autograd on the unchunked formulas
(written here independently of the library: the JSD mixture is built in probability space), in
both modes; the memory property is measured on real process memory by the benchmark's own child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _loss_tolerance import divergence_bounds, unit_roundoff
from torch import Tensor

from composer_replication.loss import _chunked, entropy_opd_loss, generalized_jsd, taid_loss

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ independent references
def _ref_jsd(s: Tensor, t: Tensor, mask: Tensor, beta: float, temperature: float) -> Tensor:
    log_q = F.log_softmax(s / temperature, -1)
    log_p = F.log_softmax(t / temperature, -1)
    q, p = log_q.exp(), log_p.exp()
    if beta == 0.0:
        per = (p * (log_p - log_q)).sum(-1)
    elif beta == 1.0:
        per = (q * (log_q - log_p)).sum(-1)
    else:
        log_m = ((1 - beta) * q + beta * p).log()
        per = beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)
    return per[mask].mean()


def _ref_taid(s: Tensor, t: Tensor, mask: Tensor, tt: float, temperature: float) -> Tensor:
    target = F.softmax(((1 - tt) * s.detach() + tt * t) / temperature, -1)
    return (-(target * F.log_softmax(s / temperature, -1)).sum(-1))[mask].mean()


def _ref_eopd(
    s: Tensor, t: Tensor, mask: Tensor, h_max: float, mode: str, coef: float, temperature: float
) -> Tensor:
    log_q = F.log_softmax(s / temperature, -1)
    log_p = F.log_softmax(t / temperature, -1)
    q, p = log_q.exp(), log_p.exp()
    gate = -(p * log_p).sum(-1) > h_max
    fkl = (p * (log_p - log_q)).sum(-1)
    rkl = (q * (log_q - log_p)).sum(-1)
    gated = gate.to(s.dtype) * fkl  # (a python float times a bool tensor would be float32)
    per = torch.where(gate, fkl, rkl) if mode == "switch" else rkl + coef * gated
    return per[mask].mean()


LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]

# (ours, reference): ours(student, teacher, mask) with a small chunk size so several chunks and
# both worker threads are used.
CASES: dict[str, tuple[LossFn, LossFn]] = {
    "jsd_beta0": (
        lambda s, t, m: generalized_jsd(s, t, beta=0.0, temperature=1.3, mask=m, chunk_size=2)[0],
        lambda s, t, m: _ref_jsd(s, t, m, 0.0, 1.3),
    ),
    "jsd_beta1": (
        lambda s, t, m: generalized_jsd(s, t, beta=1.0, mask=m, chunk_size=3)[0],
        lambda s, t, m: _ref_jsd(s, t, m, 1.0, 1.0),
    ),
    "jsd_beta05": (
        lambda s, t, m: generalized_jsd(s, t, beta=0.5, temperature=0.8, mask=m, chunk_size=1)[0],
        lambda s, t, m: _ref_jsd(s, t, m, 0.5, 0.8),
    ),
    "taid": (
        lambda s, t, m: taid_loss(s, t, 0.6, mask=m, temperature=1.2, chunk_size=2)[0],
        lambda s, t, m: _ref_taid(s, t, m, 0.6, 1.2),
    ),
    "eopd_switch": (
        lambda s, t, m: entropy_opd_loss(s, t, h_max=2.0, mask=m, chunk_size=2)[0],
        lambda s, t, m: _ref_eopd(s, t, m, 2.0, "switch", 1.0, 1.0),
    ),
    "eopd_add": (
        lambda s, t, m: entropy_opd_loss(
            s, t, h_max=2.0, mode="add", fkl_coef=0.7, temperature=1.1, mask=m, chunk_size=3
        )[0],
        lambda s, t, m: _ref_eopd(s, t, m, 2.0, "add", 0.7, 1.1),
    ),
}


def _inputs(seed: int = 0, B: int = 2, T: int = 7, V: int = 13) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    t = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(B, T, generator=g) > 0.3  # gaps: rows outside the mask get zero gradient
    mask[0, 0] = True
    return s, t, mask


def _ref_grad(name: str, s: Tensor, t: Tensor, mask: Tensor, scale: float = 1.0) -> Tensor:
    x = s.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(scale * CASES[name][1](x, t, mask), x)
    return g


def _close(a: Tensor, b: Tensor, s: Tensor, t: Tensor, mask: Tensor, times: float = 1.0) -> None:
    """float64 gradients of two computations of one divergence: `divergence_bounds`' gradient
    bound (at the smallest temperature of CASES, 0.8, with a few ops for TAID's target or the
    entropy gate; doubled for eopd "add", a sum of two divergences), times the loss' scale."""
    _, grad_tol = divergence_bounds(s, t, mask, 0.8, extra_ops=4)
    torch.testing.assert_close(a, b, rtol=0, atol=2 * grad_tol * times)


# ------------------------------------------------------------------ gradients in both modes
@pytest.mark.parametrize("name", sorted(CASES))
def test_inplace_backward_matches_reference(name):
    s, t, mask = _inputs()
    ref = _ref_grad(name, s, t, mask, scale=2.5)
    x = s.clone().requires_grad_(True)
    (2.5 * CASES[name][0](x, t, mask)).backward()  # not retained: the buffer is scaled in place
    assert x.grad is not None
    _close(x.grad, ref, s, t, mask, times=2.5)
    y = s.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(2.5 * CASES[name][0](y, t, mask), y)  # autograd.grad: same path
    _close(g, ref, s, t, mask, times=2.5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_retained_graph_gives_the_same_gradient_every_time(name):
    s, t, mask = _inputs(1)
    ref = _ref_grad(name, s, t, mask)
    x = s.clone().requires_grad_(True)
    loss = CASES[name][0](x, t, mask)
    (g1,) = torch.autograd.grad(loss, x, retain_graph=True)
    (g2,) = torch.autograd.grad(3.0 * loss, x, retain_graph=True)
    (g3,) = torch.autograd.grad(loss, x)  # the last pass may consume the buffer
    _close(g1, ref, s, t, mask)
    _close(g2, 3.0 * ref, s, t, mask, times=3.0)
    _close(g3, ref, s, t, mask)
    assert g1.data_ptr() != g3.data_ptr()  # the retained pass handed out a copy
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(loss, x)


def test_double_backward_with_retain_graph_accumulates_twice():
    s, t, mask = _inputs(2)
    ref = _ref_grad("jsd_beta05", s, t, mask)
    x = s.clone().requires_grad_(True)
    loss = CASES["jsd_beta05"][0](x, t, mask)
    loss.backward(retain_graph=True)
    assert x.grad is not None
    first = x.grad.clone()
    loss.backward()
    _close(first, ref, s, t, mask)
    _close(x.grad, 2 * ref, s, t, mask, times=2.0)


def test_backward_into_an_existing_grad_and_through_a_non_leaf_student():
    s, t, mask = _inputs(3)
    # .grad already holds something: autograd adds the (in-place scaled) buffer to it
    x = s.clone().requires_grad_(True)
    x.grad = torch.ones_like(s)
    CASES["taid"][0](x, t, mask).backward()
    # + 1.0 rounds once more, by at most u relative to 1 + |g| <= 2: add 2u each side
    u = unit_roundoff(torch.float64)
    _, grad_tol = divergence_bounds(s, t, mask, 0.8, extra_ops=4)
    torch.testing.assert_close(
        x.grad, 1.0 + _ref_grad("taid", s, t, mask), rtol=0, atol=2 * grad_tol + 8 * u
    )
    # the student is an intermediate (logits of a layer): the buffer flows on into its backward
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 7, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 13, generator=g, dtype=torch.float64, requires_grad=True)
    CASES["eopd_add"][0](h @ w, t, mask).backward()
    w_ref = w.detach().clone().requires_grad_(True)
    CASES["eopd_add"][1](h @ w_ref, t, mask).backward()
    assert w.grad is not None and w_ref.grad is not None
    # dL/dw = h^T dL/dz: each entry sums the tokens' logits-gradient errors times |h|
    through = float(h.abs().sum((0, 1)).max())
    _close(w.grad, w_ref.grad, h @ w.detach(), t, mask, times=through)


@pytest.mark.parametrize("retain", [False, True])
def test_chunked_equals_unchunked_in_both_modes(retain):
    s, t, mask = _inputs(5, B=3, T=9, V=17)
    grads = []
    for chunk in (1, 4, None):
        x = s.clone().requires_grad_(True)
        loss, _ = generalized_jsd(x, t, beta=0.3, mask=mask, chunk_size=chunk)
        (g,) = torch.autograd.grad(loss, x, retain_graph=retain)
        grads.append(g)
    for g in grads[1:]:  # the same per-token kernel, other chunks: within the same bound
        _close(g, grads[0], s, t, mask)
    _close(grads[0], _ref_grad_jsd03(s, t, mask), s, t, mask)


def _ref_grad_jsd03(s: Tensor, t: Tensor, mask: Tensor) -> Tensor:
    x = s.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(_ref_jsd(x, t, mask, 0.3, 1.0), x)
    return g


def test_topk_and_bf16_paths_agree_between_modes():
    s, t, mask = _inputs(6, V=20)
    out = {}
    for retain in (True, False):
        x = s.clone().requires_grad_(True)
        loss, _ = generalized_jsd(x, t, beta=0.4, top_k=5, mask=mask, chunk_size=2)
        (out[retain],) = torch.autograd.grad(loss, x, retain_graph=retain)
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=0)
    bf = {}
    for retain in (True, False):
        x = s.to(torch.bfloat16).requires_grad_(True)
        loss, _ = generalized_jsd(x, t.to(torch.bfloat16), mask=mask)
        loss.backward(retain_graph=retain)
        assert x.grad is not None and x.grad.dtype == torch.bfloat16
        bf[retain] = x.grad
    torch.testing.assert_close(bf[True], bf[False], rtol=0, atol=0)


def test_not_retained_backward_hands_on_the_forward_buffer_itself():
    s, t, mask = _inputs(7)
    x = s.clone().requires_grad_(True)
    loss = CASES["jsd_beta1"][0](x, t, mask)
    buffer_ptr = loss.grad_fn.grad.untyped_storage().data_ptr()  # the context of our Function
    loss.backward()
    assert x.grad is not None and x.grad.untyped_storage().data_ptr() == buffer_ptr


# ------------------------------------------------------------------ errors
def test_second_backward_without_retain_raises_clearly():
    s, t, mask = _inputs(8)
    x = s.clone().requires_grad_(True)
    loss = CASES["jsd_beta0"][0](x, t, mask)
    loss.backward()
    with pytest.raises(RuntimeError, match="second time.*retain_graph=True"):
        loss.backward()


def test_create_graph_raises_clearly():
    s, t, mask = _inputs(9)
    x = s.clone().requires_grad_(True)
    loss = CASES["taid"][0](x, t, mask)
    with pytest.raises(RuntimeError, match="create_graph=True is not supported"):
        torch.autograd.grad(loss, x, create_graph=True)
    # the failed attempt consumed nothing: a first-order backward still works
    (g,) = torch.autograd.grad(loss, x)
    _close(g, _ref_grad("taid", s, t, mask), s, t, mask)


def test_without_the_engine_flag_every_backward_copies(monkeypatch):
    monkeypatch.setattr(_chunked, "_keep_graph_flag", None)
    s, t, mask = _inputs(10)
    ref = _ref_grad("eopd_switch", s, t, mask)
    x = s.clone().requires_grad_(True)
    loss = CASES["eopd_switch"][0](x, t, mask)
    (g1,) = torch.autograd.grad(loss, x)  # treated as retained: the buffer survives
    (g2,) = torch.autograd.grad(loss, x)
    _close(g1, ref, s, t, mask)
    _close(g2, ref, s, t, mask)


# ------------------------------------------------------------------ the memory property
def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak(variant: str, tmp_path: Path, shape: tuple[int, int, int], chunk_size: int) -> float:
    """Extra resident memory of one forward+backward, measured by the benchmark's own child."""
    out = tmp_path / variant
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "loss_memory.py"),
        *("--child", variant, "--shape", ",".join(map(str, shape))),
        *("--out", str(out), "--chunk-size", str(chunk_size)),
    ]
    subprocess.run(cmd, check=True, env=env, timeout=240)
    return float(json.loads(Path(str(out) + ".json").read_text())["peak_bytes"])


@pytest.mark.skipif(not _clear_refs_works(), reason="needs Linux /proc/self/clear_refs")
def test_peak_memory_is_one_gradient_buffer(tmp_path):
    shape = (1, 1024, 32768)  # one fp32 gradient: 128 MiB, far above a 4-row chunk's temporaries
    grad_bytes = shape[0] * shape[1] * shape[2] * 4
    ours = _peak("chunked", tmp_path, shape, chunk_size=4)
    retained = _peak("chunked_retain", tmp_path, shape, chunk_size=4)
    # measured 1.06x and 2.05x: the retained graph keeps the buffer while .grad gets a copy
    assert ours < 1.3 * grad_bytes, f"peak {ours / grad_bytes:.2f}x one gradient buffer"
    assert retained > 1.8 * grad_bytes, f"retained peak {retained / grad_bytes:.2f}x"
