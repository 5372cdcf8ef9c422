"""The three channels as pure tensor functions, and how their results are summed and reported.

Shared by ``compose.combine`` (tensors given) and ``compose.compose_loss`` / ``sdpo_term`` /
``replay_term`` (tensors from the batch's forward passes). ``weighted_total`` (which ``assemble``
calls, adding the metrics) is the only place the total is formed:
``grpo + alpha_sdpo * sdpo + beta_replay * replay``, where an inactive channel is not added at
all (so switching a channel off is bit-exact, not "plus 0.0 times something").
"""

from __future__ import annotations

from torch import Tensor

from composer_replication.loss import sdpo_wrappers
from composer_replication.loss._checks import check_same_shape, check_tensor
from composer_replication.loss._config import ComposeConfig
from composer_replication.loss.loss_settings import SampledTokenSettings
from composer_replication.loss.policy import grpo_loss
from composer_replication.loss.preference import dpo_loss, simpo_loss

Result = tuple[Tensor, dict[str, float]]
REPLAY_METRICS = ("pairs", "accuracy", "margin", "chosen_reward", "rejected_reward")


def sdpo_divergence(
    cfg: ComposeConfig, student: Tensor, teacher: Tensor, token_mask: Tensor
) -> Result:
    """Channel-2 divergence on ``(b, T, V)`` completion logits with a ``(b, T)`` token mask.

    The token mean over the mask; its metrics plus ``loss/sdpo`` (that mean).
    """
    wrapper = sdpo_wrappers.get(cfg.sdpo_wrapper)
    loss, m = wrapper.divergence(cfg, student, teacher, token_mask)
    m["loss/sdpo"] = float(loss.detach())
    return loss, m


def replay_preference(
    cfg: SampledTokenSettings,
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor | None,
    ref_rejected: Tensor | None,
    ref_names: tuple[str, str],
    chosen_tokens: Tensor | None = None,
    tokens_name: str = "chosen_lengths",
) -> Result:
    """Channel-3 loss, the mean over pairs; ``chosen``/``rejected`` are summed (dpo) or averaged
    (simpo) log-probs. Metrics ``replay/*`` and ``loss/replay`` (that mean). It reads only
    `SampledTokenSettings` (the PRIME-RL recipe hands it its own config).

    With ``rpo_alpha > 0`` it adds ``rpo_alpha * replay_nll(...)`` (metric ``replay/nll``), which
    needs ``chosen_tokens`` ``(N,)``, the token count of each chosen completion (named
    ``tokens_name`` in the error when missing)."""
    if cfg.dpo_variant == "simpo":
        loss, m = simpo_loss(
            chosen,
            rejected,
            beta=cfg.simpo_beta,
            gamma=cfg.simpo_gamma,
            label_smoothing=cfg.label_smoothing,
        )
        prefix = "simpo"
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(
                f"dpo_variant='dpo' needs reference log-probs {ref_names[0]!r} and {ref_names[1]!r} "
                "(summed over each completion); provide them or use dpo_variant='simpo'"
            )
        loss, m = dpo_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=cfg.replay_dpo_beta,
            label_smoothing=cfg.label_smoothing,
        )
        prefix = "dpo"
    metrics = {f"replay/{k}": m[f"{prefix}/{k}"] for k in REPLAY_METRICS}
    if cfg.rpo_alpha != 0.0:
        if chosen_tokens is None:
            raise ValueError(
                f"rpo_alpha={cfg.rpo_alpha} needs {tokens_name!r}, the (N,) token count of each "
                "chosen completion; provide it or set rpo_alpha=0"
            )
        nll = replay_nll(chosen, chosen_tokens, summed=cfg.dpo_variant != "simpo")
        loss = loss + cfg.rpo_alpha * nll
        metrics["replay/nll"] = float(nll.detach())
    metrics["loss/replay"] = float(loss.detach())
    return loss, metrics


def replay_nll(chosen: Tensor, chosen_tokens: Tensor, *, summed: bool) -> Tensor:
    """RPO's NLL term: ``-sum(log p(chosen tokens)) / sum(tokens)`` over the N chosen
    completions, the token mean of the cross-entropy on the chosen side, as TRL's DPO
    (``rpo_alpha``) and CPO (``cpo_alpha``) add it. ``chosen`` ``(N,)`` holds summed
    (``summed=True``) or per-completion mean log-probs; ``chosen_tokens`` ``(N,)`` the counts."""
    check_tensor("chosen_tokens", chosen_tokens, ndim=1)
    check_same_shape("chosen_tokens", chosen_tokens, "chosen", chosen)
    tokens = chosen_tokens.to(device=chosen.device, dtype=chosen.dtype)
    if bool((tokens < 0).any()):
        raise ValueError("chosen_tokens must be >= 0 (token counts)")
    sums = chosen if summed else chosen * tokens
    return -sums.sum() / tokens.sum().clamp(min=1.0)


def scaled(result: Result, count: Tensor, normaliser: Tensor | None) -> Result:
    """``mean * count / normaliser``: a mean over ``count`` local items turned into their sum over
    a global ``normaliser`` (unchanged without one). The metrics keep the local mean."""
    if normaliser is None:
        return result
    loss, metrics = result
    factor = count.to(device=loss.device, dtype=loss.dtype) / normaliser.to(loss.device)
    return loss * factor, metrics


def weighted_total(
    cfg: ComposeConfig, grpo: Tensor, sdpo: Tensor | None, replay: Tensor | None
) -> Tensor:
    """``grpo + alpha_sdpo * sdpo + beta_replay * replay``, a channel given as None not added."""
    total = grpo
    if sdpo is not None:
        total = total + cfg.alpha_sdpo * sdpo
    if replay is not None:
        total = total + cfg.beta_replay * replay
    return total


def assemble(
    cfg: ComposeConfig, grpo: Result, sdpo: Result | None, replay: Result | None
) -> Result:
    """Sum the active channels and build the metrics dict (inactive channels report 0.0).

    ``sdpo``/``replay`` are None when the channel is off for this step; they are then not added
    at all, which is what makes ``alpha_sdpo=0`` / ``beta_replay=0`` bit-exact.
    """
    total = weighted_total(
        cfg,
        grpo[0],
        None if sdpo is None else sdpo[0],
        None if replay is None else replay[0],
    )
    metrics = dict(grpo[1])
    metrics["loss/grpo"] = float(grpo[0].detach())
    metrics.update({"sdpo/active": 0.0, "sdpo/frac_samples": 0.0, "loss/sdpo": 0.0})
    if sdpo is not None:
        metrics.update(sdpo[1])
        metrics["sdpo/active"] = 1.0
    metrics.update({"replay/active": 0.0, "loss/replay": 0.0})
    metrics.update({f"replay/{key}": 0.0 for key in REPLAY_METRICS})
    if cfg.rpo_alpha != 0.0:
        metrics["replay/nll"] = 0.0
    if replay is not None:
        metrics.update(replay[1])
        metrics["replay/active"] = 1.0
    if cfg.alpha_sdpo != 0.0:  # the wrapper's metrics of every step (TAID's taid/t)
        metrics.update(sdpo_wrappers.get(cfg.sdpo_wrapper).step_metrics(cfg))
    metrics["loss/total"] = float(total.detach())
    return total, metrics


def grpo_term(
    cfg: ComposeConfig,
    per_token_logps: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_per_token_logps: Tensor | None,
    ref_per_token_logps: Tensor | None,
    num_items_in_batch: int | Tensor | None,
    max_completion_length: int | None,
) -> Result:
    """Channel 1: ``policy.grpo_loss`` with the configured clipping, KL and aggregation."""
    return grpo_loss(
        per_token_logps,
        old_per_token_logps,
        advantages,
        completion_mask,
        loss_type=cfg.loss_type,
        epsilon_low=cfg.epsilon_low,
        epsilon_high=cfg.epsilon_high,
        delta=cfg.delta,
        ref_per_token_logps=ref_per_token_logps,
        kl_beta=cfg.kl_beta,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )


def sample_token_mask(completion_mask: Tensor, sdpo_mask: Tensor | None) -> Tensor:
    """``completion_mask`` and-ed with a ``(B,)`` sample mask or ``(B, T)`` token mask."""
    token_mask = completion_mask.bool()
    if sdpo_mask is None:
        return token_mask
    if sdpo_mask.shape == completion_mask.shape:
        return token_mask & sdpo_mask.bool()
    if sdpo_mask.dim() == 1 and sdpo_mask.shape[0] == completion_mask.shape[0]:
        return token_mask & sdpo_mask.bool()[:, None]
    raise ValueError(
        f"sdpo_mask must be (B,) or (B, T) = {tuple(completion_mask.shape)}, got {tuple(sdpo_mask.shape)}"
    )
