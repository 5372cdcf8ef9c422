"""``composer``: the three-channel composer loss as a verl 0.9 policy loss.

verl 0.9.1's actor loss (``verl.workers.utils.losses.ppo_loss``) calls the registered policy loss
with exactly ``old_log_prob, log_prob, advantages, response_mask`` (all ``(B, T)`` over the
response), ``loss_agg_mode``, ``config`` (the ``ActorConfig``, whose ``global_batch_info`` holds
``dp_size`` / ``batch_num_tokens`` for the step) and ``rollout_is_weights``. No other batch key
reaches it. So:

- Channel 1 always runs: ``loss.combine``'s GRPO surrogate on those tensors, clip range from
  ``config.clip_ratio_low`` / ``clip_ratio_high``, normalised as verl's ``token-mean``
  (sum / (``batch_num_tokens`` / ``dp_size``), i.e. ``loss_type="dapo"``). With nothing else
  given this is verl's vanilla PPO loss without its dual clip (``clip_ratio_c``).
- Channels 2 and 3 need the extra DataProto keys below. ``composer_ppo_loss`` (this module) is a
  drop-in for verl's actor loss function that takes them from the micro-batch and hands them to
  the policy loss; install it with ``actor_rollout_wg.set_loss_fn`` (docs/recipes/verl.md). A
  direct caller may also pass them as keyword arguments. Without them the loss is plain GRPO.

DataProto keys (``data.batch``), all aligned with the batch rows:

| key | shape | meaning |
|---|---|---|
| ``sdpo_teacher_log_prob`` | (B, T) float | channel 2: log-probs of the row's response tokens under the teacher (the hinted context) |
| ``sdpo_sample_mask`` | (B,) bool, optional | channel 2: rows that enter it (absent: all) |
| ``replay_pair_id`` | (B,) long | channel 3: pair id of the row, -1 when it is in no pair |
| ``replay_is_chosen`` | (B,) bool | channel 3: True on the teacher-trace row (chosen), False on the rollout (rejected) |
| ``replay_ref_log_prob`` | (B,) float | channel 3 with ``dpo_variant="dpo"``: the row's summed reference log-prob |

Channel 2 (sampled-token reverse KL): the GRPO surrogate of ``loss.grpo_loss`` with the per-token
advantage ``sg(teacher_log_prob - log_prob)`` on the selected rows, the same clip range and
normaliser as channel 1, weight ``alpha_sdpo``. On-policy its value is the sampled estimate of
``KL(policy || teacher)`` per token and its gradient that of the reverse KL.

Channel 3 (trace replay): a pair is two rows of the batch with the same ``replay_pair_id``, the
teacher trace appended to the batch as a row (prompt + teacher completion, advantage 0) and the
policy's rollout; verl's own forward gives both rows' log-probs. Summed (``dpo``) or averaged
(``simpo``) over ``response_mask``, they enter ``loss.combine`` as ``chosen_logps`` /
``rejected_logps`` (``replay_ref_log_prob`` gives ``ref_chosen_logps`` / ``ref_rejected_logps``),
weight ``beta_replay``. Both rows must land in the same micro-batch: a pair with one row in this
micro-batch is skipped and counted in ``composer/replay/split_pairs``.

Settings: the ``compose_loss`` keywords of ``recipes.sampled.SAMPLED_TOKEN_KEYS`` (the loss
library's ``SampledTokenSettings``: defaults, checks and help there), given to
``composer_ppo_loss`` (or as keyword arguments) and forwarded to ``combine`` as they are.
``loss_agg_mode`` other than ``"token-mean"`` and ``rollout_is_weights`` (verl's
rollout-correction weights) raise ``ValueError``: ``combine`` has neither. Metrics: ``combine``'s, prefixed ``composer/``, as python floats.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from composer_replication.loss import ComposeConfig, combine, grpo_loss
from composer_replication.recipes.sampled import (
    SAMPLED_TOKEN_KEYS,
    reject_logit_keywords,
    sampled_token_config,
    sampled_token_kwargs,
)

if TYPE_CHECKING:
    from tensordict import TensorDict
    from verl.workers.config import ActorConfig

CHANNEL2_KEYS = ("sdpo_teacher_log_prob", "sdpo_sample_mask")
CHANNEL3_KEYS = ("replay_pair_id", "replay_is_chosen", "replay_ref_log_prob")
BATCH_KEYS = CHANNEL2_KEYS + CHANNEL3_KEYS
LOSS_AGG_MODES = ("token-mean",)

# What composer_ppo_loss hands to the policy loss for the duration of one verl ppo_loss call.
_BATCH: contextvars.ContextVar[Mapping[str, object] | None] = contextvars.ContextVar(
    "composer_verl_batch", default=None
)


@contextmanager
def batch_context(values: Mapping[str, object]) -> Iterator[None]:
    """Make ``values`` (batch tensors and settings) visible to ``composer_policy_loss``."""
    token = _BATCH.set(dict(values))
    try:
        yield
    finally:
        _BATCH.reset(token)


def _clip_range(config: ActorConfig | None) -> tuple[float, float]:
    if config is None:
        return 0.2, 0.2
    base = config.get("clip_ratio", 0.2)
    low = config.get("clip_ratio_low", None)
    high = config.get("clip_ratio_high", None)
    return float(base if low is None else low), float(base if high is None else high)


def _normaliser(config: ActorConfig | None, mask: Tensor) -> Tensor:
    """verl's token-mean denominator: ``batch_num_tokens / dp_size``, else the local count."""
    info = {} if config is None else (config.get("global_batch_info", None) or {})
    tokens = info.get("batch_num_tokens")
    if tokens is None:
        return mask.sum()
    return torch.tensor(float(tokens) / float(info.get("dp_size", 1) or 1))


def _row_vector(name: str, value: object, rows: int) -> Tensor:
    if not isinstance(value, Tensor) or value.shape != (rows,):
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"batch key {name!r} must be a ({rows},) tensor, got {shape}")
    return value


def _pairs(
    log_prob: Tensor, mask: Tensor, batch: Mapping[str, object], variant: str
) -> tuple[dict[str, Tensor], float]:
    """combine's channel-3 keyword tensors from the rows marked as pairs; and the split count."""
    rows = log_prob.shape[0]
    missing = [k for k in CHANNEL3_KEYS[:2] if k not in batch]
    if missing:
        raise ValueError(
            f"channel 3 got {', '.join(k for k in CHANNEL3_KEYS[:2] if k in batch)} but not "
            f"{', '.join(missing)}; a replay pair needs replay_pair_id and replay_is_chosen"
        )
    pair_id = _row_vector("replay_pair_id", batch["replay_pair_id"], rows).long()
    chosen = _row_vector("replay_is_chosen", batch["replay_is_chosen"], rows).bool()
    counts = mask.to(log_prob.dtype).sum(-1)  # each row's tokens (simpo's mean, rpo's NLL)
    seq = torch.where(mask, log_prob, torch.zeros_like(log_prob)).sum(-1)
    if variant == "simpo":
        seq = seq / counts.clamp(min=1.0)
    ref = batch.get("replay_ref_log_prob")
    if variant == "dpo" and ref is None:
        raise ValueError(
            "dpo_variant='dpo' needs the batch key 'replay_ref_log_prob' (each row's summed "
            "reference log-prob); add it or use dpo_variant='simpo'"
        )
    if ref is not None:
        ref = _row_vector("replay_ref_log_prob", ref, rows)
    chosen_rows: list[int] = []
    rejected_rows: list[int] = []
    split = 0
    for pid in sorted(set(pair_id[pair_id >= 0].tolist())):
        members = (pair_id == pid).nonzero().flatten().tolist()
        c = [i for i in members if bool(chosen[i])]
        r = [i for i in members if not bool(chosen[i])]
        if len(c) > 1 or len(r) > 1:
            raise ValueError(
                f"replay_pair_id {pid} marks {len(c)} chosen and {len(r)} rejected rows; a pair "
                "is exactly one chosen (teacher trace) and one rejected (rollout) row"
            )
        if len(c) == 1 and len(r) == 1:
            chosen_rows.append(c[0])
            rejected_rows.append(r[0])
        else:
            split += 1
    ci = torch.tensor(chosen_rows, dtype=torch.long, device=log_prob.device)
    ri = torch.tensor(rejected_rows, dtype=torch.long, device=log_prob.device)
    lengths = counts[ci]
    if variant == "simpo":
        out = {"chosen_avg_logps": seq[ci], "rejected_avg_logps": seq[ri]}
        return {**out, "chosen_lengths": lengths}, float(split)
    assert ref is not None
    out = {
        "chosen_lengths": lengths,
        "chosen_logps": seq[ci],
        "rejected_logps": seq[ri],
        "ref_chosen_logps": ref[ci].to(log_prob.dtype),
        "ref_rejected_logps": ref[ri].to(log_prob.dtype),
    }
    return out, float(split)


def composer_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: ActorConfig | None = None,
    rollout_is_weights: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, dict[str, float]]:
    """verl policy-loss function ``composer``; see the module docstring.

    ``kwargs`` (merged over what ``composer_ppo_loss`` put in context): the DataProto keys
    ``BATCH_KEYS`` and the ``SAMPLED_TOKEN_KEYS`` settings. Returns ``(loss, metrics)``.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"the composer policy loss supports actor.loss_agg_mode='token-mean' (verl's "
            f"default), got {loss_agg_mode!r}"
        )
    if rollout_is_weights is not None:
        raise ValueError(
            "the composer policy loss does not apply verl's rollout-correction weights "
            "(rollout_is_weights); turn rollout correction off (algorithm.rollout_correction)"
        )
    values = {**(_BATCH.get() or {}), **kwargs}
    batch = {k: values.pop(k) for k in BATCH_KEYS if values.get(k) is not None}
    reject_logit_keywords(
        values, "verl", "verl's PPO surrogate (set actor.clip_ratio_low / clip_ratio_high)"
    )
    unknown = sorted(set(values) - set(SAMPLED_TOKEN_KEYS))
    if unknown:
        raise ValueError(
            f"unknown composer policy-loss argument(s): {', '.join(unknown)}; batch keys are "
            f"{', '.join(BATCH_KEYS)}"
        )
    cfg = sampled_token_config(values)
    mask = response_mask.bool()
    eps_low, eps_high = _clip_range(config)
    norm = _normaliser(config, mask)

    pairs: dict[str, Tensor] = {}
    split = 0.0
    if cfg.beta_replay != 0.0 and any(k in batch for k in CHANNEL3_KEYS):
        pairs, split = _pairs(log_prob, mask, batch, cfg.dpo_variant)
    sdpo, frac = _sampled_sdpo(cfg, log_prob, old_log_prob, mask, batch, eps_low, eps_high, norm)
    # combine forms the total (loss.assemble): channel 1, this channel 2, channel 3 from pairs
    loss, metrics = combine(
        per_token_logps=log_prob,
        completion_mask=mask,
        advantages=advantages,
        old_per_token_logps=old_log_prob,
        num_items_in_batch=norm,
        sdpo_result=sdpo,  # the sampled-token form (combine's own channel 2 needs logits)
        loss_type="dapo",
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        chosen_logps=pairs.get("chosen_logps"),
        rejected_logps=pairs.get("rejected_logps"),
        ref_chosen_logps=pairs.get("ref_chosen_logps"),
        ref_rejected_logps=pairs.get("ref_rejected_logps"),
        chosen_avg_logps=pairs.get("chosen_avg_logps"),
        rejected_avg_logps=pairs.get("rejected_avg_logps"),
        chosen_lengths=pairs.get("chosen_lengths"),
        **sampled_token_kwargs(cfg),  # alpha_sdpo, beta_replay and channel 3's settings
    )
    metrics["replay/split_pairs"] = split
    if frac is not None:  # channel 2 asked for: the share of rows it selected (0 when none)
        metrics["sdpo/frac_samples"] = frac
    return loss, {f"composer/{k}": v for k, v in metrics.items()}


def _sampled_sdpo(
    cfg: ComposeConfig,
    log_prob: Tensor,
    old_log_prob: Tensor,
    mask: Tensor,
    batch: Mapping[str, object],
    eps_low: float,
    eps_high: float,
    norm: Tensor,
) -> tuple[tuple[Tensor, dict[str, float]] | None, float | None]:
    """Channel 2's sampled-token reverse KL before ``alpha_sdpo`` (or None: off or no token)
    and the share of rows it selects (None when the channel is off)."""
    teacher = batch.get("sdpo_teacher_log_prob")
    if cfg.alpha_sdpo == 0.0 or teacher is None:
        return None, None
    if not isinstance(teacher, Tensor) or teacher.shape != log_prob.shape:
        shape = tuple(teacher.shape) if isinstance(teacher, Tensor) else type(teacher).__name__
        raise ValueError(
            f"batch key 'sdpo_teacher_log_prob' must be {tuple(log_prob.shape)} like "
            f"log_prob (one log-prob per response token), got {shape}"
        )
    token_mask = mask
    if "sdpo_sample_mask" in batch:
        rows = _row_vector("sdpo_sample_mask", batch["sdpo_sample_mask"], log_prob.shape[0])
        token_mask = mask & rows.bool()[:, None]
    frac = float(token_mask.any(-1).float().mean())
    if not bool(token_mask.any()):
        return None, frac
    signal = torch.where(token_mask, teacher.to(log_prob.dtype) - log_prob, 0.0).detach()
    sdpo, sdpo_metrics = grpo_loss(
        log_prob,
        old_log_prob,
        signal,
        token_mask,
        loss_type="dapo",
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        num_items_in_batch=norm,
    )
    metrics = {
        "loss/sdpo": float(sdpo.detach()),
        "sdpo/clip_ratio": sdpo_metrics["grpo/clip_ratio"],
    }
    return (sdpo, metrics), frac


def composer_ppo_loss(
    config: ActorConfig,
    model_output: Any,
    data: TensorDict,
    dp_group: Any = None,
    **settings: Any,
) -> Any:
    """verl's actor loss function (``ppo_loss``) with the composer DataProto keys passed through.

    Same signature and result as ``verl.workers.utils.losses.ppo_loss`` (plus ``settings``, the
    ``SAMPLED_TOKEN_KEYS``); it reads ``BATCH_KEYS`` from the micro-batch ``data`` (a TensorDict;
    nested tensors are padded) and runs verl's own ``ppo_loss``, whose call of the policy loss
    ``composer`` then sees them. Needs ``actor.policy_loss.loss_mode=composer``.
    """
    from verl.workers.utils.losses import ppo_loss

    reject_logit_keywords(
        settings, "verl", "verl's PPO surrogate (set actor.clip_ratio_low / clip_ratio_high)"
    )
    sampled_token_config(settings)
    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    if loss_mode != "composer":
        raise ValueError(
            "composer_ppo_loss passes the composer batch keys to the policy loss 'composer', but "
            f"actor.policy_loss.loss_mode is {loss_mode!r}; set "
            "actor_rollout_ref.actor.policy_loss.loss_mode=composer"
        )
    values: dict[str, object] = dict(settings)
    keys = set(data.keys())
    for key in BATCH_KEYS:
        if key in keys:
            value = data[key]
            values[key] = value.to_padded_tensor(0.0) if value.is_nested else value
    with batch_context(values):
        return ppo_loss(config, model_output, data, dp_group)
