"""Reading the compose_loss batch (docs/api.md) and running its forward passes.

Everything here turns ``inputs`` into the tensors ``combine`` takes; the loss math lives in
``_channels``. A channel whose keys are all absent is off; a channel with only some of its keys
is a bug upstream and raises ``ValueError`` naming the missing key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from composer_replication.loss._logprobs import selective_log_softmax

SDPO_KEYS = (
    "sdpo_teacher_input_ids",
    "sdpo_teacher_attention_mask",
    "sdpo_sample_mask",
    "sdpo_teacher_logits",
)
REPLAY_KEYS = tuple(
    f"replay_{side}_{part}"
    for side in ("chosen", "rejected")
    for part in ("input_ids", "attention_mask", "loss_mask")
)
REPLAY_REF_KEYS = ("replay_ref_chosen_logps", "replay_ref_rejected_logps")


def require(inputs: Mapping[str, Any], key: str) -> Tensor:
    """``inputs[key]`` as a tensor, or ValueError naming the key."""
    value = inputs.get(key)
    if value is None:
        raise ValueError(f"inputs is missing required key {key!r} (see docs/api.md, compose_loss)")
    if not isinstance(value, Tensor):
        raise ValueError(f"inputs[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    return value


def forward_logits(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``model(input_ids=..., attention_mask=...).logits`` checked to be ``(B, L, V)``."""
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    logits = out.logits if hasattr(out, "logits") else out
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(
            "model(input_ids=..., attention_mask=...) must return .logits of shape (B, L, V)"
        )
    return logits


def channel1(inputs: Mapping[str, Any]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Validated ``prompt_ids, prompt_mask, completion_ids, completion_mask, advantages``."""
    prompt_ids, prompt_mask = require(inputs, "prompt_ids"), require(inputs, "prompt_mask")
    completion_ids = require(inputs, "completion_ids")
    completion_mask = require(inputs, "completion_mask")
    advantages = require(inputs, "advantages")
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError("prompt_ids and prompt_mask must both be (B, P)")
    if completion_ids.dim() != 2 or completion_mask.shape != completion_ids.shape:
        raise ValueError("completion_ids and completion_mask must both be (B, T)")
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError("prompt_ids and completion_ids must have the same batch size B")
    if prompt_ids.shape[1] < 1:
        raise ValueError("prompt_ids must hold at least one token per row (P >= 1)")
    return prompt_ids, prompt_mask, completion_ids, completion_mask, advantages


def sdpo_inputs(
    model: Any, inputs: Mapping[str, Any], student: Tensor, completion_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, float] | None:
    """Channel-2 tensors ``(student_rows, teacher_rows, token_mask_rows, frac_samples)``.

    Only the selected rows are kept: the teacher forward (under no_grad, same model) runs on
    them alone. ``None`` when no channel-2 key is present. When keys are present but no sample is
    selected, returns empty row tensors (the caller turns the channel off).
    """
    if not any(inputs.get(k) is not None for k in SDPO_KEYS):
        return None
    sample_mask = require(inputs, "sdpo_sample_mask").bool()
    B, T = completion_mask.shape
    if sample_mask.shape != (B,):
        raise ValueError(f"sdpo_sample_mask must be (B,) = ({B},), got {tuple(sample_mask.shape)}")
    token_mask = completion_mask.bool() & sample_mask[:, None]
    rows = token_mask.any(-1).nonzero().squeeze(-1)
    frac = float(sample_mask.float().mean()) if B else 0.0
    all_rows = rows.numel() == B

    def pick(x: Tensor) -> Tensor:
        return x if all_rows else x.index_select(0, rows)

    if rows.numel() == 0:
        return student[:0], student[:0].detach(), token_mask[:0], frac
    if inputs.get("sdpo_teacher_logits") is not None:
        teacher = pick(require(inputs, "sdpo_teacher_logits"))
    else:
        t_ids = require(inputs, "sdpo_teacher_input_ids")
        t_attn = require(inputs, "sdpo_teacher_attention_mask")
        if (
            t_ids.dim() != 2
            or t_ids.shape[0] != B
            or t_ids.shape[1] <= T
            or t_attn.shape != t_ids.shape
        ):
            raise ValueError(
                f"sdpo_teacher_input_ids and sdpo_teacher_attention_mask must both be (B={B}, L) with "
                f"L > T={T} (teacher context, then the same completion in the last T positions); "
                f"got {tuple(t_ids.shape)} and {tuple(t_attn.shape)}"
            )
        L = t_ids.shape[1]
        with torch.no_grad():
            teacher = forward_logits(model, pick(t_ids), pick(t_attn))[:, L - T - 1 : -1]
    return pick(student), teacher, pick(token_mask), frac


def _sequence_logps(
    model: Any, ids: Tensor, attn: Tensor, loss_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Summed and mean log-probs over ``loss_mask`` (token j is scored by the logits at j-1)."""
    if ids.dim() != 2 or attn.shape != ids.shape or loss_mask.shape != ids.shape:
        raise ValueError(
            "replay *_input_ids, *_attention_mask and *_loss_mask must share one (N, L) shape; got "
            f"{tuple(ids.shape)}, {tuple(attn.shape)}, {tuple(loss_mask.shape)}"
        )
    logits = forward_logits(model, ids, attn)
    per_token = selective_log_softmax(logits[:, :-1], ids[:, 1:])
    lm = loss_mask[:, 1:].to(per_token.dtype)
    summed = (per_token * lm).sum(-1)
    return summed, summed / lm.sum(-1).clamp(min=1.0)


def replay_inputs(
    model: Any, inputs: Mapping[str, Any], dpo_variant: str
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None:
    """Channel-3 ``(chosen, rejected, ref_chosen, ref_rejected)`` sequence log-probs.

    ``dpo``: summed log-probs and the reference sums from the batch (required);
    ``simpo``: length-normalised log-probs, references unused. ``None`` when the replay keys are
    absent or N == 0. One forward per side, with gradient.
    """
    present = [k for k in REPLAY_KEYS if inputs.get(k) is not None]
    if not present:
        return None
    for key in REPLAY_KEYS:
        require(inputs, key)  # some replay keys but not all: name the missing one
    c_ids, r_ids = (
        require(inputs, "replay_chosen_input_ids"),
        require(inputs, "replay_rejected_input_ids"),
    )
    if c_ids.shape[0] != r_ids.shape[0]:
        raise ValueError(
            "replay_chosen_* and replay_rejected_* must hold the same number of pairs N"
        )
    if c_ids.shape[0] == 0:
        return None
    refs: tuple[Tensor | None, Tensor | None] = (None, None)
    if dpo_variant == "dpo":
        if any(inputs.get(k) is None for k in REPLAY_REF_KEYS):
            raise ValueError(
                "dpo_variant='dpo' needs inputs 'replay_ref_chosen_logps' and "
                "'replay_ref_rejected_logps' (N,) summed reference log-probs; provide them or use "
                "dpo_variant='simpo'"
            )
        refs = (require(inputs, REPLAY_REF_KEYS[0]), require(inputs, REPLAY_REF_KEYS[1]))
    c_sum, c_avg = _sequence_logps(
        model,
        c_ids,
        require(inputs, "replay_chosen_attention_mask"),
        require(inputs, "replay_chosen_loss_mask"),
    )
    r_sum, r_avg = _sequence_logps(
        model,
        r_ids,
        require(inputs, "replay_rejected_attention_mask"),
        require(inputs, "replay_rejected_loss_mask"),
    )
    if dpo_variant == "simpo":
        return c_avg, r_avg, None, None
    return c_sum, r_sum, refs[0], refs[1]
