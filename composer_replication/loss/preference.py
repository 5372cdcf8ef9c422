"""Channel 3: preference losses on sequence log-probs (trace replay: teacher trace = chosen,
policy rollout = rejected).

Shapes: P = number of pairs; every input is ``(P,)``. Both losses return the mean over pairs plus
reward/margin metrics; ``P == 0`` gives loss 0 (with a gradient path) and ``*/empty = 1.0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from composer_replication.loss._checks import (
    check_finite,
    check_same_shape,
    check_scalar,
    check_tensor,
)


def _check_pairs(names: tuple[str, ...], tensors: tuple[Tensor, ...]) -> None:
    for name, t in zip(names, tensors):
        check_tensor(name, t, ndim=1)
        check_same_shape(name, t, names[0], tensors[0])
        check_finite(name, t)


def _smoothed_logsigmoid_loss(z: Tensor, label_smoothing: float) -> Tensor:
    # Conservative form (cDPO, Mitchell 2023): with probability `label_smoothing` the preference
    # label is flipped. label_smoothing=0 is the plain `-logsigmoid(z)`, TRL's "sigmoid" loss.
    loss = -F.logsigmoid(z)
    if label_smoothing > 0.0:
        loss = loss * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing
    return loss


def _metrics(prefix: str, losses: Tensor, chosen: Tensor, rejected: Tensor) -> dict[str, float]:
    with torch.no_grad():
        n = losses.numel()
        margin = chosen - rejected
        return {
            f"{prefix}/loss": float(losses.mean()) if n else 0.0,
            f"{prefix}/pairs": float(n),
            f"{prefix}/empty": 1.0 if n == 0 else 0.0,
            f"{prefix}/accuracy": float((margin > 0).float().mean()) if n else 0.0,
            f"{prefix}/margin": float(margin.mean()) if n else 0.0,
            f"{prefix}/chosen_reward": float(chosen.mean()) if n else 0.0,
            f"{prefix}/rejected_reward": float(rejected.mean()) if n else 0.0,
        }


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """DPO sigmoid loss: ``-logsigmoid(beta * ((lw - rw) - (ll - rl)))`` averaged over pairs.

    Args:
        chosen_logps, rejected_logps: ``(P,)`` policy log-probs summed over each completion.
        ref_chosen_logps, ref_rejected_logps: ``(P,)`` reference log-probs (no gradient needed).
        beta: > 0, the KL strength (TRL default 0.1).
        label_smoothing: in ``[0, 0.5)``; > 0 gives conservative DPO. (TRL >= 0.29 ignores it for
            ``"sigmoid"``; at 0 both agree.)

    Returns:
        ``(loss, metrics)`` with ``dpo/chosen_reward = mean(beta * (lw - rw))``, likewise
        ``rejected_reward``, ``margin`` (their difference) and ``accuracy`` (fraction margin > 0).
    """
    names = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
    _check_pairs(names, (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps))
    beta = check_scalar("beta", beta, low=0.0, low_open=True)
    ls = check_scalar("label_smoothing", label_smoothing, low=0.0, high=0.5, high_open=True)
    chosen_logratio = chosen_logps - ref_chosen_logps.detach()
    rejected_logratio = rejected_logps - ref_rejected_logps.detach()
    losses = _smoothed_logsigmoid_loss(beta * (chosen_logratio - rejected_logratio), ls)
    # sum() * 0 keeps a (zero) gradient path for P == 0 instead of a NaN mean of nothing.
    loss = losses.mean() if losses.numel() else losses.sum() * 0.0
    chosen_r = beta * chosen_logratio.detach()
    rejected_r = beta * rejected_logratio.detach()
    return loss, _metrics("dpo", losses, chosen_r, rejected_r)


def simpo_loss(
    chosen_avg_logps: Tensor,
    rejected_avg_logps: Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """SimPO: ``-logsigmoid(beta * avg_w - beta * avg_l - gamma)``, no reference model.

    ``gamma`` is the *absolute* reward margin, as TRL's CPO ``simpo_gamma``
    (the SimPO repository's ``gamma_beta_ratio`` r corresponds to ``gamma = beta * r``).

    Args:
        chosen_avg_logps, rejected_avg_logps: ``(P,)`` log-probs averaged over each completion's
            tokens (length-normalised).
        beta: > 0 (default 2.0); gamma: >= 0 (default 1.0); label_smoothing in ``[0, 0.5)``.

    Returns:
        ``(loss, metrics)``; rewards are ``beta * avg_logps`` (``simpo/chosen_reward`` ...).
    """
    names = ("chosen_avg_logps", "rejected_avg_logps")
    _check_pairs(names, (chosen_avg_logps, rejected_avg_logps))
    beta = check_scalar("beta", beta, low=0.0, low_open=True)
    gamma = check_scalar("gamma", gamma, low=0.0)
    ls = check_scalar("label_smoothing", label_smoothing, low=0.0, high=0.5, high_open=True)
    z = beta * (chosen_avg_logps - rejected_avg_logps) - gamma
    losses = _smoothed_logsigmoid_loss(z, ls)
    loss = losses.mean() if losses.numel() else losses.sum() * 0.0
    return loss, _metrics(
        "simpo", losses, beta * chosen_avg_logps.detach(), beta * rejected_avg_logps.detach()
    )
