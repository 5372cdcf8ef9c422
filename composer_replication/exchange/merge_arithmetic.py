"""The deterministic float32 arithmetic of a merge, the replay of a commit record, and input
checks.

Every replica runs exactly this arithmetic on exactly the same decoded tensors in the same
order, so every replica gets the same bits:
- ranks in ascending order (the order listed in the commit record);
- the weighted mean (`weighted_sum.WeightedSum`): equal weighting sums left to right, then
  divides by the count; otherwise (token weights, norm_clip scales) ``(c_0 * x_0) + (c_1 * x_1)
  + ...`` with the commit's float coefficients c = weight * scale;
- coordinate-wise rules (`coordinatewise`: trimmed_mean, median): the values of each coordinate
  sorted along the rank axis (a sort is exact), then the kept ones added left to right and
  divided, in chunks of ``CHUNK`` elements so memory stays at n x CHUNK floats per step;
- only elementwise IEEE float32 ops, each rounded on its own: no fused multiply-add and no
  reduction trees whose shape could depend on the CPU or the thread count.

Which of them a merge uses is the aggregation rule's (`rules.get(name).combine`); the operands
it merges are `Decoded` tensors or, replaying a commit record (`average_in_rank_order`), the
stored contributions, streamed through their codec.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from composer_replication.exchange import codecs, rules
from composer_replication.exchange.codec_blocks import Parts
from composer_replication.exchange.vocabulary import CommitRecord, Contribution, dtype_name
from composer_replication.exchange.weighted_sum import WeightedSum

CHUNK = 1 << 20  # elements per coordinate-wise slice (n ranks x 4 MiB of float32)


@dataclass(frozen=True)
class Decoded:
    """An `rules.Operand` of decoded float32 tensors (never written to)."""

    tensors: Mapping[str, torch.Tensor]
    coefficient: float | None = None

    def decode(self) -> Mapping[str, torch.Tensor]:
        return self.tensors

    def add_to(self, total: WeightedSum) -> None:
        total.add(self.tensors, self.coefficient, scratch=False)


def coordinatewise(
    tensors: Sequence[Mapping[str, torch.Tensor]], bounds: Callable[[int], tuple[int, int]]
) -> dict[str, torch.Tensor]:
    """Per coordinate, the mean of the sorted values ``lo..hi`` (inclusive) over the tensors of
    the included ranks (in rank order), where ``lo, hi = bounds(n)`` for ``n`` ranks."""
    n = len(tensors)
    if n == 0:
        raise ValueError("coordinatewise: nothing to merge")
    lo, hi = bounds(n)
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


@dataclass
class _Stored:
    """An `rules.Operand` of a stored contribution: decoded whole, or streamed through its
    codec into the weighted sum (an fp32 payload under equal weights: summed as views)."""

    contribution: Contribution
    coefficient: float | None

    def decode(self) -> Mapping[str, torch.Tensor]:
        return self.contribution.decode()

    def add_to(self, total: WeightedSum) -> None:
        c, coefficient = self.contribution, self.coefficient
        codec = codecs.get(c.codec)
        if codec.zero_copy_decode and coefficient is None:
            # the decoded tensors are views of the payload; one we may overwrite (a privately
            # fetched buffer) saves allocating the accumulator
            total.add(c.decode(), None, scratch=c.private)
            return
        total.next_addend(coefficient)
        for name, shape, parts in c.encoded():  # decode and weight into the accumulator

            def fill(out: torch.Tensor, accumulate: bool, parts: Parts = parts) -> torch.Tensor:
                return codec.decode_into(parts, out, accumulate=accumulate, weight=coefficient)

            total.add_into(name, shape, fill)


def average_in_rank_order(
    commit: CommitRecord, contributions: dict[int, Contribution]
) -> dict[str, torch.Tensor]:
    """name -> float32 merge over ``commit["included_ranks"]`` as the commit says (entries are
    popped as used, so each peer's payload is freed as soon as it has been added).

    ``commit["aggregate"]`` (absent in records of older versions: "mean") names the rule; the
    weighted rules use ``weights`` (and ``scales``), the coordinate-wise ones ``trim``.
    """
    ranks = commit["included_ranks"]
    rule = rules.get(commit.get("aggregate", "mean"))
    scales = commit.get("scales") or {}
    equal = commit.get("weighting", "equal") == "equal" and all(
        scales.get(r, 1.0) == 1.0 for r in ranks
    )

    def operands() -> Iterator[_Stored]:
        for r in ranks:
            coefficient = None if equal else commit["weights"][r] * scales.get(r, 1.0)
            yield _Stored(contributions.pop(r), coefficient)

    return rule.combine(operands(), int(commit.get("trim", 0)))


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
