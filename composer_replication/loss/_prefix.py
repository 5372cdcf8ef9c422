"""Completion logits with shared context prefixes computed once (channel 2's teacher forward).

The hinted teacher contexts of one prompt group's failed rollouts begin with the same tokens:
the chat template, the question, the hint template's opening and the same successful sibling's
solution; only the per-rollout feedback and the rollout's own completion differ. Scoring every
row over its whole context repeats the forward over that prefix once per row.

`shared_prefix_completion_logits` gives the same ``(N, T, V)`` logits as
``_logprobs.completion_logits`` with two forwards instead of one:

1. rows are grouped by common token prefix (rows sorted by their context tokens; the partition
   into runs of adjacent rows that saves the most tokens, `plan_groups`); each group's prefix
   (at most its shortest context minus one token, so every row keeps a suffix) is one row of a
   left-padded *prefix batch*, run once with the model's key/value cache on;
2. the cache is expanded to the rows (``Cache.reorder_cache`` with each row's group index) and
   the *suffix batch* (``[pad][rest of the context][completion]``) runs on top of it, with
   explicit position ids (a row's tokens keep the positions they have in its own unpadded
   sequence) and the attention mask ``[prefix mask of its group][suffix mask]``.

Attention sees exactly the same keys and values as in the unshared forward, so the result equals
it up to float rounding (different matmul shapes; tests/loss/test_loss_prefix_sharing.py pins
it against the unshared forward on a real Qwen2 model).

It needs a Hugging Face causal LM (``position_ids``, ``past_key_values``, ``use_cache`` keywords
and a returned ``past_key_values`` supporting ``reorder_cache`` and ``get_seq_length``). It
returns None, and the caller runs the unshared forward, when sharing would not save at least
10% of the padded batch's tokens (`MAX_SHARED_FRACTION`), the context mask is not left-padded, or the model did not fill its cache
(e.g. gradient checkpointing in training mode drops it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeGuard, runtime_checkable

import torch
from torch import Tensor

from composer_replication.loss._logprobs import CausalLM, forward_logits

# Share only when the two padded batches hold at most this fraction of the unshared batch's
# tokens: the second forward call has a fixed cost (every layer's kernels once more), so a
# saving of a few tokens (e.g. only the chat header in common) is not worth it.
MAX_SHARED_FRACTION = 0.9


@dataclass(frozen=True)
class PrefixPlan:
    """Which rows share which prefix: ``group[i]`` (a row's group) and ``prefix[g]`` (length)."""

    group: list[int]
    prefix: list[int]

    def padded_tokens(self, lengths: list[int], completion: int) -> int:
        """Tokens of the two padded batches: G x max prefix + N x (max rest + completion)."""
        rest = max(n - self.prefix[g] for n, g in zip(lengths, self.group))
        return len(self.prefix) * max(self.prefix) + len(lengths) * (rest + completion)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_groups(contexts: list[list[int]]) -> PrefixPlan:
    """Partition the rows into groups sharing a token prefix, saving the most tokens.

    Rows are sorted by their tokens; a group is a run of adjacent sorted rows and its prefix is
    the shortest common prefix of the run, capped at each member's length minus one (a row's
    last context token stays in the suffix, so its logits score the first completion token).
    Among all partitions into runs, the one maximising ``sum (size - 1) * prefix`` (tokens not
    recomputed) is chosen by dynamic programming (N is a micro-batch's row count). A row alone in
    its group puts as much of its context into the prefix batch as the longest shared prefix
    allows (that shortens the suffix batch at no cost).
    """
    n = len(contexts)
    if n == 0:
        raise ValueError("plan_groups needs at least one context")
    if any(len(c) < 1 for c in contexts):
        raise ValueError("every context needs at least one token")
    order = sorted(range(n), key=lambda i: contexts[i])
    adjacent = [_common(contexts[order[k]], contexts[order[k + 1]]) for k in range(n - 1)]

    length = [len(contexts[i]) for i in order]

    def shared(i: int, j: int) -> int:  # prefix of sorted rows i..j (inclusive), i < j
        return min(min(adjacent[i:j]), min(length[i : j + 1]) - 1)

    best = [0] * (n + 1)  # best[j]: tokens saved by the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], j - 1
        p = length[j - 1] - 1  # running prefix of the run i..j-1, widened leftwards
        for i in range(j - 2, -1, -1):
            p = min(p, adjacent[i], length[i] - 1)
            if p <= 0:
                break
            saved = best[i] + (j - 1 - i) * p
            if saved > best[j]:
                best[j], cut[j] = saved, i
    runs: list[tuple[int, int]] = []
    j = n
    while j > 0:
        runs.append((cut[j], j))
        j = cut[j]
    runs.reverse()
    group = [0] * n
    prefix: list[int] = []
    for g, (i, j) in enumerate(runs):
        for k in range(i, j):
            group[order[k]] = g
        prefix.append(shared(i, j - 1) if j - i > 1 else 0)
    longest = max(prefix)
    for g, (i, j) in enumerate(runs):
        if j - i == 1:
            prefix[g] = min(longest, len(contexts[order[i]]) - 1)
    return PrefixPlan(group=group, prefix=prefix)


def _left_padded_rows(ids: Tensor, mask: Tensor) -> list[list[int]] | None:
    """Each row's attended tokens, or None unless every row is ``[0...0][1...1]``."""
    m = mask.bool()
    lengths = m.sum(-1)
    width = m.shape[1]
    expected = torch.arange(width, device=m.device)[None, :] >= (width - lengths)[:, None]
    if not bool((m == expected).all()):
        return None
    return [row[width - int(k) :].tolist() for row, k in zip(ids, lengths)]


@runtime_checkable
class KVCache(Protocol):
    """The part of a Hugging Face ``Cache`` the shared prefix uses."""

    def reorder_cache(self, beam_idx: Tensor) -> None: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def __len__(self) -> int: ...


def _filled(cache: object, length: int) -> TypeGuard[KVCache]:
    """Whether the returned cache holds ``length`` positions in every layer."""
    if not isinstance(cache, KVCache):
        return False
    try:
        layers = len(cache)
        return layers > 0 and all(cache.get_seq_length(i) == length for i in range(layers))
    except (TypeError, AttributeError, IndexError):
        return False


def shared_prefix_completion_logits(
    model: CausalLM,
    context_ids: Tensor,
    context_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    logits_to_keep: bool = False,
) -> Tensor | None:
    """``completion_logits`` with shared context prefixes run once, or None (see module doc).

    Shapes as ``completion_logits``: ``(N, C)`` left-padded contexts, ``(N, T)`` right-padded
    completions; returns ``(N, T, V)``. Call it under ``torch.no_grad()`` (channel 2's teacher):
    the prefix batch's cache is shared by several rows.
    """
    if getattr(model, "is_gradient_checkpointing", False) and getattr(model, "training", False):
        return None  # Hugging Face layers drop the cache then: do not waste the prefix forward
    contexts = _left_padded_rows(context_ids, context_mask)
    if contexts is None or any(len(c) == 0 for c in contexts) or len(contexts) < 2:
        return None
    N, T = completion_ids.shape
    plan = plan_groups(contexts)
    lengths = [len(c) for c in contexts]
    if plan.padded_tokens(lengths, T) > MAX_SHARED_FRACTION * N * (max(lengths) + T):
        return None
    device, dtype = context_ids.device, context_ids.dtype
    pad = int(context_ids[0, 0]) if not bool(context_mask[0, 0]) else 0
    G, P = len(plan.prefix), max(plan.prefix)
    prefix_ids = torch.full((G, P), pad, dtype=dtype, device=device)
    prefix_mask = torch.zeros((G, P), dtype=context_mask.dtype, device=device)
    for g, p in enumerate(plan.prefix):
        row = plan.group.index(g)
        if p:
            prefix_ids[g, P - p :] = context_ids.new_tensor(contexts[row][:p])
            prefix_mask[g, P - p :] = 1
    positions = (prefix_mask.long().cumsum(-1) - 1).clamp(min=0)
    extra = {"logits_to_keep": 1} if logits_to_keep else {}
    out = model(
        input_ids=prefix_ids,
        attention_mask=prefix_mask,
        position_ids=positions,
        use_cache=True,
        **extra,
    )
    cache = getattr(out, "past_key_values", None)
    if not _filled(cache, P):
        return None
    group = torch.tensor(plan.group, dtype=torch.long, device=device)
    cache.reorder_cache(group)
    rests = [c[plan.prefix[g] :] for c, g in zip(contexts, plan.group)]
    S = max(len(r) for r in rests)
    rest_ids = torch.full((N, S), pad, dtype=dtype, device=device)
    rest_mask = torch.zeros((N, S), dtype=context_mask.dtype, device=device)
    for i, r in enumerate(rests):
        rest_ids[i, S - len(r) :] = context_ids.new_tensor(r)
        rest_mask[i, S - len(r) :] = 1
    suffix_ids = torch.cat([rest_ids, completion_ids.to(dtype)], dim=1)
    suffix_mask = torch.cat([rest_mask, completion_mask.to(rest_mask.dtype)], dim=1)
    starts = torch.tensor([plan.prefix[g] for g in plan.group], dtype=torch.long, device=device)
    counted = torch.cat([rest_mask.long(), torch.ones_like(completion_ids, dtype=torch.long)], 1)
    suffix_positions = starts[:, None] + (counted.cumsum(-1) - 1).clamp(min=0)
    logits = forward_logits(
        _WithCache(model, cache, suffix_positions),
        suffix_ids,
        torch.cat([prefix_mask.index_select(0, group), suffix_mask], dim=1),
        keep=T + 1,
        logits_to_keep=logits_to_keep,
    )
    return logits[:, :-1]


class _WithCache:
    """The model called on the suffix batch, on top of the expanded prefix cache."""

    def __init__(self, model: CausalLM, cache: KVCache, positions: Tensor) -> None:
        self.model, self.cache, self.positions = model, cache, positions

    def __call__(self, *, input_ids: Tensor, attention_mask: Tensor, **kwargs: object) -> object:
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
