"""The weighted mean of a merge, written once: `WeightedSum` accumulates float32 tensors in
the order they are added.

Every weighted merge of the package goes through it (the synchronous exchange's replay of a commit
record, `contribution_screening.combine`, the decoupled synchronizer's merges and RDA's mean-only
tensors), so every replica that adds the same tensors in the same order gets the same bits:

- equal weighting (every coefficient None): ``x_0 + x_1 + ...`` summed left to right, then
  divided by the count;
- otherwise ``(c_0 * x_0) + (c_1 * x_1) + ...`` with the float coefficients ``c``;
- only elementwise IEEE float32 ops, each rounded on its own: no fused multiply-add and no
  reduction trees whose shape could depend on the CPU or the thread count.

The first addend of a name is held as it is (it may view a peer's payload: it is never written
to) and summed with the second in one pass; a single addend is copied at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["Fill", "WeightedSum"]

Fill = Callable[[torch.Tensor, bool], object]
"""``fill(out, accumulate)``: write (``accumulate`` False) or add (True) one addend, already
weighted, into ``out``, a flat contiguous float32 tensor (a codec's streaming ``decode_into``)."""


class WeightedSum:
    """A name -> float32 sum of weighted tensors (see the module docstring)."""

    def __init__(self) -> None:
        self._acc: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}  # first addend, summed with the second
        self._equal = True
        self._count = 0

    def add(
        self, tensors: Mapping[str, torch.Tensor], coefficient: float | None, scratch: bool
    ) -> None:
        """Add ``coefficient * tensors`` (None: equal weighting, divided by the count at the
        end). ``scratch``: the tensors may be overwritten (a privately fetched buffer), which
        saves allocating the accumulator."""
        self._note(coefficient)
        scratch = scratch or coefficient is not None  # a weighted product is a fresh tensor
        for name, x in tensors.items():
            x = x if coefficient is None else x * coefficient
            if name in self._acc:
                self._acc[name].add_(x)
            elif name in self._pending:
                first = self._pending.pop(name)
                self._acc[name] = torch.add(first, x, out=x) if scratch else first + x
            else:
                self._pending[name] = x  # may view a peer's payload: never written to

    def add_into(self, name: str, shape: Sequence[int], fill: Fill) -> None:
        """Add one tensor of an addend counted by `next_addend`, streamed into the accumulator
        by ``fill`` (already weighted)."""
        if name in self._pending:  # a held first addend (mixed codecs): start from a copy
            self._acc[name] = self._pending.pop(name).clone()
        fresh = name not in self._acc
        if fresh:
            self._acc[name] = torch.empty(shape, dtype=torch.float32)
        fill(self._acc[name].view(-1), not fresh)

    def next_addend(self, coefficient: float | None) -> None:
        """Count one addend whose tensors go in through `add_into` (``coefficient``, already
        applied by its ``fill``, says whether the sum is divided by the count at the end)."""
        self._note(coefficient)

    def _note(self, coefficient: float | None) -> None:
        self._equal = coefficient is None
        self._count += 1

    def result(self) -> dict[str, torch.Tensor]:
        """name -> the float32 sum (equal weighting: divided by the number of addends)."""
        acc = self._acc
        for name, x in self._pending.items():  # a single addend
            acc[name] = x.clone()
        self._pending = {}
        if self._equal:
            for a in acc.values():
                a.div_(self._count)
        return acc
