"""``grpo_composer``: verl's GRPO outcome advantage, as the composer recipe's advantage estimator.

Called by verl 0.9's ``compute_advantage`` for a registered (non built-in) estimator as
``fn(token_level_rewards=(B, T), response_mask=(B, T), config=AlgoConfig, index=uids (B,))``
(plus ``reward_baselines`` when the batch has them, ignored here). Per prompt group (rows sharing
a ``uid``): ``r = token_level_rewards.sum(-1)``, ``A = (r - mean) / (std + epsilon)`` with the
unbiased (Bessel) std, or ``r - mean`` when ``config.norm_adv_by_std_in_grpo`` is False; a group
of one gets mean 0 and std 1, as verl's own ``compute_grpo_outcome_advantage``. ``A`` is broadcast
over the response and multiplied by ``response_mask``; advantages and returns are the same tensor.

Channels 2 and 3 do not change the advantage: they are terms of the ``composer`` policy loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from verl.trainer.config import AlgoConfig


def grpo_composer_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | None = None,
    config: AlgoConfig | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    **_extra: Any,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantages ``(B, T)``, returned twice (advantages, returns)."""
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be (batch, response_length)"
        )
    if index is None:
        raise ValueError(
            "grpo_composer needs the prompt group of every row (verl passes the batch's "
            "non_tensor_batch['uid'] as index); the batch has no 'uid'"
        )
    uids = np.asarray(index)
    if uids.shape != (token_level_rewards.shape[0],):
        raise ValueError(
            f"index has shape {uids.shape}, expected ({token_level_rewards.shape[0]},)"
        )
    if norm_adv_by_std_in_grpo is None:
        norm_adv_by_std_in_grpo = bool(getattr(config, "norm_adv_by_std_in_grpo", True))

    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        _, group = np.unique(uids, return_inverse=True)
        group_t = torch.as_tensor(group, device=scores.device)
        n_groups = int(group_t.max()) + 1 if group_t.numel() else 0
        work = scores.to(torch.float64)
        count = torch.zeros(n_groups, dtype=work.dtype, device=work.device).index_add_(
            0, group_t, torch.ones_like(work)
        )
        mean = torch.zeros_like(count).index_add_(0, group_t, work) / count
        sq = torch.zeros_like(count).index_add_(0, group_t, (work - mean[group_t]) ** 2)
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        single = count == 1
        mean = torch.where(single, torch.zeros_like(mean), mean)
        std = torch.where(single, torch.ones_like(std), std)
        adv = work - mean[group_t]
        if norm_adv_by_std_in_grpo:
            adv = adv / (std[group_t] + epsilon)
        out = adv.to(scores.dtype).unsqueeze(-1) * response_mask
    return out, out
