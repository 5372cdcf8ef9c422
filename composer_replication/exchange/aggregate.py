"""The deterministic float32 average of a step's committed contributions, and input checks.

Every replica runs exactly this arithmetic on exactly the same decoded tensors in the same
order, so every replica gets the same bits:
- ranks in ascending order (the order listed in the commit record);
- equal weighting: x_0 + x_1 + ... summed left to right, then divided by the count;
  token weighting: (w_0 * x_0) + (w_1 * x_1) + ... with the commit's float weights;
- only elementwise IEEE float32 ops, each rounded on its own: no fused multiply-add and no
  reduction trees whose shape could depend on the CPU or the thread count.
"""

from __future__ import annotations

from typing import Any

import torch

from composer_replication.exchange import codecs
from composer_replication.exchange.protocol import Contribution, dtype_name


def average_in_rank_order(
    commit: dict[str, Any], contributions: dict[int, Contribution]
) -> dict[str, torch.Tensor]:
    """name -> float32 average over ``commit["included_ranks"]`` (entries are popped as used,
    so each peer's payload is freed as soon as it has been added)."""
    ranks = commit["included_ranks"]
    equal = commit.get("weighting", "equal") == "equal"
    acc: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}  # first addend, summed with the second in one pass
    for r in ranks:
        c = contributions.pop(r)
        w = commit["weights"][r]
        if c.codec != "fp32" or not equal:  # decode and weight into the accumulator, streaming
            for name, shape, parts in c.encoded():
                if name in pending:  # an fp32 first addend (mixed codecs): start from a copy
                    acc[name] = pending.pop(name).clone()
                fresh = name not in acc
                if fresh:
                    acc[name] = torch.empty(shape, dtype=torch.float32)
                codecs.decode_into(
                    parts, c.codec, acc[name].view(-1), accumulate=not fresh,
                    weight=None if equal else w,
                )  # fmt: skip
            del c
            continue
        # fp32, equal weights: the decoded tensors are views of the payload; one we may
        # overwrite (a privately fetched buffer) saves allocating the accumulator
        for name, x in c.decode().items():
            if name in acc:
                acc[name].add_(x)
            elif name in pending:
                first = pending.pop(name)
                acc[name] = torch.add(first, x, out=x) if c.private else first + x
            else:
                pending[name] = x  # may view a peer's payload: never written to
        del c
    for name, x in pending.items():  # a single included contribution
        acc[name] = x.clone()
    if equal:
        for a in acc.values():
            a.div_(len(ranks))
    return acc


def check_inputs(tensors: Any, step: Any, tokens: Any, inner_steps: Any, weighting: str) -> None:
    """ValueError for anything ``allreduce`` cannot exchange (before any I/O)."""
    if not isinstance(tensors, dict) or not tensors:
        raise ValueError("allreduce expects a non-empty dict[str, torch.Tensor]")
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"allreduce: entry {name!r} is not a (str, Tensor) pair")
        dtype_name(t.dtype)  # raises ValueError for non-floating dtypes
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**10:
        raise ValueError(f"step must be an int in [0, 1e10), got {step!r}")
    for label, v in (("tokens", tokens), ("inner_steps", inner_steps)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"{label} must be a non-negative int or None, got {v!r}")
    if weighting == "tokens" and tokens is None:
        raise ValueError("weighting='tokens' needs allreduce(..., tokens=<tokens this round>)")
