"""Closed-form chunk kernels (per-token loss and its gradient row) for the full-vocab divergences.

Each kernel gets raw ``(n, V)`` student logits ``z`` and teacher logits (never modified in
place: they may be views of the caller's tensors) and returns ``(loss (n,), dloss/dz (n, V) or
None, stats)``. Closed forms (``q = softmax(z / tau)``, ``p`` = teacher, ``KL(a || b)`` row-wise),
all derived by the softmax chain rule ``dL/ds = q * (g - <q, g>)`` with ``g = dL/dq``:

- forward KL(p || q):  ``(q - p) / tau``
- reverse KL(q || p):  ``q * (log q - log p - KL(q || p)) / tau``
- mixture JSD, ``m = (1-b) q + b p``:  ``g = (1-b) (log q - log m)`` (the ``b p / m`` terms cancel),
  so ``(1-b) * q * (log q - log m - KL(q || m)) / tau``
- TAID cross-entropy to a fixed target ``p_t``:  ``(q - p_t) / tau``

gradcheck in float64 (tests/loss) confirms each against autograd.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from composer_replication.loss._chunked import Kernel

Stats = dict[str, Tensor]


def _log_probs(x: Tensor, temperature: float) -> Tensor:
    return torch.log_softmax(x / temperature if temperature != 1.0 else x, dim=-1)


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise <a, b> without an (n, V) product temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(a.shape[0])


def _reverse_kl_grad(
    q: Tensor, log_q: Tensor, log_p: Tensor, need_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """KL(q || p) per row and, if asked, ``q * (log q - log p - KL)`` (before the 1/tau)."""
    r = log_q - log_p
    kl = _rowdot(q, r)
    if not need_grad:
        return kl, None
    return kl, r.sub_(kl.unsqueeze(-1)).mul_(q)


def jsd_kernel(beta: float, temperature: float) -> Kernel:
    """Generalized JSD (TRL/SDPO convention: 0 = forward KL, 1 = reverse KL)."""

    def kernel(z: Tensor, zt: Tensor, need_grad: bool) -> tuple[Tensor, Tensor | None, Stats]:
        log_q = _log_probs(z, temperature)
        log_p = _log_probs(zt, temperature)
        if beta == 0.0:
            p = log_p.exp()
            loss = _rowdot(p, log_p - log_q)
            grad = log_q.exp_().sub_(p).div_(temperature) if need_grad else None
            return loss, grad, {}
        q = log_q.exp()
        if beta == 1.0:
            loss, grad = _reverse_kl_grad(q, log_q, log_p, need_grad)
            return loss, (grad.div_(temperature) if grad is not None else None), {}
        log_m = torch.logaddexp(log_q + math.log1p(-beta), log_p + math.log(beta))
        p = log_p.exp()
        kl_p = _rowdot(p, log_p.sub_(log_m))
        kl_q, grad = _reverse_kl_grad(q, log_q, log_m, need_grad)
        loss = beta * kl_p + (1 - beta) * kl_q
        if grad is not None:
            grad.mul_((1 - beta) / temperature)
        return loss, grad, {}

    return kernel


def taid_kernel(t: float, temperature: float) -> Kernel:
    """TAID cross-entropy ``-sum p_t log q`` with ``p_t = softmax((1-t) sg(s) + t * s_teacher)``."""

    def kernel(z: Tensor, zt: Tensor, need_grad: bool) -> tuple[Tensor, Tensor | None, Stats]:
        s = z / temperature
        target = torch.softmax((1 - t) * s + t * (zt / temperature), dim=-1)
        log_q = torch.log_softmax(s, dim=-1)
        loss = -_rowdot(target, log_q)
        grad = log_q.exp_().sub_(target).div_(temperature) if need_grad else None
        return loss, grad, {}

    return kernel


def entropy_opd_kernel(h_max: float, mode: str, fkl_coef: float, temperature: float) -> Kernel:
    """Teacher-entropy gated forward/reverse KL (see ``distill.entropy_opd_loss``)."""

    def kernel(z: Tensor, zt: Tensor, need_grad: bool) -> tuple[Tensor, Tensor | None, Stats]:
        log_q = _log_probs(z, temperature)
        log_p = _log_probs(zt, temperature)
        p = log_p.exp()
        q = log_q.exp()
        entropy = -_rowdot(p, log_p)
        gate = entropy > h_max
        fkl = _rowdot(p, log_p - log_q)
        rkl, rgrad = _reverse_kl_grad(q, log_q, log_p, need_grad)
        gatef = gate.to(fkl.dtype)
        if mode == "switch":
            loss = torch.where(gate, fkl, rkl)
            w_f, w_r = gatef, 1 - gatef
        else:
            loss = rkl + fkl_coef * gatef * fkl
            w_f, w_r = fkl_coef * gatef, torch.ones_like(gatef)
        grad = None
        if rgrad is not None:
            # w_r * reverse-KL grad + w_f * forward-KL grad (q - p), then the 1/tau.
            grad = rgrad.mul_(w_r.unsqueeze(-1)).add_(q.sub_(p).mul_(w_f.unsqueeze(-1)))
            grad.div_(temperature)
        return loss, grad, {"gate_frac": gatef, "teacher_entropy": entropy}

    return kernel
