"""Reading the composer batch (docs/api.md) and running the forward passes its channels need.

Everything here turns ``inputs`` into the tensors the channel terms take; the loss math lives in
``_channels``. A channel whose keys are all absent is off; a channel with only some of its keys
is a bug upstream and raises ``ValueError`` naming the missing key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from composer_replication.loss._logprobs import (
    CausalLM,
    cap_context,
    completion_logits,
    forward_logits,
    sequence_logps,
)
from composer_replication.loss._prefix import shared_prefix_completion_logits

# The composer batch (docs/api.md): key -> tensor (or a count); values are checked where read.
Batch = Mapping[str, object]

SDPO_KEYS = (
    "sdpo_teacher_input_ids",
    "sdpo_teacher_attention_mask",
    "sdpo_sample_mask",
    "sdpo_teacher_logits",
)
# Channel 3, explicit pairs: any chosen and rejected sequences, (N, L) each.
REPLAY_KEYS = tuple(
    f"replay_{side}_{part}"
    for side in ("chosen", "rejected")
    for part in ("input_ids", "attention_mask", "loss_mask")
)
# Channel 3, rollout pairs: row-aligned (B, ...); rejected = the rollout on the row.
REPLAY_ROW_KEYS = ("replay_pair_mask", "replay_chosen_ids", "replay_chosen_mask")
REPLAY_REF_KEYS = ("replay_ref_chosen_logps", "replay_ref_rejected_logps")


def require(inputs: Batch, key: str) -> Tensor:
    """``inputs[key]`` as a tensor, or ValueError naming the key."""
    value = inputs.get(key)
    if value is None:
        raise ValueError(f"inputs is missing required key {key!r} (see docs/api.md, compose_loss)")
    if not isinstance(value, Tensor):
        raise ValueError(f"inputs[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    return value


def optional_tensor(inputs: Batch, key: str) -> Tensor | None:
    """``inputs[key]`` when present (a tensor, else ValueError naming the key), else None."""
    return None if inputs.get(key) is None else require(inputs, key)


def optional_count(inputs: Batch, key: str) -> int | Tensor | None:
    """An optional count (an int or a tensor): ``num_items_in_batch``, ``max_completion_length``."""
    value = inputs.get(key)
    if value is None or isinstance(value, Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"inputs[{key!r}] must be an int or a tensor, got {type(value).__name__}")
    return value


def normaliser(inputs: Batch, key: str) -> Tensor | None:
    """The optional 0-dim count ``inputs[key]`` (a positive number) as a float tensor."""
    value = inputs.get(key)
    if value is None:
        return None
    count = torch.as_tensor(value, dtype=torch.float32)
    if count.numel() != 1 or not bool(torch.isfinite(count)) or float(count) <= 0:
        raise ValueError(f"inputs[{key!r}] must be one positive number, got {value!r}")
    return count.reshape(())


def channel1(inputs: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
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


def check_student(student: Tensor | None, completion_mask: Tensor) -> Tensor:
    """``student_logits`` must be ``(B, T, V)`` over the batch's completion positions."""
    if not isinstance(student, Tensor) or student.dim() != 3:
        raise ValueError(
            "student_logits must be the (B, T, V) completion logits of the channel-1 forward"
        )
    if student.shape[:2] != completion_mask.shape:
        raise ValueError(
            f"student_logits has shape {tuple(student.shape)} but completion_mask is "
            f"{tuple(completion_mask.shape)}; they must share (B, T)"
        )
    return student


@dataclass(frozen=True)
class SdpoRows:
    """Channel-2 tensors of the selected rows (the teacher forward ran on these rows only)."""

    student: Tensor  # (b, T, V)
    teacher: Tensor  # (b, T, V), no gradient
    token_mask: Tensor  # (b, T) bool
    frac: float  # selected rows / B
    normaliser: Tensor | None  # inputs["sdpo_num_tokens"]


def sdpo_rows(
    teacher: CausalLM,
    inputs: Batch,
    student: Tensor,
    *,
    logits_to_keep: bool,
    share_prefix: bool = False,
    max_context_length: int | None = None,
) -> SdpoRows | None:
    """Channel 2 of ``inputs``, or None when its keys are absent or no row is selected.

    A row enters when ``sdpo_sample_mask`` selects it and it has a completion token. Only those
    rows are kept: the teacher forward (under no_grad) runs on them alone, with the context's
    all-padding leading columns trimmed. ``share_prefix``: context prefixes that several rows
    share run once (`_prefix.shared_prefix_completion_logits`; a Hugging Face teacher), else,
    or when sharing saves nothing, one forward over the whole rows. ``max_context_length``:
    contexts longer than that many tokens are cut from the middle first (`cap_context`); the
    completion is never cut.
    """
    if not any(inputs.get(k) is not None for k in SDPO_KEYS):
        return None
    completion_mask = require(inputs, "completion_mask")
    check_student(student, completion_mask)
    sample_mask = require(inputs, "sdpo_sample_mask").bool()
    B, T = completion_mask.shape
    if sample_mask.shape != (B,):
        raise ValueError(f"sdpo_sample_mask must be (B,) = ({B},), got {tuple(sample_mask.shape)}")
    token_mask = completion_mask.bool() & sample_mask[:, None]
    selected = token_mask.any(-1)
    rows = selected.nonzero().squeeze(-1)
    if rows.numel() == 0:
        return None
    all_rows = rows.numel() == B

    def pick(x: Tensor) -> Tensor:
        return x if all_rows else x.index_select(0, rows)

    norm = normaliser(inputs, "sdpo_num_tokens")
    if inputs.get("sdpo_teacher_logits") is not None:
        teacher_logits = pick(require(inputs, "sdpo_teacher_logits"))
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
        t_ids, t_attn = pick(t_ids), pick(t_attn)
        ctx_ids, ctx_attn = t_ids[:, :-T], t_attn[:, :-T]
        if max_context_length is not None:
            ctx_ids, ctx_attn = cap_context(ctx_ids, ctx_attn, max_context_length)
        parts = (ctx_ids, ctx_attn, t_ids[:, -T:], t_attn[:, -T:])
        with torch.no_grad():
            shared = None
            if share_prefix:
                shared = shared_prefix_completion_logits(
                    teacher, *parts, logits_to_keep=logits_to_keep
                )
            teacher_logits = (
                shared
                if shared is not None
                else completion_logits(teacher, *parts, logits_to_keep=logits_to_keep)
            )
    frac = float(selected.float().mean())
    return SdpoRows(pick(student), teacher_logits.to(student.dtype), pick(token_mask), frac, norm)


@dataclass(frozen=True)
class ReplayPairs:
    """Channel-3 sequence log-probs of the N local pairs."""

    chosen: Tensor  # (N,) summed (dpo) or mean (simpo) log-probs, with gradient
    rejected: Tensor  # (N,)
    ref_chosen: Tensor | None  # (N,) summed reference log-probs (dpo)
    ref_rejected: Tensor | None
    normaliser: Tensor | None  # inputs["replay_num_pairs"]
    chosen_tokens: Tensor  # (N,) token count of each chosen completion (rpo_alpha's NLL)


# (summed, mean) log-probs and token counts of one side, (N,) each.
_Side = tuple[Tensor, Tensor, Tensor]
# One side to score: its (N, T, X) per-position outputs (logits, or last hidden states for the
# fused path), the tokens ``ids`` (N, T) and the ``mask`` (N, T) they are summed over.
ScoredSide = tuple[Tensor, Tensor, Tensor]
# How the sides become their summed and mean log-probs, called once with both sides of the pairs
# (so a scorer may process them together: the fused one runs one output-layer pass for both, one
# weight-gradient buffer instead of two): `score_each` (`sequence_logps` per side) by default.
Scorer = Callable[[Sequence[ScoredSide]], list[tuple[Tensor, Tensor]]]


def score_each(sides: Sequence[ScoredSide]) -> list[tuple[Tensor, Tensor]]:
    """`sequence_logps` of each side's logits."""
    return [sequence_logps(out, ids, mask) for out, ids, mask in sides]


# the chosen side, the rejected side, and the reference sums.
_Sides = tuple[_Side, _Side, tuple[Tensor | None, Tensor | None]]


def _references(
    inputs: Batch, dpo_variant: str, rows: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    if dpo_variant != "dpo":
        return None, None
    if any(inputs.get(k) is None for k in REPLAY_REF_KEYS):
        raise ValueError(
            "dpo_variant='dpo' needs inputs 'replay_ref_chosen_logps' and "
            "'replay_ref_rejected_logps', summed reference log-probs; provide them or use "
            "dpo_variant='simpo'"
        )
    ref_c, ref_r = require(inputs, REPLAY_REF_KEYS[0]), require(inputs, REPLAY_REF_KEYS[1])
    if rows is not None:
        ref_c, ref_r = ref_c.index_select(0, rows), ref_r.index_select(0, rows)
    return ref_c, ref_r


def _sequence(model: CausalLM, inputs: Batch, side: str) -> ScoredSide:
    """One explicit-pairs side's outputs, tokens and loss mask (token j scored by logits j-1)."""
    ids = require(inputs, f"replay_{side}_input_ids")
    attn = require(inputs, f"replay_{side}_attention_mask")
    loss_mask = require(inputs, f"replay_{side}_loss_mask")
    if ids.dim() != 2 or attn.shape != ids.shape or loss_mask.shape != ids.shape:
        raise ValueError(
            "replay *_input_ids, *_attention_mask and *_loss_mask must share one (N, L) shape; got "
            f"{tuple(ids.shape)}, {tuple(attn.shape)}, {tuple(loss_mask.shape)}"
        )
    logits = forward_logits(model, ids, attn)
    return logits[:, :-1], ids[:, 1:], loss_mask[:, 1:]


def _with_tokens(logps: tuple[Tensor, Tensor], mask: Tensor) -> _Side:
    return logps[0], logps[1], mask.sum(-1)


def _explicit_pairs(
    model: CausalLM, inputs: Batch, dpo_variant: str, score: Scorer
) -> _Sides | None:
    for key in REPLAY_KEYS:
        require(inputs, key)  # some replay keys but not all: name the missing one
    n_chosen = require(inputs, "replay_chosen_input_ids").shape[0]
    if n_chosen != require(inputs, "replay_rejected_input_ids").shape[0]:
        raise ValueError(
            "replay_chosen_* and replay_rejected_* must hold the same number of pairs N"
        )
    if n_chosen == 0:
        return None
    refs = _references(inputs, dpo_variant, None)
    sides = [_sequence(model, inputs, "chosen"), _sequence(model, inputs, "rejected")]
    chosen, rejected = score(sides)
    return _with_tokens(chosen, sides[0][2]), _with_tokens(rejected, sides[1][2]), refs


def _rollout_pairs(
    model: CausalLM,
    inputs: Batch,
    student: Tensor | None,
    dpo_variant: str,
    logits_to_keep: bool,
    score: Scorer,
) -> _Sides | None:
    for key in REPLAY_ROW_KEYS:
        require(inputs, key)
    prompt_ids, prompt_mask = require(inputs, "prompt_ids"), require(inputs, "prompt_mask")
    completion_ids = require(inputs, "completion_ids")
    completion_mask = require(inputs, "completion_mask")
    B = completion_mask.shape[0]
    pair_mask = require(inputs, "replay_pair_mask").bool()
    c_ids, c_mask = require(inputs, "replay_chosen_ids"), require(inputs, "replay_chosen_mask")
    if pair_mask.shape != (B,) or c_ids.dim() != 2 or c_ids.shape[0] != B:
        raise ValueError(
            f"replay_pair_mask must be (B,) and replay_chosen_ids (B, Tc) with B={B}; got "
            f"{tuple(pair_mask.shape)} and {tuple(c_ids.shape)}"
        )
    if c_mask.shape != c_ids.shape:
        raise ValueError("replay_chosen_ids and replay_chosen_mask must share one (B, Tc) shape")
    rows = pair_mask.nonzero().squeeze(-1)
    if rows.numel() == 0:
        return None
    student = check_student(student, completion_mask)
    refs = _references(inputs, dpo_variant, rows)
    c_mask = c_mask.index_select(0, rows)
    width = max(int(c_mask.sum(-1).max()), 1)  # right-padded: drop the all-padding tail
    c_ids = c_ids.index_select(0, rows)[:, :width]
    c_mask = c_mask[:, :width]
    chosen_out = completion_logits(
        model,
        prompt_ids.index_select(0, rows),
        prompt_mask.index_select(0, rows),
        c_ids,
        c_mask,
        logits_to_keep=logits_to_keep,
    )
    r_mask = completion_mask.index_select(0, rows)
    r_ids = completion_ids.index_select(0, rows)
    chosen, rejected = score(
        [(chosen_out, c_ids, c_mask), (student.index_select(0, rows), r_ids, r_mask)]
    )
    return _with_tokens(chosen, c_mask), _with_tokens(rejected, r_mask), refs


def replay_pairs(
    model: CausalLM,
    inputs: Batch,
    student: Tensor | None,
    dpo_variant: str,
    *,
    logits_to_keep: bool,
    score: Scorer = score_each,
) -> ReplayPairs | None:
    """Channel 3 of ``inputs`` in either form, or None when its keys are absent or N == 0.

    ``dpo``: summed log-probs and the reference sums from the batch (required); ``simpo``:
    length-normalised log-probs, references unused. Explicit pairs: one forward per side, with
    gradient. Rollout pairs: one forward with gradient on the chosen side of the paired rows;
    the rejected side is scored from ``student`` (the channel-1 logits).

    ``score`` turns both sides' per-position outputs into their log-probs: `score_each`
    (`sequence_logps` on logits) by default; the fused channel 3 passes ``model`` returning last
    hidden states (``HiddenStatesAsLogits``), ``student`` the channel-1 hidden states and a
    scorer through the output layer (``fused.fused_linear_logps``).
    """
    explicit = any(inputs.get(k) is not None for k in REPLAY_KEYS)
    rollout = any(inputs.get(k) is not None for k in REPLAY_ROW_KEYS)
    if explicit and rollout:
        raise ValueError(
            "inputs hold both channel-3 forms: explicit pairs (replay_chosen_input_ids, ...) and "
            "rollout pairs (replay_pair_mask, ...); pass one of them"
        )
    if explicit:
        sides = _explicit_pairs(model, inputs, dpo_variant, score)
    elif rollout:
        sides = _rollout_pairs(model, inputs, student, dpo_variant, logits_to_keep, score)
    else:
        return None
    if sides is None:
        return None
    (c_sum, c_avg, c_tokens), (r_sum, r_avg, _), (ref_c, ref_r) = sides
    norm = normaliser(inputs, "replay_num_pairs")
    if dpo_variant == "simpo":
        return ReplayPairs(c_avg, r_avg, None, None, norm, c_tokens)
    return ReplayPairs(c_sum, r_sum, ref_c, ref_r, norm, c_tokens)
