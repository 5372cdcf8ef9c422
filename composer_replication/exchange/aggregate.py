"""The deterministic float32 arithmetic of a merge, and input checks.

Every replica runs exactly this arithmetic on exactly the same decoded tensors in the same
order, so every replica gets the same bits:
- ranks in ascending order (the order listed in the commit record);
- equal weighting: x_0 + x_1 + ... summed left to right, then divided by the count;
  otherwise (token weights, norm_clip scales): (c_0 * x_0) + (c_1 * x_1) + ... with the
  commit's float coefficients c = weight * scale;
- coordinate-wise methods (trimmed_mean, median): the values of each coordinate sorted along the
  rank axis (a sort is exact), then the kept ones added left to right and divided, in chunks of
  ``CHUNK`` elements so memory stays at n x CHUNK floats per step;
- only elementwise IEEE float32 ops, each rounded on its own: no fused multiply-add and no
  reduction trees whose shape could depend on the CPU or the thread count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from composer_replication.exchange import codecs
from composer_replication.exchange.vocabulary import CommitRecord, Contribution, dtype_name

CHUNK = 1 << 20  # elements per coordinate-wise slice (n ranks x 4 MiB of float32)


def weighted_average(
    items: Iterable[tuple[Mapping[str, torch.Tensor], float | None, bool]], count: int
) -> dict[str, torch.Tensor]:
    """name -> float32 sum of ``coefficient * tensors`` over ``items`` (in order).

    Each item is (tensors, coefficient, scratch): coefficient None for every item means equal
    weighting (sum, then divide by ``count``); ``scratch`` says the tensors may be overwritten
    (a privately fetched buffer), which saves allocating the accumulator.
    """
    acc: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}  # first addend, summed with the second in one pass
    equal = True
    for tensors, coefficient, private in items:
        equal = coefficient is None
        scratch = not equal or private
        for name, x in tensors.items():
            x = x if coefficient is None else x * coefficient
            if name in acc:
                acc[name].add_(x)
            elif name in pending:
                first = pending.pop(name)
                acc[name] = torch.add(first, x, out=x) if scratch else first + x
            else:
                pending[name] = x  # may view a peer's payload: never written to
    for name, x in pending.items():  # a single item
        acc[name] = x.clone()
    if equal:
        for a in acc.values():
            a.div_(count)
    return acc


def coordinatewise(
    tensors: Sequence[Mapping[str, torch.Tensor]], method: str, trim: int = 0
) -> dict[str, torch.Tensor]:
    """Per-coordinate ``"median"`` or ``"trimmed_mean"`` (dropping ``trim`` values at each end)
    over the tensors of the included ranks (in rank order)."""
    n = len(tensors)
    if n == 0:
        raise ValueError("coordinatewise: nothing to merge")
    if method == "median":
        lo, hi = (n - 1) // 2, n // 2  # the middle value, or the two middle values
    elif method == "trimmed_mean":
        if not 0 <= 2 * trim < n:
            raise ValueError(f"trimmed_mean: cannot drop {trim} of {n} values at each end")
        lo, hi = trim, n - 1 - trim
    else:
        raise ValueError(f"coordinatewise: unknown method {method!r}")
    out: dict[str, torch.Tensor] = {}
    for name, ref in tensors[0].items():
        flat = [t[name].reshape(-1) for t in tensors]
        result = torch.empty(ref.numel(), dtype=torch.float32)
        for start in range(0, ref.numel(), CHUNK):
            end = min(start + CHUNK, ref.numel())
            stacked = torch.stack([f[start:end].to(torch.float32) for f in flat])
            ordered = torch.sort(stacked, dim=0, stable=True).values
            acc = ordered[lo].clone()
            for i in range(lo + 1, hi + 1):
                acc.add_(ordered[i])
            if hi > lo:
                acc.div_(hi - lo + 1)
            result[start:end] = acc
        out[name] = result.view(ref.shape)
    return out


def average_in_rank_order(
    commit: CommitRecord, contributions: dict[int, Contribution]
) -> dict[str, torch.Tensor]:
    """name -> float32 merge over ``commit["included_ranks"]`` as the commit says (entries are
    popped as used, so each peer's payload is freed as soon as it has been added).

    ``commit["aggregate"]`` (absent in records of older versions: "mean") picks the method;
    mean/norm_clip use ``weights`` (and ``scales``), trimmed_mean/median ``trim``.
    """
    ranks = commit["included_ranks"]
    method = commit.get("aggregate", "mean")
    if method in ("trimmed_mean", "median"):
        decoded = [contributions.pop(r).decode() for r in ranks]
        return coordinatewise(decoded, method, int(commit.get("trim", 0)))
    scales = commit.get("scales") or {}
    equal = commit.get("weighting", "equal") == "equal" and all(
        scales.get(r, 1.0) == 1.0 for r in ranks
    )
    acc: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}  # first fp32 addend, summed with the second in one pass
    for r in ranks:
        c = contributions.pop(r)
        coefficient = None if equal else commit["weights"][r] * scales.get(r, 1.0)
        codec = codecs.get(c.codec)
        if not codec.zero_copy_decode or not equal:  # decode and weight into the accumulator
            for name, shape, parts in c.encoded():
                if name in pending:  # a zero-copy first addend (mixed codecs): start from a copy
                    acc[name] = pending.pop(name).clone()
                fresh = name not in acc
                if fresh:
                    acc[name] = torch.empty(shape, dtype=torch.float32)
                codec.decode_into(
                    parts, acc[name].view(-1), accumulate=not fresh, weight=coefficient
                )
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


def check_inputs(
    tensors: object, step: object, tokens: object, inner_steps: object, weighting: str
) -> None:
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
