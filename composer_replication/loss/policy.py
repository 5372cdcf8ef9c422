"""Channel 1: the GRPO policy-gradient family (grpo, bnpo, dr_grpo, dapo) and DPPO masks.

Shapes: B = rollouts, T = completion length. All per-token tensors are ``(B, T)``; advantages are
``(B,)`` (one per rollout, broadcast over tokens) or ``(B, T)``.

The clipped surrogate and the four aggregations follow TRL 1.x ``GRPOTrainer._compute_loss``
(``importance_sampling_level="token"``, one accumulation step, one process):

- ``ratio = exp(logp - logp_old)``; ``per_token = -min(ratio * A, clip(ratio, 1-eps_low, 1+eps_high) * A)``;
  with ``delta`` the unclipped branch is capped at ``delta`` first (two-sided clipping, INTELLECT-2).
- optional k3 KL to a reference: ``exp(ref - logp) - (ref - logp) - 1``, added as ``kl_beta * kl``.
- ``grpo``: mean over each sequence's tokens, then mean over sequences (empty sequences count 0);
  ``bnpo``: sum over all tokens / number of tokens in this micro-batch;
  ``dr_grpo``: sum / (B * max_completion_length);
  ``dapo``: sum / ``num_items_in_batch`` (the global token count of the whole accumulated batch
  divided by the number of processes; defaults to the local token count, which equals ``bnpo``).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from composer_replication.loss._checks import (
    check_choice,
    check_finite,
    check_same_shape,
    check_scalar,
    check_tensor,
)

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
LOSS_TYPES: tuple[LossType, ...] = get_args(LossType)


def _prepare_advantages(advantages: Tensor, ref: Tensor) -> Tensor:
    check_tensor("advantages", advantages)
    if advantages.dim() == 1:
        if advantages.shape[0] != ref.shape[0]:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)} but the batch has {ref.shape[0]} rows"
            )
        return advantages.unsqueeze(1)
    check_same_shape("advantages", advantages, "per_token_logps", ref)
    return advantages


def grpo_loss(
    per_token_logps: Tensor,
    old_per_token_logps: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    ref_per_token_logps: Tensor | None = None,
    kl_beta: float = 0.0,
    max_completion_length: int | None = None,
    num_items_in_batch: int | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO surrogate with TRL 1.x aggregation.

    Args:
        per_token_logps: ``(B, T)`` log-probs of the completion tokens under the current policy
            (differentiable).
        old_per_token_logps: ``(B, T)`` log-probs under the sampling policy; ``None`` means the
            detached current log-probs (ratio exactly 1, the on-policy single-iteration case).
        advantages: ``(B,)`` or ``(B, T)``.
        completion_mask: ``(B, T)`` 0/1; padding and tool-output tokens are 0.
        loss_type: ``"grpo" | "bnpo" | "dr_grpo" | "dapo"``.
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]``;
            ``epsilon_high=None`` means ``epsilon_low`` (TRL's default).
        delta: optional upper cap (> 1) on the unclipped ratio.
        ref_per_token_logps, kl_beta: k3 KL penalty to a reference model when ``kl_beta > 0``.
        max_completion_length: denominator for ``dr_grpo`` (default ``T``).
        num_items_in_batch: ``dapo`` normaliser (default: local token count).

    Returns:
        ``(loss, metrics)``: 0-dim loss; metrics ``grpo/loss``, ``grpo/clip_ratio`` (region),
        ``grpo/clip_ratio_low``, ``grpo/clip_ratio_high``, ``grpo/tokens``, ``grpo/empty_mask``,
        and ``grpo/kl`` when ``kl_beta > 0``. An all-zero mask gives loss 0 with zero gradient
        and ``grpo/empty_mask = 1.0``.
    """
    check_tensor("per_token_logps", per_token_logps, ndim=2)
    check_choice("loss_type", loss_type, LOSS_TYPES)
    eps_low = check_scalar("epsilon_low", epsilon_low, low=0.0, high=1.0, high_open=True)
    eps_high = (
        eps_low if epsilon_high is None else check_scalar("epsilon_high", epsilon_high, low=0.0)
    )
    if delta is not None:
        check_scalar("delta", delta, low=1.0, low_open=True)
    kl_beta = check_scalar("kl_beta", kl_beta, low=0.0)
    check_tensor("completion_mask", completion_mask)
    check_same_shape("completion_mask", completion_mask, "per_token_logps", per_token_logps)
    mask = completion_mask.bool()
    adv = _prepare_advantages(advantages, per_token_logps)
    check_finite("per_token_logps", per_token_logps, mask)
    check_finite("advantages", adv)
    if old_per_token_logps is None:
        old = per_token_logps.detach()
    else:
        check_tensor("old_per_token_logps", old_per_token_logps)
        check_same_shape(
            "old_per_token_logps", old_per_token_logps, "per_token_logps", per_token_logps
        )
        check_finite("old_per_token_logps", old_per_token_logps, mask)
        old = old_per_token_logps
    if kl_beta > 0.0:
        if ref_per_token_logps is None:
            raise ValueError("ref_per_token_logps is required when kl_beta > 0")
        check_tensor("ref_per_token_logps", ref_per_token_logps)
        check_same_shape(
            "ref_per_token_logps", ref_per_token_logps, "per_token_logps", per_token_logps
        )
        check_finite("ref_per_token_logps", ref_per_token_logps, mask)

    # Padding positions may hold anything (even inf after exp); zero them before any arithmetic so
    # they cannot leak NaN into the sum or the gradient.
    logps = torch.where(mask, per_token_logps, torch.zeros_like(per_token_logps))
    old = torch.where(mask, old, torch.zeros_like(old))
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    unclipped = coef_1 if delta is None else torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(unclipped * adv, coef_2 * adv)

    per_token_kl: Tensor | None = None
    if kl_beta > 0.0:
        assert ref_per_token_logps is not None
        ref = torch.where(mask, ref_per_token_logps, torch.zeros_like(ref_per_token_logps))
        diff = ref - logps
        per_token_kl = torch.exp(diff) - diff - 1
        per_token_loss = per_token_loss + kl_beta * per_token_kl

    masked = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    maskf = mask.to(per_token_loss.dtype)
    n_tokens = maskf.sum()
    if loss_type == "grpo":
        loss = (masked.sum(-1) / maskf.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / n_tokens.clamp(min=1.0)
    elif loss_type == "dr_grpo":
        length = per_token_loss.shape[1] if max_completion_length is None else max_completion_length
        check_scalar("max_completion_length", length, low=1)
        loss = masked.sum() / (per_token_loss.shape[0] * length)
    else:  # dapo
        if num_items_in_batch is None:
            normaliser = n_tokens.clamp(min=1.0)
        else:
            norm = torch.as_tensor(num_items_in_batch, dtype=per_token_loss.dtype)
            if norm.numel() != 1 or not bool(torch.isfinite(norm)) or float(norm) < 0:
                raise ValueError(
                    f"num_items_in_batch must be a non-negative scalar, got {num_items_in_batch!r}"
                )
            normaliser = norm.to(per_token_loss.device).clamp(min=1.0)
        loss = masked.sum() / normaliser

    with torch.no_grad():
        denom = max(float(n_tokens), 1.0)
        low = (coef_1 < 1 - eps_low) & (adv < 0) & mask
        high = (coef_1 > 1 + eps_high) & (adv > 0) & mask
        metrics = {
            "grpo/loss": float(loss),
            "grpo/clip_ratio": float((low | high).sum()) / denom,
            "grpo/clip_ratio_low": float(low.sum()) / denom,
            "grpo/clip_ratio_high": float(high.sum()) / denom,
            "grpo/tokens": float(n_tokens),
            "grpo/empty_mask": 1.0 if float(n_tokens) == 0 else 0.0,
        }
        if per_token_kl is not None:
            metrics["grpo/kl"] = float((per_token_kl * maskf).sum()) / denom
    return loss, metrics


def dppo_mask(
    per_token_logps: Tensor,
    old_per_token_logps: Tensor,
    completion_mask: Tensor | None = None,
    *,
    advantages: Tensor | None = None,
    prob_diff_low: float | None = 0.2,
    prob_diff_high: float | None = 0.2,
    log_ratio_low: float | None = None,
    log_ratio_high: float | None = None,
) -> Tensor:
    """PRIME-RL-style trust-region *mask* (tokens are dropped, not clipped). Returns the keep mask.

    Two independent criteria, each switched off by passing ``None``:

    - probability difference (PRIME-RL's default loss, DPPO binary-TV, thresholds 0.2/0.2):
      ``d = exp(logp) - exp(logp_old)``; for tokens with advantage > 0 a token is invalid when
      ``d > prob_diff_high`` (its probability already rose too far), otherwise (advantage <= 0)
      when ``d < -prob_diff_low``. Needs ``advantages``.
    - log-ratio bounds (the seed recipe's ``[-4, 4]``): invalid when
      ``logp - logp_old`` is outside ``[log_ratio_low, log_ratio_high]``.

    Args:
        per_token_logps, old_per_token_logps: ``(B, T)`` or ``(T,)`` trainer / inference log-probs.
        completion_mask: same shape, 0/1 (None = all tokens).
        advantages: ``(B,)``, ``(B, T)`` or ``(T,)``; required for the probability-difference mask.

    Returns:
        bool tensor of the input shape: ``completion_mask & ~invalid``. Computed without gradient.
    """
    check_tensor("per_token_logps", per_token_logps)
    check_tensor("old_per_token_logps", old_per_token_logps)
    check_same_shape("old_per_token_logps", old_per_token_logps, "per_token_logps", per_token_logps)
    if completion_mask is None:
        keep = torch.ones_like(per_token_logps, dtype=torch.bool)
    else:
        check_same_shape("completion_mask", completion_mask, "per_token_logps", per_token_logps)
        keep = completion_mask.bool()
    with torch.no_grad():
        log_ratio = per_token_logps.detach() - old_per_token_logps.detach()
        invalid = torch.zeros_like(keep)
        if prob_diff_low is not None or prob_diff_high is not None:
            if advantages is None:
                raise ValueError("advantages is required for the probability-difference mask")
            adv = advantages.detach()
            if adv.dim() == 1 and per_token_logps.dim() == 2:
                adv = adv.unsqueeze(1)
            adv = adv.expand_as(per_token_logps)
            diff = per_token_logps.detach().exp() - old_per_token_logps.detach().exp()
            high = (
                diff > check_scalar("prob_diff_high", prob_diff_high, low=0.0)
                if prob_diff_high is not None
                else torch.zeros_like(keep)
            )
            low = (
                diff < -check_scalar("prob_diff_low", prob_diff_low, low=0.0)
                if prob_diff_low is not None
                else torch.zeros_like(keep)
            )
            invalid = invalid | torch.where(adv > 0, high, low)
        if log_ratio_high is not None:
            invalid = invalid | (log_ratio > check_scalar("log_ratio_high", log_ratio_high))
        if log_ratio_low is not None:
            invalid = invalid | (log_ratio < check_scalar("log_ratio_low", log_ratio_low))
        # NaN log-ratios compare false above; a NaN token must never be kept.
        invalid = invalid | torch.isnan(log_ratio)
    return keep & ~invalid
