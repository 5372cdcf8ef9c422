"""Backends of the fused output-layer generalized JSD: one Protocol, a registry, the choice.

A backend takes a `FusedProblem` and returns a `FusedResult` (the loss sum and the gradients);
``fused.fused_linear_jsd`` wraps any of them in one autograd function. Registered:

- ``torch``: `run_tiled` with `TorchTileOps` (plain PyTorch; any device and dtype);
- ``triton``: `run_tiled` with our Triton tile kernels (``_fused_triton``; CUDA, or the CPU under
  ``TRITON_INTERPRET=1``; float32/bfloat16/float16);
- ``liger``: Liger-Kernel's ``LigerFusedLinearJSD`` (optional extra ``gpu``; CUDA). Same
  conventions as ours (beta 0 = forward KL(teacher || student), 1 = reverse, else the mixture
  ``beta KL(p || m) + (1-beta) KL(q || m)``; logits divided by the temperature, no T^2; mean
  over the given rows); it has no bias and no per-token clip, so it declines those problems.

``auto`` picks the first of `AUTO_ORDER` that accepts the problem: the Triton kernels on a CUDA
device when Triton is installed, else PyTorch. A named backend that cannot run the problem is a
ValueError saying why and what to do (``unsupported`` returns that reason).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Protocol

import torch

from composer_replication.loss._fused_math import (
    FusedProblem,
    FusedResult,
    TorchTileOps,
    run_tiled,
)

FUSED_JSD_BACKENDS = ("auto", "torch", "triton", "liger")
AUTO_ORDER = ("triton", "torch")
_LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


class FusedJSDBackend(Protocol):
    """A way to compute the fused generalized JSD (see module docstring)."""

    name: str

    def unsupported(self, problem: FusedProblem, *, explicit: bool) -> str | None:
        """None if this backend can run ``problem``, else the reason (a sentence) it cannot.

        ``explicit``: the user named this backend (``auto`` may skip backends that would work
        but are slow, e.g. Triton's interpreter on the CPU)."""

    def run(self, problem: FusedProblem) -> FusedResult:
        """The loss sum and the requested gradients."""


class TorchBackend:
    name = "torch"

    def unsupported(self, problem: FusedProblem, *, explicit: bool) -> str | None:
        return None

    def run(self, problem: FusedProblem) -> FusedResult:
        return run_tiled(problem, TorchTileOps(problem.beta, problem.temperature))


def triton_interpreted() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class TritonBackend:
    name = "triton"

    def unsupported(self, problem: FusedProblem, *, explicit: bool) -> str | None:
        if not _installed("triton"):
            return "Triton is not installed (pip install 'composer-replication[gpu]')"
        device = problem.hs.device.type
        if device != "cuda" and not (explicit and device == "cpu" and triton_interpreted()):
            return (
                f"the Triton kernels run on a CUDA device (the inputs are on {device!r}; on the "
                "CPU only under TRITON_INTERPRET=1, for tests)"
            )
        dtypes = {problem.hs.dtype, problem.ht.dtype, problem.weight.dtype}
        dtypes.add(problem.teacher_weight.dtype)
        if not dtypes <= set(_LOW_PRECISION):
            return (
                f"the Triton kernels take float32, bfloat16 or float16 inputs, got "
                f"{sorted(str(d) for d in dtypes)}; use backend='torch'"
            )
        return None

    def run(self, problem: FusedProblem) -> FusedResult:
        from composer_replication.loss._fused_triton import TritonTileOps

        return run_tiled(problem, TritonTileOps(problem.beta, problem.temperature))


class LigerBackend:
    name = "liger"

    def unsupported(self, problem: FusedProblem, *, explicit: bool) -> str | None:
        if not _installed("liger_kernel"):
            return "Liger-Kernel is not installed (pip install 'composer-replication[gpu]')"
        device = problem.hs.device.type
        if device != "cuda" and not (explicit and device == "cpu" and triton_interpreted()):
            return f"Liger-Kernel's kernels run on a CUDA device (the inputs are on {device!r})"
        if problem.bias is not None or problem.teacher_bias is not None:
            return "Liger-Kernel's LigerFusedLinearJSD has no output-layer bias; use 'triton'"
        if problem.token_clip is not None:
            return "Liger-Kernel's LigerFusedLinearJSD has no per-token clip; use 'triton'"
        if problem.need_bias:
            return "Liger-Kernel's LigerFusedLinearJSD gives no bias gradient; use 'triton'"
        return None

    def run(self, problem: FusedProblem) -> FusedResult:
        from composer_replication.loss._fused_liger import run_liger

        return run_liger(problem)


BACKENDS: dict[str, FusedJSDBackend] = {
    b.name: b for b in (TorchBackend(), TritonBackend(), LigerBackend())
}


def select_backend(problem: FusedProblem, name: str) -> FusedJSDBackend:
    """The backend ``name`` (or the first of `AUTO_ORDER` that accepts ``problem`` for "auto")."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            if BACKENDS[candidate].unsupported(problem, explicit=False) is None:
                return BACKENDS[candidate]
        raise AssertionError("the torch backend accepts every problem")
    if name not in BACKENDS:
        raise ValueError(
            f"unknown fused JSD backend {name!r}; choose one of {', '.join(FUSED_JSD_BACKENDS)}"
        )
    backend = BACKENDS[name]
    reason = backend.unsupported(problem, explicit=True)
    if reason is not None:
        raise ValueError(
            f"fused JSD backend {name!r} cannot run this problem: {reason} (or use backend='auto')"
        )
    return backend
