"""Liger-Kernel's ``LigerFusedLinearJSD`` as a fused-JSD backend (optional extra ``gpu``).

Liger-Kernel 0.8.5 computes the same divergence with the same conventions as ours (read in its
source, ``liger_kernel/ops/jsd.py`` and ``fused_linear_jsd.py``): beta 0 is forward KL
``sum p (log p - log q)``, beta 1 reverse KL, otherwise ``beta KL(p || m) + (1 - beta) KL(q || m)``
with ``m = beta p + (1 - beta) q``; both logits divided by the temperature (no T^2); the mean over
the rows not marked ``ignore_index``; the teacher gets no gradient. It chunks over tokens only
(a ``(chunk, V)`` float32 tile per step) and computes the gradients during forward, as we do.
We hand it the selected rows only, so no label is ignored. It has no bias and no per-token clip
(the registry declines such problems) and returns no per-token values.
"""

from __future__ import annotations

import torch

from composer_replication.loss._fused_math import FusedProblem, FusedResult


def run_liger(problem: FusedProblem) -> FusedResult:
    """Loss sum and gradients from Liger-Kernel (its autograd function, differentiated here)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD
    except ImportError as exc:  # pragma: no cover - the registry checks the install first
        raise ImportError(
            "the 'liger' fused JSD backend needs Liger-Kernel: "
            "pip install 'composer-replication[gpu]'"
        ) from exc
    p = problem
    N = p.tokens
    if N == 0:
        return FusedResult(0.0, 0, None, None, None)
    module = LigerFusedLinearJSD(jsd_beta=p.beta, temperature=p.temperature)
    with torch.enable_grad():  # called from an autograd.Function's forward (grad mode off)
        hs = p.hs.detach().requires_grad_(p.need_hidden)
        weight = p.weight.detach().requires_grad_(p.need_weight)
        loss = module(hs, weight, p.ht.detach(), p.teacher_weight.detach(), None)
        wanted = [x for x, need in ((hs, p.need_hidden), (weight, p.need_weight)) if need]
        grads = list(torch.autograd.grad(loss, wanted)) if wanted else []
    grad_hidden = grads.pop(0).to(p.compute_dtype) if p.need_hidden else None
    grad_weight = grads.pop(0) if p.need_weight else None
    return FusedResult(float(loss.detach().double()) * N, 0, grad_hidden, grad_weight, None)
