"""Log-probs of given tokens: from logits, and from a causal LM on context + completion.

``selective_log_softmax``: ``log p(y) = z_y / temp - logsumexp(z / temp)`` without materialising
a ``(B, T, V)`` log-softmax. Autograd through ``log_softmax`` (or through ``logits / temp``
followed by ``logsumexp``) would keep a full-vocab copy alive until backward; this keeps only the
``(B, T)`` logsumexp and rebuilds ``softmax`` row-chunk by row-chunk in backward.

``completion_logits`` / ``completion_logps``: the model convention of the loss library
(`CausalLM`: ``model(input_ids=..., attention_mask=...)`` returning ``.logits`` ``(N, L, V)``)
applied to ``[context][completion]`` rows; position ``j`` of the completion is scored by the
logits at the position before it.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from composer_replication.loss._parallel import auto_chunk_size, ordered_map


def _blocks(B: int, T: int, rows: int) -> list[tuple[int, int]]:
    """(batch row, first token) of each block of ``rows`` tokens."""
    return [(b, s) for b in range(B) for s in range(0, T, rows)]


class _Ctx(Protocol):
    saved_tensors: tuple[Tensor, ...]
    temperature: float

    def save_for_backward(self, *tensors: Tensor) -> None: ...


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Ctx, logits: Tensor, index: Tensor, temperature: float) -> Tensor:
        compute_dtype = (
            torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        )
        B, T, V = logits.shape
        rows = auto_chunk_size(V)  # blocks of about 1M logits run on the loss worker threads
        lse = torch.empty((B, T), dtype=compute_dtype, device=logits.device)

        def forward_block(block: tuple[int, int]) -> None:
            b, s = block
            chunk = logits[b, s : s + rows].to(compute_dtype) / temperature
            lse[b, s : s + rows] = torch.logsumexp(chunk, -1)

        ordered_map(forward_block, _blocks(B, T, rows))
        picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1).to(compute_dtype) / temperature
        ctx.save_for_backward(logits, index, lse)
        ctx.temperature = temperature
        # Returned in the compute dtype (fp32 for bf16 logits): log-probs feed exp(ratio) and sums.
        return picked - lse

    @staticmethod
    def backward(ctx: _Ctx, grad_out: Tensor) -> tuple[Tensor | None, None, None]:
        logits, index, lse = ctx.saved_tensors
        temp = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        B, T, V = logits.shape
        rows = auto_chunk_size(V)

        def backward_block(block: tuple[int, int]) -> None:
            b, s = block
            chunk = logits[b, s : s + rows].to(lse.dtype) / temp
            g = grad_out[b, s : s + rows].to(lse.dtype).unsqueeze(-1)
            # d/dz [z_y/temp - lse(z/temp)] = (onehot(y) - softmax(z/temp)) / temp
            gz = torch.exp(chunk - lse[b, s : s + rows].unsqueeze(-1)).mul_(-g)
            gz.scatter_add_(-1, index[b, s : s + rows].unsqueeze(-1), g)
            grad[b, s : s + rows] = gz.div_(temp)

        ordered_map(backward_block, _blocks(B, T, rows))
        return grad, None, None


def selective_log_softmax(logits: Tensor, index: Tensor, temperature: float = 1.0) -> Tensor:
    """``(B, T, V)`` logits, ``(B, T)`` token ids -> ``(B, T)`` log-probs of those ids.

    Logits are divided by ``temperature`` first (TRL's sampling temperature).
    """
    if logits.dim() != 3 or index.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be (B, T, V) and index (B, T); got {tuple(logits.shape)} and {tuple(index.shape)}"
        )
    result: Tensor = _SelectiveLogSoftmax.apply(  # type: ignore[no-untyped-call]
        logits, index.long(), float(temperature)
    )
    return result


class CausalLM(Protocol):
    """A causal LM as the loss library calls it (a Hugging Face ``*ForCausalLM`` is one).

    Called with keyword tensors ``input_ids`` and ``attention_mask`` (``(N, L)``), it returns an
    object whose ``.logits`` is ``(N, L, V)`` (or that tensor itself). With
    ``logits_to_keep=True`` in the functions below it is also passed ``logits_to_keep=k`` (the
    Hugging Face keyword: only the last ``k`` positions' logits are computed).
    """

    def __call__(
        self, *, input_ids: Tensor, attention_mask: Tensor, **kwargs: object
    ) -> object: ...


class HiddenStateLM(Protocol):
    """A causal LM's body (the layers before the output layer), called as `CausalLM` is.

    It returns an object whose ``.last_hidden_state`` is ``(N, L, H)`` (a Hugging Face base
    model, e.g. ``model.base_model`` of a ``*ForCausalLM``; ``past_key_values`` is read from the
    same object when a cache is asked for), or that tensor itself.
    """

    def __call__(
        self, *, input_ids: Tensor, attention_mask: Tensor, **kwargs: object
    ) -> object: ...


class _Output:
    """What `forward_logits` reads: ``.logits`` (here the hidden states) and the cache."""

    def __init__(self, logits: Tensor, past_key_values: object) -> None:
        self.logits = logits
        self.past_key_values = past_key_values


class HiddenStatesAsLogits:
    """A `HiddenStateLM` wrapped so that the logits machinery (`completion_logits`, the shared
    prefix forward) returns its last hidden states ``(N, L, H)`` where it would return logits:
    positions are selected and sliced alike, whatever the last dimension holds."""

    def __init__(self, body: HiddenStateLM) -> None:
        self.body = body

    @property
    def training(self) -> bool:
        return bool(getattr(self.body, "training", False))

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.body, "is_gradient_checkpointing", False))

    def __call__(self, *, input_ids: Tensor, attention_mask: Tensor, **kwargs: object) -> object:
        out = self.body(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = out if isinstance(out, Tensor) else getattr(out, "last_hidden_state", None)
        if not isinstance(hidden, Tensor) or hidden.dim() != 3:
            raise ValueError(
                "the teacher body must return .last_hidden_state of shape (B, L, H) (a Hugging "
                "Face base model, e.g. model.base_model)"
            )
        return _Output(hidden, getattr(out, "past_key_values", None))


def forward_logits(
    model: CausalLM,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    keep: int | None = None,
    logits_to_keep: bool = False,
) -> Tensor:
    """``model(input_ids=..., attention_mask=...).logits`` checked to be ``(N, L, V)``.

    ``keep``: return only the last ``keep`` positions (computed by the model alone when
    ``logits_to_keep`` is True, else sliced from the full logits).
    """
    extra = {"logits_to_keep": keep} if logits_to_keep and keep is not None else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, **extra)
    logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(
            "model(input_ids=..., attention_mask=...) must return .logits of shape (B, L, V)"
        )
    return logits if keep is None else logits[:, -keep:]


def trim_left_padding(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Drop the leading columns that are padding in every row.

    Contexts are left-padded to the longest one of a whole batch; a subset of rows is often
    shorter, and padding costs a full forward. Dropping columns that no row attends to changes
    nothing for a model that ignores masked positions and uses relative positions (RoPE, as the
    Hugging Face causal LMs). When no column is attended to at all, nothing is dropped.
    """
    used = mask.bool().any(0).nonzero()
    start = int(used[0]) if used.numel() else 0
    return ids[:, start:], mask[:, start:]


def cap_context(ids: Tensor, mask: Tensor, cap: int) -> tuple[Tensor, Tensor]:
    """Left-padded ``(N, C)`` contexts with every row cut to at most ``cap`` tokens, from the
    middle: a longer row keeps its first ``cap // 2`` and its last ``cap - cap // 2`` tokens.

    Channel 2's hinted context is ``[chat header][question][hint][closing instruction][generation
    prompt]``; the hint (a sibling's whole solution, the feedback) is what grows. Cutting the
    middle keeps the question's start at the head and, at the tail, the end of the hint and the
    tokens the completion continues from; cutting from the left would drop the question first.
    Rows are re-left-padded to the longest kept length; rows within the cap are unchanged. A
    row's kept tokens get consecutive positions (a model that derives positions from the layout,
    as the Hugging Face causal LMs do, sees the tail right after the head).
    """
    if cap < 1:
        raise ValueError(f"the context cap must be >= 1 token, got {cap}")
    lengths = mask.bool().sum(-1)
    if lengths.numel() == 0 or int(lengths.max()) <= cap:
        return ids, mask
    head = cap // 2
    rows = []
    for row, m in zip(ids, mask.bool()):
        kept = row[m]
        if kept.numel() > cap:
            kept = torch.cat([kept[:head], kept[kept.numel() - (cap - head) :]])
        rows.append(kept)
    width = max(r.numel() for r in rows)
    out_ids = ids.new_zeros((ids.shape[0], width))
    out_mask = mask.new_zeros((ids.shape[0], width))
    for i, kept in enumerate(rows):
        if kept.numel():
            out_ids[i, width - kept.numel() :] = kept
            out_mask[i, width - kept.numel() :] = 1
    return out_ids, out_mask


def completion_logits(
    model: CausalLM,
    context_ids: Tensor,
    context_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    logits_to_keep: bool = False,
) -> Tensor:
    """Raw logits ``(N, T, V)`` scoring each of the ``T`` completion tokens after its context.

    ``context_ids``/``context_mask``: ``(N, C)`` left-padded (``C >= 1``); ``completion_ids`` /
    ``completion_mask``: ``(N, T)`` right-padded. One forward on ``cat(context, completion)``
    with the all-padding leading columns trimmed (`trim_left_padding`); gradient as the caller's
    grad mode. ``logits_to_keep=True`` asks the model for the last ``T + 1`` positions only.
    """
    if context_ids.dim() != 2 or context_mask.shape != context_ids.shape:
        raise ValueError(
            f"context ids and mask must both be (N, C); got {tuple(context_ids.shape)} and "
            f"{tuple(context_mask.shape)}"
        )
    if completion_ids.dim() != 2 or completion_mask.shape != completion_ids.shape:
        raise ValueError(
            f"completion ids and mask must both be (N, T); got {tuple(completion_ids.shape)} and "
            f"{tuple(completion_mask.shape)}"
        )
    if context_ids.shape[0] != completion_ids.shape[0] or context_ids.shape[1] < 1:
        raise ValueError(
            f"context (N, C) = {tuple(context_ids.shape)} and completion (N, T) = "
            f"{tuple(completion_ids.shape)} need the same N and C >= 1"
        )
    T = completion_ids.shape[1]
    ctx_ids, ctx_mask = trim_left_padding(context_ids, context_mask)
    logits = forward_logits(
        model,
        torch.cat([ctx_ids, completion_ids], dim=1),
        torch.cat([ctx_mask, completion_mask.to(ctx_mask.dtype)], dim=1),
        keep=T + 1,
        logits_to_keep=logits_to_keep,
    )
    return logits[:, :-1]


def sequence_logps(logits: Tensor, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Summed and mean (over ``mask``) log-probs, temperature 1, of ``ids`` ``(N, T)`` under
    ``logits`` ``(N, T, V)``: ``(N,)`` each; a row with an empty mask has sum and mean 0."""
    return sequence_sums(selective_log_softmax(logits, ids), mask)


def sequence_sums(per_token: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Summed and mean (over ``mask``) of per-token log-probs ``(N, T)``: ``(N,)`` each; a row
    with an empty mask has sum and mean 0."""
    m = mask.to(per_token.dtype)
    summed = (per_token * m).sum(-1)
    return summed, summed / m.sum(-1).clamp(min=1.0)


def completion_logps(
    model: CausalLM,
    context_ids: Tensor,
    context_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    logits_to_keep: bool = False,
) -> tuple[Tensor, Tensor]:
    """Summed and mean log-probs ``(N,)`` of each completion given its context (temperature 1).

    `completion_logits` then `sequence_logps`: one forward, gradient as the caller's grad mode
    (channel 3's chosen side with gradient; DPO reference log-probs under ``torch.no_grad()``).
    """
    logits = completion_logits(
        model,
        context_ids,
        context_mask,
        completion_ids,
        completion_mask,
        logits_to_keep=logits_to_keep,
    )
    return sequence_logps(logits, completion_ids, completion_mask)
