"""Robust aggregation: screen a round's contributions, then merge the ones that pass.

Pure functions over plain values, shared by the synchronous exchange (`ObjectStoreAllReduce`,
whose committer screens and records the decisions in the commit record) and the decoupled
synchronizer::

    merged, decisions = merge(candidates, policy)          # screen + combine in one call
    decisions = screen(candidates, policy)                 # who is in, with which weight/scale
    merged = combine(candidates, decisions, policy)        # the deterministic arithmetic

A `Candidate` is one contribution: its rank, its decoded float32 tensors and its claims (tokens
and inner steps trained). A `Decision` says, per rank, whether it is included and why not, its
final weight, and its clip scale. `screen` runs, in this order (every rejection names the rank
and the reason; a candidate rejected by one check is not looked at by the next):

1. claims (``weighting = "tokens"``): no token count; more inner steps than ``max_inner_steps``;
   more tokens than ``inner_steps x max_tokens_per_step`` (a claim the rank's work cannot
   explain). Accepted claims above ``aggregate_token_cap`` x the round's median claim are capped there.
2. non-finite values (NaN, +-inf) anywhere.
3. norm outliers: an L2 norm above ``aggregate_outlier_ratio`` x the median norm of the candidates still
   in (needs 3 or more of them: with two, the median cannot tell which one is the outlier).
4. (``screen = "loss"``) the loss change the candidate alone causes on a held-out batch, as the
   caller's ``loss_probe`` measures it: rejected when it raises the loss by more than
   ``screen_loss_tolerance`` x ``|baseline loss|`` (Templar-style validation of untrusted peers).

Then `combine` merges the included candidates with the aggregation rule ``policy.aggregate``
names (`rules`: ``mean``, ``norm_clip``, ``trimmed_mean``, ``median``; each rule's module
states its arithmetic). The rule also gives the clip scales `screen` records (``norm_clip``)
and the trim a commit record carries (``trimmed_mean``).

Every merge is a pure function of the candidates' bytes and the decisions: elementwise float32
IEEE ops in ascending rank order, sorts along the rank axis, no reduction trees, so replicas that
merge the same inputs get the same bits. Norms and the loss probe are not bit-reproducible across
machines; in the synchronous exchange only the committer evaluates them, and everybody else
reads the resulting decisions from the commit record.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

import torch

from composer_replication.exchange import rules
from composer_replication.exchange.merge_arithmetic import Decoded
from composer_replication.exchange.rule_coordinatewise import trim_count
from composer_replication.exchange.rules import AggregateName

__all__ = [
    "SCREENS",
    "WEIGHTINGS",
    "AggregateName",
    "ScreenName",
    "WeightingName",
    "AggregatePolicy",
    "Candidate",
    "Decision",
    "LossProbe",
    "MIN_TO_JUDGE",
    "TensorStats",
    "combine",
    "included",
    "merge",
    "norm_outlier",
    "screen",
    "screen_state",
    "tensor_stats",
    "merge_weights",
    "trim_count",
]

ScreenName = Literal["none", "loss"]
WeightingName = Literal["equal", "tokens"]
SCREENS: tuple[ScreenName, ...] = get_args(ScreenName)
WEIGHTINGS: tuple[WeightingName, ...] = get_args(WeightingName)


LossProbe = Callable[[Mapping[str, torch.Tensor]], float]
"""The held-out loss after applying ``candidate`` alone (the caller decides how: for DiLoCo a
plain outer step ``global - outer_lr * candidate``); ``zeros`` gives the baseline."""


# Fewest contributions among which an outlier can be told apart (with two, the median cannot
# tell which one is the outlier, and a trimmed mean trims nothing).
MIN_TO_JUDGE = 3


@dataclass(frozen=True)
class AggregatePolicy:
    """How a round's contributions are screened and merged (defaults documented in
    docs/object-store.md). Its fields are the `[diloco] aggregate*` / ``screen*`` keys under
    their names (`settings.ExchangeConfig` takes its defaults from here), plus the run's claim
    bounds."""

    aggregate: AggregateName = "mean"  # an aggregation rule's name (exchange.rules)
    weighting: WeightingName = "equal"
    aggregate_outlier_ratio: float = 10.0  # reject norm > ratio x median norm; 0 = no screening
    aggregate_trim_fraction: float = 0.25  # trimmed_mean: fraction dropped at EACH end
    aggregate_clip_ratio: float = 1.0  # norm_clip: clip every norm to ratio x median norm
    aggregate_token_cap: float = 4.0  # cap token claims at cap x median claim; 0 = no cap
    max_tokens_per_step: int | None = None  # claim check (tokens); None = unchecked
    max_inner_steps: int | None = None  # claim check (inner steps); None = unchecked
    screen: ScreenName = "none"  # "loss": also score candidates with a LossProbe
    screen_loss_tolerance: float = 0.05  # screen="loss": reject a rise > tol x |baseline|

    def __post_init__(self) -> None:
        _choice("aggregate", self.aggregate, rules.names())
        _choice("weighting", self.weighting, WEIGHTINGS)
        _choice("screen", self.screen, SCREENS)
        for name in ("aggregate_outlier_ratio", "aggregate_token_cap", "screen_loss_tolerance"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        ratio, cap = self.aggregate_outlier_ratio, self.aggregate_token_cap
        if ratio and ratio <= 1:
            raise ValueError(
                f"aggregate_outlier_ratio must be > 1 (a multiple of the median norm) or 0 to "
                f"turn norm screening off, got {ratio!r}"
            )
        if cap and cap < 1:
            raise ValueError(f"aggregate_token_cap must be >= 1 or 0 (no cap), got {cap!r}")
        if not 0 <= self.aggregate_trim_fraction < 0.5:
            raise ValueError(
                f"aggregate_trim_fraction must be in [0, 0.5), got {self.aggregate_trim_fraction!r}"
            )
        if not (math.isfinite(self.aggregate_clip_ratio) and self.aggregate_clip_ratio > 0):
            raise ValueError(
                f"aggregate_clip_ratio must be a finite number > 0, got "
                f"{self.aggregate_clip_ratio!r}"
            )
        for name in ("max_tokens_per_step", "max_inner_steps"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class TensorStats:
    """What screening needs of a contribution: its L2 norm and its first non-finite tensor."""

    norm: float
    nonfinite: str | None = None  # "'layer.weight': 3 of 30 values are NaN/inf", or None


_STATS_CHUNK = 1 << 22  # elements per slice: float64 temporaries stay at 32 MiB


def tensor_stats(tensors: Mapping[str, torch.Tensor]) -> TensorStats:
    """L2 norm over all tensors (per-slice norms summed in float64; a slice is re-read in float64
    only if its float32 norm overflows) and where non-finite values are."""
    total = 0.0
    for name in sorted(tensors):
        flat = tensors[name].reshape(-1)
        for start in range(0, flat.numel(), _STATS_CHUNK):
            part = flat[start : start + _STATS_CHUNK]
            # one fast float32 pass; a NaN/inf value makes it non-finite, and only then (or
            # when squares overflow float32, values above ~1e19) is the slice looked at again
            norm = float(torch.linalg.vector_norm(part.float()))
            if not math.isfinite(norm):
                if not bool(torch.isfinite(part).all()):
                    bad = int(flat.numel() - int(torch.isfinite(flat).sum()))
                    what = f"{name!r}: {bad} of {flat.numel()} values are NaN/inf"
                    return TensorStats(math.nan, what)
                norm = float(torch.linalg.vector_norm(part, dtype=torch.float64))
            total += norm**2
    norm = math.sqrt(total)
    if not math.isfinite(norm):  # finite values whose squares overflow float64
        return TensorStats(norm, f"L2 norm overflows float64 ({norm})")
    return TensorStats(norm)


@dataclass
class Candidate:
    """One contribution to merge: ``tensors`` (decoded float32, may be None when ``stats`` is
    given and no loss probe or merge needs them) and the claims that come with it."""

    rank: int
    tensors: Mapping[str, torch.Tensor] | None
    tokens: int | None = None
    inner_steps: int | None = None
    stats: TensorStats | None = None

    def get_stats(self) -> TensorStats:
        if self.stats is None:
            if self.tensors is None:
                raise ValueError(f"candidate of rank {self.rank} has neither tensors nor stats")
            self.stats = tensor_stats(self.tensors)
        return self.stats


@dataclass
class Decision:
    """The verdict on one rank. ``weight`` (sum 1 over included ranks) and ``scale`` (norm_clip,
    else 1.0) are what `combine` uses; ``reason`` says why a rank is out ("" if in), ``note``
    what was done to an included one (clipped, claim capped)."""

    rank: int
    included: bool
    reason: str = ""
    weight: float = 0.0
    scale: float = 1.0
    norm: float | None = None
    loss_delta: float | None = None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("norm", "loss_delta"):  # JSON has no NaN/inf
            v = out[key]
            out[key] = v if v is None or math.isfinite(v) else None
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Decision:
        return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj})


@dataclass
class _Work:
    """Screening state of the round: who is still in, and why the others are not."""

    candidates: dict[int, Candidate]
    out: dict[int, str] = field(default_factory=dict)

    def alive(self) -> list[Candidate]:
        return [c for r, c in sorted(self.candidates.items()) if r not in self.out]


def screen(
    candidates: Sequence[Candidate],
    policy: AggregatePolicy,
    *,
    loss_probe: LossProbe | None = None,
) -> list[Decision]:
    """Decide, per candidate (sorted by rank), whether it is merged (see the module docstring)."""
    ranks = [c.rank for c in candidates]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"screen: duplicate ranks in {sorted(ranks)}")
    if policy.screen == "loss" and loss_probe is None:
        raise ValueError("screen='loss' needs a loss_probe (the run passes one)")
    work = _Work({c.rank: c for c in candidates})
    _check_claims(work, policy)
    for c in work.alive():
        why = c.get_stats().nonfinite
        if why is not None:
            work.out[c.rank] = f"non-finite values ({why})"
    _check_norms(work, policy)
    deltas = _check_loss(work, policy, loss_probe) if policy.screen == "loss" else {}
    return _decide(work, policy, deltas)


def _check_claims(work: _Work, policy: AggregatePolicy) -> None:
    if policy.weighting != "tokens":
        return
    for c in work.alive():
        steps = c.inner_steps
        if c.tokens is None:
            work.out[c.rank] = "no token count for weighting='tokens'"
        elif (
            policy.max_inner_steps is not None
            and steps is not None
            and (steps > policy.max_inner_steps)
        ):
            work.out[c.rank] = (
                f"inconsistent claim: {steps} inner steps, at most {policy.max_inner_steps} "
                "per round"
            )
        elif policy.max_tokens_per_step is not None:
            bound_steps = steps if steps is not None else policy.max_inner_steps
            if bound_steps is None:
                continue
            limit = bound_steps * policy.max_tokens_per_step
            if c.tokens > limit:
                work.out[c.rank] = (
                    f"inconsistent claim: {c.tokens} tokens, but {bound_steps} inner steps x "
                    f"{policy.max_tokens_per_step} tokens per step allow at most {limit}"
                )


def norm_outlier(
    norm: float, reference: Sequence[float], ratio: float, *, against: str = "the round's"
) -> str | None:
    """The one norm-outlier rule: why ``norm`` is an outlier (above ``ratio x`` the median of
    ``reference``), or None. Judged only with ``ratio`` set and at least `MIN_TO_JUDGE`
    reference norms (fewer cannot tell which one is the outlier). Screens a round's
    contributions (against the round's norms) and, in unsigned runs, each committed global
    update (against the run's recent rounds, `store_manager.ObjectStoreManager`)."""
    if not ratio or len(reference) < MIN_TO_JUDGE:
        return None
    median = statistics.median(reference)
    if norm > ratio * median:
        return f"norm outlier: L2 norm {norm:.4g} > {ratio:g} x {against} median {median:.4g}"
    return None


def _check_norms(work: _Work, policy: AggregatePolicy) -> None:
    alive = work.alive()
    norms = [c.get_stats().norm for c in alive]
    for c in alive:
        why = norm_outlier(c.get_stats().norm, norms, policy.aggregate_outlier_ratio)
        if why is not None:
            work.out[c.rank] = why


def _check_loss(work: _Work, policy: AggregatePolicy, probe: LossProbe | None) -> dict[int, float]:
    assert probe is not None
    alive = work.alive()
    if not alive:
        return {}
    first = alive[0].tensors
    if first is None:
        raise ValueError("screen='loss' needs each candidate's tensors")
    baseline = float(probe({n: torch.zeros_like(t) for n, t in first.items()}))
    if not math.isfinite(baseline):
        raise ValueError(f"screen='loss': the baseline loss is {baseline} (check the probe)")
    deltas: dict[int, float] = {}
    allowed = policy.screen_loss_tolerance * abs(baseline)
    for c in alive:
        if c.tensors is None:
            raise ValueError(f"screen='loss' needs the tensors of rank {c.rank}")
        loss = float(probe(c.tensors))
        delta = loss - baseline
        deltas[c.rank] = delta
        if not math.isfinite(loss) or delta > allowed:
            work.out[c.rank] = (
                f"harmful: alone it moves the held-out loss {baseline:.4g} -> {loss:.4g} "
                f"(more than loss_tolerance={policy.screen_loss_tolerance:g} x baseline)"
            )
    return deltas


def merge_weights(
    tokens: Mapping[int, int | None], policy: AggregatePolicy, notes: dict[int, str] | None = None
) -> dict[int, float]:
    """rank -> weight of each included rank (sum 1) under ``policy``'s weighting rule, from
    the token counts their contributions claim: equal, or proportional to the tokens (capped at
    ``aggregate_token_cap`` x their median; all zero: equal). The committer's rule, and what every reader
    recomputes to check a commit record's weights (``notes``: why a claim was capped)."""
    claims: dict[int, float] = {r: 1.0 for r in tokens}
    if policy.weighting == "tokens" and tokens:
        raw = {r: float(t or 0) for r, t in tokens.items()}
        cap = (
            policy.aggregate_token_cap * statistics.median(raw.values())
            if policy.aggregate_token_cap
            else None
        )
        for r, v in raw.items():
            if cap is not None and v > cap:
                if notes is not None:
                    notes[r] = (
                        f"token claim {int(v)} capped at {policy.aggregate_token_cap:g} x median"
                    )
                raw[r] = cap
        total = sum(raw.values())
        claims = raw if total > 0 else claims  # all zero: equal weights
    total = sum(claims.values())
    return {r: c / total for r, c in claims.items()}


def _decide(work: _Work, policy: AggregatePolicy, deltas: dict[int, float]) -> list[Decision]:
    alive = work.alive()
    notes: dict[int, str] = {}
    weights = merge_weights({c.rank: c.tokens for c in alive}, policy, notes)
    norms = {c.rank: c.get_stats().norm for c in alive}
    scales, clipped = rules.get(policy.aggregate).scales(norms, policy)
    for rank, note in clipped.items():
        notes[rank] = f"{notes[rank]}; {note}" if rank in notes else note
    decisions = []
    for r, c in sorted(work.candidates.items()):
        stats = c.stats
        decisions.append(
            Decision(
                rank=r,
                included=r not in work.out,
                reason=work.out.get(r, ""),
                weight=weights.get(r, 0.0),
                scale=scales.get(r, 1.0),
                norm=None if stats is None else stats.norm,
                loss_delta=deltas.get(r),
                note=notes.get(r, ""),
            )
        )
    return decisions


def included(decisions: Iterable[Decision]) -> list[Decision]:
    """The included decisions, in rank order."""
    return sorted((d for d in decisions if d.included), key=lambda d: d.rank)


def combine(
    candidates: Sequence[Candidate], decisions: Sequence[Decision], policy: AggregatePolicy
) -> dict[str, torch.Tensor]:
    """Merge the included candidates as ``decisions`` say (float32; see the module docstring).

    Raises ValueError when no candidate is included or an included one has no tensors.
    """
    by_rank = {c.rank: c for c in candidates}
    chosen = included(decisions)
    if not chosen:
        raise ValueError("combine: no candidate is included; nothing to merge")
    tensors = []
    for d in chosen:
        t = by_rank[d.rank].tensors
        if t is None:
            raise ValueError(f"combine: rank {d.rank} is included but has no tensors")
        tensors.append(t)
    rule = rules.get(policy.aggregate)
    equal = policy.weighting == "equal" and all(d.scale == 1.0 for d in chosen)
    operands = [Decoded(t, None if equal else d.weight * d.scale) for t, d in zip(tensors, chosen)]
    return rule.combine(operands, rule.trim(len(tensors), policy))


def merge(
    candidates: Sequence[Candidate],
    policy: AggregatePolicy,
    *,
    loss_probe: LossProbe | None = None,
) -> tuple[dict[str, torch.Tensor] | None, list[Decision]]:
    """`screen` then `combine`: (merged tensors, or None when every candidate was rejected;
    one decision per candidate, in rank order)."""
    decisions = screen(candidates, policy, loss_probe=loss_probe)
    if not included(decisions):
        return None, decisions
    return combine(candidates, decisions, policy), decisions


def screen_state(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Why a published global state must not be loaded (non-finite floating values), or None."""
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int(t.numel() - int(torch.isfinite(t).sum()))
            return f"{name!r}: {bad} of {t.numel()} values are NaN/inf"
    return None
