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
