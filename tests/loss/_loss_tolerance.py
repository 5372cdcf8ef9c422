"""Tolerances for the loss tests, derived from what floating-point arithmetic guarantees.

Two correct implementations of one formula differ only by rounding, and rounding is bounded
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., ch. 2-4), whatever the CPU,
its vector width (``ATEN_CPU_CAPABILITY=default / avx2 / avx512``) or the summation order a
kernel picks:

- one element-wise operation (``+ - * /``, ``exp``, ``log``, ...) is exact up to a relative error
  of ``u`` (the unit roundoff: ``2**-24`` for float32, ``2**-53`` for float64; a libm ``exp`` or
  ``log`` may be off by a few ulp, counted as a few operations);
- a sum or dot product of ``n`` terms, in ANY order, is off by at most ``~n * u * S`` where ``S`` is
  the sum of the terms' magnitudes (eq. 4.4: ``gamma_n = n u / (1 - n u)``). ``S`` is what sets
  the scale, not the result: a sum of cancelling terms can be 0 while its rounding error is not,
  which is why a comparison needs an absolute floor where the reference can be 0.

So a value computed by a chain of ``ops`` element-wise operations and reductions over at most
``n`` terms, from terms whose magnitudes add up to ``scale``, is within ``(n + ops) * u * scale``
of the exact value, and two implementations within twice that. `bound` returns it; every
comparison in tests/loss states its ``n``, ``ops`` and ``scale`` beside the call.
"""

from __future__ import annotations

import torch

UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF[dtype]


def bound(dtype: torch.dtype, *, n: int, ops: int, scale: float) -> float:
    """Largest difference between two correct computations of one value (see module doc):
    ``2 * (n + ops) * u * scale``."""
    return 2.0 * (n + ops) * unit_roundoff(dtype) * float(scale)


def rtol(dtype: torch.dtype, *, n: int, ops: int) -> float:
    """`bound` relative to the value itself: for values with no cancellation (``scale`` = the
    value's magnitude, e.g. a sum of positive terms or a product)."""
    return 2.0 * (n + ops) * unit_roundoff(dtype)


def assert_close(
    actual: torch.Tensor | float,
    expected: torch.Tensor | float,
    *,
    n: int,
    ops: int,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
    msg: str | None = None,
) -> None:
    """``|actual - expected| <= bound(dtype, n=n, ops=ops, scale=scale)`` element-wise.

    ``scale`` defaults to the largest magnitude of the two (the values' own scale: right for
    quantities without cancellation; pass the magnitude of what was summed otherwise). ``dtype``
    defaults to the tensors' (float64 for python floats).
    """
    a = torch.as_tensor(actual, dtype=torch.float64 if isinstance(actual, float) else None)
    e = torch.as_tensor(expected, dtype=torch.float64 if isinstance(expected, float) else None)
    dtype = dtype or (a.dtype if a.dtype in UNIT_ROUNDOFF else torch.float64)
    if scale is None:
        scale = max(float(a.detach().abs().max()), float(e.detach().abs().max()))
    atol = bound(dtype, n=n, ops=ops, scale=scale)
    torch.testing.assert_close(
        a.detach().to(e.dtype), e.detach(), rtol=0.0, atol=atol, msg=msg, check_dtype=False
    )


def divergence_bounds(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    extra_ops: int = 0,
) -> tuple[float, float]:
    """``(value, gradient)`` tolerances for two computations of a token-mean divergence between
    ``softmax(student / tau)`` and ``softmax(teacher / tau)`` (``(B, T, V)`` logits; also
    distributions made from them by a few element-wise operations: a mixture, TAID's target,
    an entropy gate, a top-k restriction; ``extra_ops`` counts those).

    A log-prob ``z / tau - logsumexp(z / tau)`` is off by at most ``e_lp = u ((V + 4) + 2 |z|/tau)``
    (the V-term sum of exponentials, positive terms: ``(V + 4) u`` relative, an absolute error
    of its log; the division and subtraction: ``u |z| / tau`` each). A per-token divergence
    ``sum_v a_v (log a_v - log b_v)`` then moves by at most ``e_lp (2 + E)`` (the weights sum
    to 1; their relative error ``e_lp`` multiplies the log-ratio, whose p- and q-weighted sum is
    ``E``) plus its own V-term sum ``(V + 2) u E``; the token mean adds nothing. A
    logits-gradient entry (``(q - p) / (tau N)``, or ``q (log q - log m - c) / (tau N)``) moves by
    at most ``e_lp (q + p) (3 + |log q - log p| + E) / (tau N)``. Both doubled (two computations).
    """
    dtype = student.dtype
    u = unit_roundoff(dtype)
    s = student.detach().double() / temperature
    t = teacher.detach().double() / temperature
    V = s.shape[-1]
    rows = torch.ones(s.shape[:-1], dtype=torch.bool) if mask is None else mask.bool()
    s, t = s[rows], t[rows]
    n_tokens = max(int(rows.sum()), 1)
    lq, lp = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    q, p = lq.exp(), lp.exp()
    ratio = (lq - lp).abs()
    E = float(((q + p) * ratio).sum(-1).max()) if s.numel() else 0.0
    z_max = max(float(s.abs().max()), float(t.abs().max())) if s.numel() else 0.0
    e_lp = u * ((V + 4 + extra_ops) + 2 * z_max)
    value = 2 * (e_lp * (2 + E) + (V + 2) * u * E)
    entry = (q + p) * (3 + ratio + E) if s.numel() else torch.zeros(1)
    grad = 2 * e_lp * float(entry.max()) / (temperature * n_tokens)
    return value, grad


def approx(
    expected: float,
    *,
    n: int,
    ops: int,
    scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> object:
    """``pytest.approx(expected, abs=bound(dtype, n, ops, scale))``; ``scale`` defaults to
    ``|expected|`` (pass the magnitude of the summed terms where they cancel)."""
    import pytest

    size = abs(float(expected)) if scale is None else float(scale)
    return pytest.approx(expected, rel=0, abs=bound(dtype, n=n, ops=ops, scale=size))


# conftest's toy causal LM (vocab 11, hidden 8, rows of <= 12 tokens) under compose_loss: every
# value the tests compare comes out of at most ~40 rounded operations in a chain (embedding,
# causal running mean, mix, tanh, head, log-softmax, gathers, channel formulas, means) whose
# reductions sum at most 12 terms; float32.
TOY_N, TOY_OPS = 12, 40
