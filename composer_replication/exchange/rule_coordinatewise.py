"""The coordinate-wise aggregation rules: ``trimmed_mean`` and ``median``.

- ``trimmed_mean``: per coordinate, drop the ``k = min(ceil(aggregate_trim_fraction x n), (n-1)//2)``
  largest and smallest values and average the rest (Yin et al. 2018);
- ``median``: per coordinate, the median (mean of the two middle values for even n).

Both treat the included contributions equally (weights and clip scales do not apply) and merge
through `merge_arithmetic.coordinatewise`: a sort along the rank axis (exact), then the kept values
added left to right and divided.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from composer_replication.exchange.merge_arithmetic import coordinatewise
from composer_replication.exchange.rules import Operand, RuleSettings, UnscaledRule

__all__ = ["MedianRule", "TrimmedMeanRule", "trim_count"]


def trim_count(n: int, trim_fraction: float) -> int:
    """Values dropped at each end per coordinate by trimmed_mean over n candidates."""
    return min(math.ceil(trim_fraction * n), (n - 1) // 2) if n > 0 else 0


class TrimmedMeanRule(UnscaledRule):
    """``trimmed_mean``: the mean of each coordinate's values but the ``trim`` at each end."""

    def trim(self, n: int, settings: RuleSettings) -> int:
        return trim_count(n, settings.aggregate_trim_fraction)

    def combine(self, operands: Iterable[Operand], trim: int) -> dict[str, torch.Tensor]:
        def bounds(n: int) -> tuple[int, int]:
            if not 0 <= 2 * trim < n:
                raise ValueError(f"trimmed_mean: cannot drop {trim} of {n} values at each end")
            return trim, n - 1 - trim

        return coordinatewise([op.decode() for op in operands], bounds)


class MedianRule(UnscaledRule):
    """``median``: each coordinate's middle value (the mean of the two middle ones)."""

    def combine(self, operands: Iterable[Operand], trim: int) -> dict[str, torch.Tensor]:
        def bounds(n: int) -> tuple[int, int]:
            return (n - 1) // 2, n // 2

        return coordinatewise([op.decode() for op in operands], bounds)
