"""Loss-time pieces of channels 2 and 3 (called from the trainer's ``_compute_loss``).

Channel 1 is TRL's own ``GRPOTrainer._compute_loss`` (every ``loss_type`` and TRL option, its
gradient-accumulation normalisation and metrics, unchanged); the trainer captures the completion
logits of that same student forward, and the functions here add channels 2 and 3 through
``loss.compose.combine`` with zero advantages (so combine's own GRPO term is exactly 0 and carries
no gradient).

Normalisation: like TRL's ``dapo``, each channel is normalised by its *global* count over the
generation batch (selected completion tokens for channel 2, pairs for channel 3), not by the
micro-batch's own count, so 1 x N and N x 1 gradient accumulation give the same update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from composer_replication.loss._logprobs import selective_log_softmax
from composer_replication.loss.compose import combine

# combine() reports every channel (zeros for inactive ones); keep only the channel computed.
_CHANNEL_PREFIXES = {
    "sdpo": ("sdpo/", "loss/sdpo", "jsd/", "taid/", "eopd/"),
    "replay": ("replay/", "loss/replay"),
}


def trim_left_padding(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Drop leading columns that are padding in every row.

    Rows are left-padded to the longest context of the whole generation batch; a micro-batch (or
    the subset of rows a channel uses) is often shorter, and padding costs a full forward.
    """
    used = mask.bool().any(0).nonzero()
    start = int(used[0]) if used.numel() else 0
    return ids[:, start:], mask[:, start:]


def forward_completion_logits(
    model: Any, prompt_ids: Tensor, prompt_mask: Tensor, comp_ids: Tensor, comp_mask: Tensor
) -> Tensor:
    """Raw logits ``(N, T, V)`` scoring each completion token (``logits[:, P-1:-1]``)."""
    T = comp_ids.shape[1]
    prompt_ids, prompt_mask = trim_left_padding(prompt_ids, prompt_mask)
    out = model(
        input_ids=torch.cat([prompt_ids, comp_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, comp_mask], dim=1),
        logits_to_keep=T + 1,
    )
    return out.logits[:, :-1]


def sequence_logps(logits: Tensor, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Summed and mean log-probs (temperature 1) of ``ids`` (N, T) under ``logits`` (N, T, V)."""
    per_token = selective_log_softmax(logits, ids)
    m = mask.to(per_token.dtype)
    summed = (per_token * m).sum(-1)
    return summed, summed / m.sum(-1).clamp(min=1.0)


def _zeros_channel1(mask: Tensor) -> dict[str, Any]:
    return {
        "per_token_logps": torch.zeros(mask.shape, dtype=torch.float32, device=mask.device),
        "completion_mask": mask,
        "advantages": torch.zeros(mask.shape[0], dtype=torch.float32, device=mask.device),
    }


def channel_metrics(metrics: dict[str, float], channel: str) -> dict[str, float]:
    """The metrics of one channel from a ``combine`` result."""
    prefixes = _CHANNEL_PREFIXES[channel]
    return {k: v for k, v in metrics.items() if k.startswith(prefixes)}


def sdpo_contribution(
    student_logits: Tensor,
    teacher_model: Any,
    inputs: dict[str, Any],
    loss_kwargs: dict[str, Any],
    normaliser: Tensor,
) -> tuple[Tensor, dict[str, float]] | None:
    """``alpha_sdpo * sum_over_selected_tokens(divergence) / normaliser`` and its metrics.

    ``student_logits`` (B, T, V) come from the channel-1 forward (with gradient); the teacher
    scores the same completion tokens under the hinted context, without gradient, on the selected
    rows only. None when no row with completion tokens is selected.
    """
    completion_mask = inputs["completion_mask"]
    sample_mask = inputs["sdpo_sample_mask"].bool() & completion_mask.bool().any(-1)
    rows = sample_mask.nonzero().squeeze(-1)
    if rows.numel() == 0:
        return None
    T = completion_mask.shape[1]
    t_ids = inputs["sdpo_teacher_input_ids"].index_select(0, rows)
    t_attn = inputs["sdpo_teacher_attention_mask"].index_select(0, rows)
    # Trim only the context part: the last T columns are the completion and must stay aligned.
    ctx_ids, ctx_attn = trim_left_padding(t_ids[:, :-T], t_attn[:, :-T])
    t_ids = torch.cat([ctx_ids, t_ids[:, -T:]], dim=1)
    t_attn = torch.cat([ctx_attn, t_attn[:, -T:]], dim=1)
    with torch.no_grad():
        teacher_logits = teacher_model(
            input_ids=t_ids, attention_mask=t_attn, logits_to_keep=T + 1
        ).logits[:, :-1]
    cm = completion_mask.index_select(0, rows)
    kwargs = {**loss_kwargs, "beta_replay": 0.0, "loss_type": "bnpo"}
    total, metrics = combine(
        **_zeros_channel1(cm),
        student_logits=student_logits.index_select(0, rows),
        teacher_logits=teacher_logits.to(student_logits.dtype),
        **kwargs,
    )
    # combine returns a token mean over these rows; turn it into sum / global count.
    scale = cm.sum().to(total.dtype) / normaliser
    out = channel_metrics(metrics, "sdpo")
    out["sdpo/frac_samples"] = float(inputs["sdpo_sample_mask"].float().mean())
    return total * scale, out


def replay_contribution(
    model: Any,
    student_logits: Tensor,
    inputs: dict[str, Any],
    loss_kwargs: dict[str, Any],
    normaliser: Tensor,
) -> tuple[Tensor, dict[str, float]] | None:
    """``beta_replay * sum_over_pairs(pair loss) / normaliser`` and its metrics.

    Rejected = the rollout on the pair's row, scored from the channel-1 logits (no extra forward);
    chosen = prompt + trace completion, one forward with gradient on the paired rows only.
    """
    rows = inputs["replay_pair_mask"].bool().nonzero().squeeze(-1)
    if rows.numel() == 0:
        return None
    c_mask = inputs["replay_chosen_mask"].index_select(0, rows)
    width = int(c_mask.sum(-1).max())
    c_ids = inputs["replay_chosen_ids"].index_select(0, rows)[:, :width]
    c_mask = c_mask[:, :width]
    chosen_logits = forward_completion_logits(
        model,
        inputs["prompt_ids"].index_select(0, rows),
        inputs["prompt_mask"].index_select(0, rows),
        c_ids,
        c_mask,
    )
    c_sum, c_avg = sequence_logps(chosen_logits, c_ids, c_mask)
    r_mask = inputs["completion_mask"].index_select(0, rows)
    r_sum, r_avg = sequence_logps(
        student_logits.index_select(0, rows), inputs["completion_ids"].index_select(0, rows), r_mask
    )
    ref: dict[str, Any] = {}
    if "replay_ref_chosen_logps" in inputs:
        ref = {
            "ref_chosen_logps": inputs["replay_ref_chosen_logps"].index_select(0, rows),
            "ref_rejected_logps": inputs["replay_ref_rejected_logps"].index_select(0, rows),
        }
    kwargs = {**loss_kwargs, "alpha_sdpo": 0.0, "loss_type": "bnpo"}
    total, metrics = combine(
        **_zeros_channel1(r_mask),
        chosen_logps=c_sum,
        rejected_logps=r_sum,
        chosen_avg_logps=c_avg,
        rejected_avg_logps=r_avg,
        **ref,
        **kwargs,
    )
    scale = torch.tensor(float(rows.numel()), dtype=total.dtype, device=total.device) / normaliser
    return total * scale, channel_metrics(metrics, "replay")
