"""The aggregation rules that merge by the weighted mean: ``mean`` and ``norm_clip``.

- ``mean``: the weighted mean (equal weights: summed in rank order, then divided by the count);
  it does not limit what one contribution can do (`robust` False).
- ``norm_clip``: each contribution first scaled by ``min(1, aggregate_clip_ratio x median norm / norm)``
  (centered-clipping style), then the weighted mean: one contribution moves the result by at
  most ``aggregate_clip_ratio x median norm / n``.

Both add their operands to one `weighted_sum.WeightedSum`, in rank order.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

import torch

from composer_replication.exchange.rules import Operand, RuleSettings, UnscaledRule
from composer_replication.exchange.weighted_sum import WeightedSum

__all__ = ["MeanRule", "NormClipRule", "weighted_mean"]


def weighted_mean(operands: Iterable[Operand]) -> dict[str, torch.Tensor]:
    """The weighted mean of ``operands`` in their order (`WeightedSum`)."""
    total = WeightedSum()
    for op in operands:
        op.add_to(total)
    return total.result()


class MeanRule(UnscaledRule):
    """``mean``: the weighted mean; contributions are never scaled."""

    robust = False

    def combine(self, operands: Iterable[Operand], trim: int) -> dict[str, torch.Tensor]:
        return weighted_mean(operands)


class NormClipRule(MeanRule):
    """``norm_clip``: norms clipped to ``aggregate_clip_ratio`` x the median norm, then the weighted mean."""

    robust = True

    def scales(
        self, norms: Mapping[int, float], settings: RuleSettings
    ) -> tuple[dict[int, float], dict[int, str]]:
        scales: dict[int, float] = {}
        notes: dict[int, str] = {}
        if not norms:
            return scales, notes
        limit = settings.aggregate_clip_ratio * statistics.median(norms.values())
        for rank, norm in norms.items():
            scales[rank] = 1.0 if norm <= limit or norm == 0 else limit / norm
            if scales[rank] < 1.0:
                notes[rank] = f"clipped: norm {norm:.4g} -> {limit:.4g}"
        return scales, notes

    def scale_problem(self, scale: float) -> str | None:
        return None if 0.0 < scale <= 1.0 else "allows only (0, 1]"
