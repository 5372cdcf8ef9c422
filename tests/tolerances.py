"""Numeric tolerances derived from floating-point arithmetic, not from one machine's results.

The rounding model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2002,
sections 2.2 and 3.1): every floating-point operation returns the exact result times (1 + d) with
|d| <= u, the unit roundoff of the format: fp32 ``U32 = 2**-24``, bf16 ``UBF16 = 2**-8`` (8
significant bits), TF32 matmul inputs ``UTF32 = 2**-11``, float64 ``U64 = 2**-53``. A sum (or dot product) of n terms in any
order is within ``gamma(n) * sum|x_i|`` of the exact value, ``gamma(n) = n u / (1 - n u)``; two
computations that order or group the same n terms differently (two kernels, ATen's default /
AVX2 / AVX-512 code paths, a CUDA or Triton kernel) therefore differ by at most twice that.

So a comparison of two computations of the same quantity gets

* ``rtol = 2 gamma(n)``: the result's own rounding, relative to itself;
* ``atol = 2 gamma(n) * scale``: the floor where the result is small by cancellation (or exactly
  0 while its neighbours are not): ``scale`` is the size of the summed terms, which the caller
  states (for a tensor, by default the largest magnitude in either operand);

with n the length of the rounded operation chain in which the two computations differ, named at
each call site. Elementwise results computed by the same formula from the same inputs in the same
order are bit-identical and use ``torch.equal``, not a tolerance.

With ``COMPOSER_DIFF_LOG=<file>`` every `assert_close` here also appends one JSON line (the test,
what was compared, the largest absolute difference, the bound it was held to, and their ratio) to
that file: ``scripts/gpu-check.sh`` prints them, so the CUDA figures these bounds were derived for
are measured where they run.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

U64 = 2.0**-53  # float64 unit roundoff
U32 = 2.0**-24  # fp32 unit roundoff
UBF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)
UTF32 = 2.0**-11  # TF32 matmul inputs (11 significant bits)

__all__ = ["U32", "U64", "UBF16", "UTF32", "assert_close", "gamma", "tol"]


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n: the relative error bound of an n-term sum or dot product."""
    if n < 1 or n * u >= 1:
        raise ValueError(f"gamma needs 1 <= n < 1/u, got n={n}, u={u}")
    return n * u / (1 - n * u)


def tol(n: int, scale: float = 1.0, u: float = U32) -> dict[str, float]:
    """``rtol`` / ``atol`` for two computations of an n-term reduction chain (module docstring)."""
    g = 2.0 * gamma(n, u)
    return {"rtol": g, "atol": g * float(scale)}


def _scale_of(*tensors: torch.Tensor) -> float:
    return max((float(t.detach().abs().max()) for t in tensors if t.numel()), default=0.0)


def assert_close(
    actual: Any,
    expected: Any,
    *,
    n: int,
    u: float = U32,
    scale: float | None = None,
    what: str = "",
) -> None:
    """``torch.testing.assert_close(actual, expected, **tol(n, scale, u))``; ``scale`` defaults
    to the largest magnitude in either operand. Logged with ``COMPOSER_DIFF_LOG``."""
    a = torch.as_tensor(actual).detach()
    e = torch.as_tensor(expected).detach().to(a.device)
    if scale is None:
        scale = _scale_of(a, e)
    bounds = tol(n, scale, u)
    _log(a, e, bounds, what)
    torch.testing.assert_close(a, e, **bounds, msg=lambda m: f"{what}: {m}" if what else m)


def _log(a: torch.Tensor, e: torch.Tensor, bounds: dict[str, float], what: str) -> None:
    path = os.environ.get("COMPOSER_DIFF_LOG")
    if not path:
        return
    af, ef = a.double(), e.double()
    diff = (af - ef).abs()
    allowed = bounds["atol"] + bounds["rtol"] * ef.abs()
    ratio = float((diff / allowed).max()) if diff.numel() else 0.0
    record = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0],
        "what": what,
        "device": str(a.device),
        "dtype": str(a.dtype).replace("torch.", ""),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "rtol": bounds["rtol"],
        "atol": bounds["atol"],
        "ratio": ratio if math.isfinite(ratio) else None,
    }
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
