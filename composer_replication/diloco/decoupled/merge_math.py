"""Decoupled DiLoCo's merge math: pure functions of the pushes (what a merge record pins).

- `grace_seconds`: how long the synchronizer waits for stragglers once a quorum has pushed,
  ``gamma * max(0, tau * step - quorum - sync)`` (Douillard et al. 2026);
- `push_weight`: a push's raw merge weight, ``steps`` (``"equal"``) or ``tokens * tokens /
  steps`` (``"tokens"``, the paper's token weighting);
- `aggregate`: screen and merge a round's pushes through the robust-aggregation module
  (`exchange.contribution_screening`, the same aggregation rules as the synchronous exchange,
  `exchange.rules`); `combine_decided`: the merge a recorded decision describes (what a replay
  recomputes);
- `merge_pushes`: what the ``merge`` setting does with the aggregated pushes: keep them
  (``"mean"``) or average their directions instead (``"rda"``: `rda`, radial-directional
  averaging);
- `outer_step`: one outer SGD step with (Nesterov) momentum, elementwise in float32 with
  separately rounded ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from composer_replication.diloco.synchronizer_config import MergeMethod
from composer_replication.exchange import contribution_screening, rules
from composer_replication.exchange.merge_arithmetic import Decoded
from composer_replication.exchange.push_store import Push
from composer_replication.exchange.rule_weighted import weighted_mean

__all__ = [
    "Decision",
    "MergeInput",
    "aggregate",
    "combine_decided",
    "ema",
    "grace_seconds",
    "merge_pushes",
    "outer_step",
    "push_weight",
    "rda",
]

Tensors = dict[str, torch.Tensor]


def grace_seconds(
    gamma: float, tau: float, step_s: float | None, quorum_s: float | None, sync_s: float | None
) -> float:
    """``gamma * max(0, tau * step - quorum - sync)`` (unknown timings count as 0)."""
    return gamma * max(0.0, tau * (step_s or 0.0) - (quorum_s or 0.0) - (sync_s or 0.0))


def ema(old: float | None, sample: float, weight: float) -> float:
    """An exponential moving average: ``sample`` weighted ``weight`` against ``old``."""
    return sample if old is None else (1.0 - weight) * old + weight * sample


@dataclass
class MergeInput:
    """One contribution handed to the aggregation: an id, its raw weight, its tensors."""

    id: str
    weight: float
    tensors: Tensors


def _weighted_mean(inputs: list[MergeInput], names: Iterable[str]) -> Tensors:
    total = sum(i.weight for i in inputs)
    names = list(names)
    return weighted_mean(
        Decoded({n: i.tensors[n].to(torch.float32) for n in names}, i.weight / total)
        for i in inputs
    )


Decision = dict[str, Any]
"""Per input: ``{"included": bool, "reason": str, "weight": float, "scale": float, "note": str}``
(``weight`` sums to 1 over included inputs; ``scale`` < 1 when norm clipping shrank it)."""


def _decision(
    included: bool, reason: str = "", weight: float = 0.0, scale: float = 1.0, note: str = ""
) -> Decision:
    return {"included": included, "reason": reason, "weight": weight, "scale": scale, "note": note}


_POLICY = contribution_screening.AggregatePolicy()


def _policy(
    method: rules.AggregateName, outlier_ratio: float
) -> contribution_screening.AggregatePolicy:
    # the inputs' work weights go in as weight claims (capped at the robust default multiple of
    # the round's median claim); no per-step claim bounds: the work is counted by the learners
    return contribution_screening.AggregatePolicy(
        aggregate=method, weighting="tokens", aggregate_outlier_ratio=outlier_ratio
    )


def aggregate(
    inputs: list[MergeInput],
    method: rules.AggregateName = _POLICY.aggregate,
    *,
    outlier_ratio: float = _POLICY.aggregate_outlier_ratio,
) -> tuple[Tensors, dict[str, Decision]]:
    """Screen and merge ``inputs``: (merged tensors, one `Decision` per input id).

    Inputs without work (weight 0) are refused. Every input is screened by the robust-aggregation
    module (``exchange.contribution_screening``: non-finite values, norm outliers against the
    round's median unless ``outlier_ratio=0``, weight claims capped against the median) and
    ``method`` is any of its merges (mean, trimmed_mean, median, norm_clip). A robust method with
    fewer than ``contribution_screening.MIN_TO_JUDGE`` pushes with work includes none of them. Empty
    tensors: nothing included.
    """
    decisions = {i.id: _decision(False, "no work (weight 0)") for i in inputs if i.weight <= 0}
    work = [i for i in inputs if i.weight > 0]
    if rules.get(method).robust and 0 < len(work) < contribution_screening.MIN_TO_JUDGE:
        # A robust merge of one or two pushes cannot leave anyone out (a trimmed mean of two is
        # their mean): merging them would let a byzantine push through whenever a merge is
        # small (the end of a run, dead learners). Their work is dropped instead.
        why = (
            f"too few pushes for a robust merge "
            f"({len(work)} < {contribution_screening.MIN_TO_JUDGE}; aggregate={method!r})"
        )
        decisions.update({i.id: _decision(False, why) for i in work})
        work = []
    if work:
        policy = _policy(method, outlier_ratio)
        top = max(i.weight for i in work)  # integer claims that keep the ratios to 1e-9
        candidates = [
            contribution_screening.Candidate(
                k, i.tensors, tokens=max(1, round(i.weight / top * 1e9))
            )
            for k, i in enumerate(work)
        ]
        for d in contribution_screening.screen(candidates, policy):
            decisions[work[d.rank].id] = _decision(
                d.included, d.reason, d.weight if d.included else 0.0, d.scale, d.note
            )
    return combine_decided(inputs, decisions, method), decisions


def combine_decided(
    inputs: list[MergeInput], decisions: dict[str, Decision], method: str
) -> Tensors:
    """The merge that ``decisions`` describe (what a replay of a merge record recomputes).

    A pure function of the inputs' tensors and the recorded weights/scales: ``mean`` (and
    ``norm_clip``) is the weighted mean of ``scale * x`` in input order; ``trimmed_mean`` and
    ``median`` are the robust module's coordinate-wise merges. Empty when nothing is included.
    """
    rules.check_rule(method)
    chosen = [i for i in inputs if decisions[i.id]["included"]]
    if not chosen:
        return {}
    candidates = [contribution_screening.Candidate(k, i.tensors) for k, i in enumerate(chosen)]
    verdicts = [
        contribution_screening.Decision(
            rank=k, included=True, weight=decisions[i.id]["weight"], scale=decisions[i.id]["scale"]
        )
        for k, i in enumerate(chosen)
    ]
    merged: Tensors = contribution_screening.combine(
        candidates, verdicts, _policy(method, _POLICY.aggregate_outlier_ratio)
    )
    return merged


def _kept(merged: Tensors, chosen: list[MergeInput], mean_only: Iterable[str]) -> Tensors:
    return merged


def _rda(merged: Tensors, chosen: list[MergeInput], mean_only: Iterable[str]) -> Tensors:
    return rda(chosen, mean_only)


_MERGES: dict[MergeMethod, Callable[[Tensors, list[MergeInput], Iterable[str]], Tensors]] = {
    "mean": _kept,
    "rda": _rda,
}


def merge_pushes(
    method: MergeMethod,
    merged: Tensors,
    inputs: list[MergeInput],
    decisions: dict[str, Decision],
    mean_only: Iterable[str],
) -> Tensors:
    """The ``merge`` setting applied to ``merged`` (the aggregation of ``inputs`` as
    ``decisions`` say): ``"mean"`` keeps it, ``"rda"`` averages the included inputs' directions
    with their decided weights instead (``mean_only`` tensors: their weighted mean). Empty
    when nothing was merged."""
    if not merged:
        return merged
    chosen = [
        MergeInput(i.id, decisions[i.id]["weight"], i.tensors)
        for i in inputs
        if decisions[i.id]["included"]
    ]
    return _MERGES[method](merged, chosen, mean_only)


def rda(inputs: list[MergeInput], mean_only: Iterable[str] = ()) -> Tensors:
    """Radial-directional averaging per tensor: ``(sum w |x| / sum w) * unit(sum w unit(x))``.

    A zero tensor contributes its weight to the norm but no direction; tensors in ``mean_only``
    get the weighted mean. Inputs with weight 0 are ignored.
    """
    accepted = [i for i in inputs if i.weight > 0]
    if not accepted:
        return {}
    names = sorted(accepted[0].tensors)
    plain = set(mean_only)
    out = _weighted_mean(accepted, [n for n in names if n in plain])
    total = sum(i.weight for i in accepted)
    for name in names:
        if name in plain:
            continue
        norm_mean = 0.0
        direction: torch.Tensor | None = None
        for i in accepted:
            x = i.tensors[name].to(torch.float32)
            n = float(torch.linalg.vector_norm(x.double()))
            norm_mean += i.weight * n / total
            unit = x * (1.0 / n) if n > 0 else torch.zeros_like(x)
            term = unit * (i.weight / total)
            direction = term if direction is None else direction.add(term)
        assert direction is not None
        dn = float(torch.linalg.vector_norm(direction.double()))
        out[name] = direction * (norm_mean / dn) if dn > 0 else torch.zeros_like(direction)
    return out


def outer_step(
    params: Tensors, momentum: Tensors, grad: Tensors, *, lr: float, mu: float, nesterov: bool
) -> tuple[Tensors, Tensors]:
    """One outer SGD step (torch.optim.SGD semantics, dampening 0), returning new tensors:

    ``m = mu * m + g``; ``update = g + mu * m`` (Nesterov) or ``m``; ``theta = theta - lr * update``.
    """
    new_p: Tensors = {}
    new_m: Tensors = {}
    for name, theta in params.items():
        g = grad[name].to(torch.float32)
        m = momentum.get(name)
        m = g.clone() if m is None else m.to(torch.float32).mul(mu).add(g)
        update = g.add(m.mul(mu)) if nesterov else m
        new_p[name] = theta.to(torch.float32).sub(update.mul(lr))
        new_m[name] = m
    return new_p, new_m


def push_weight(push: Push, weighting: str) -> float:
    """The raw merge weight of a push: 0 without work; ``steps`` (``"equal"``: equal per step)
    or ``tokens * tokens / steps`` (``"tokens"``: tokens times tokens per step)."""
    if push.steps <= 0:
        return 0.0
    if weighting == "tokens":
        tokens = float(push.tokens or 0)
        return tokens * tokens / push.steps
    return float(push.steps)
