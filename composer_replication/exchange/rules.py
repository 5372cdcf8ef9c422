"""Aggregation rules: the `AggregationRule` protocol and the registry that maps each rule's name
(``[diloco] aggregate``, a commit record's and a merge record's ``aggregate``) to its
implementation.

A rule says how a round's included contributions become one update, and the few things the
screening and the commit protocol ask of it instead of comparing names:

- `robust`: the rule limits what one contribution can do to the result, so it needs
  ``MIN_TO_JUDGE`` contributions to tell an outlier apart (the decoupled synchronizer merges
  none of fewer); a plain mean does not;
- `trim`: the values it drops at each end per coordinate (recorded in the commit record, and
  recomputed by every reader);
- `scales`: each contribution's clip scale (1: unclipped) and a note for the clipped ones;
  `scale_problem`: why a recorded scale is not one the rule gives;
- `combine`: the deterministic float32 merge of the included contributions (`Operand`s, in
  rank order). The weighted mean is `weighted_sum.WeightedSum`; the coordinate-wise rules sort
  along the rank axis (`merge_arithmetic.coordinatewise`).

The rules, by module: ``mean`` and ``norm_clip`` (exchange/rule_weighted.py), ``trimmed_mean``
and ``median`` (exchange/rule_coordinatewise.py). The registry names each implementation by
module path (the implementations use `merge_arithmetic`, which replays a commit record through
this registry), and imports it on first use. Adding a rule: one class with these
members, one line in ``_REGISTRY`` below, its tests and its line in docs/object-store.md
("Robust aggregation"); the run config's ``aggregate`` accepts every registered name.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Annotated, Protocol, TypeGuard

import torch

from composer_replication.exchange.weighted_sum import WeightedSum
from composer_replication.fields import OneOf

__all__ = [
    "AggregateName",
    "AggregationRule",
    "Operand",
    "RuleSettings",
    "UnscaledRule",
    "check_rule",
    "get",
    "is_rule_name",
    "names",
]

Tensors = dict[str, torch.Tensor]


class RuleSettings(Protocol):
    """The settings a rule reads (`contribution_screening.AggregatePolicy` has them)."""

    @property
    def aggregate_trim_fraction(self) -> float: ...

    @property
    def aggregate_clip_ratio(self) -> float: ...


class Operand(Protocol):
    """One included contribution as a rule merges it."""

    @property
    def coefficient(self) -> float | None:
        """Its weight times its clip scale; None when every contribution weighs the same (the
        sum is then divided by the count)."""
        ...

    def decode(self) -> Mapping[str, torch.Tensor]:
        """Its float32 tensors (may view a peer's payload: do not write into them)."""
        ...

    def add_to(self, total: WeightedSum) -> None:
        """Add ``coefficient x`` its tensors to ``total`` (streaming where its codec can)."""
        ...


class AggregationRule(Protocol):
    """One aggregation rule (see the module docstring). Implementations hold no state."""

    @property
    def robust(self) -> bool:
        """It limits what one contribution can do, so it needs ``MIN_TO_JUDGE`` of them."""
        ...

    def trim(self, n: int, settings: RuleSettings) -> int:
        """Values dropped at each end per coordinate over ``n`` contributions (0: none)."""
        ...

    def scales(
        self, norms: Mapping[int, float], settings: RuleSettings
    ) -> tuple[dict[int, float], dict[int, str]]:
        """rank -> clip scale of each contribution (absent: 1.0), and rank -> a note for each
        one clipped; ``norms``: the L2 norms of the contributions still in, by rank."""
        ...

    def scale_problem(self, scale: float) -> str | None:
        """Why ``scale``, read from a commit record, is not one this rule gives ("allows only
        1"), or None."""
        ...

    def combine(self, operands: Iterable[Operand], trim: int) -> Tensors:
        """The merge of ``operands`` (in rank order; ``trim`` as `trim` gave it), float32."""
        ...


class UnscaledRule:
    """The members of a rule that neither trims nor clips (a base for implementations)."""

    robust = True

    def trim(self, n: int, settings: RuleSettings) -> int:
        return 0

    def scales(
        self, norms: Mapping[int, float], settings: RuleSettings
    ) -> tuple[dict[int, float], dict[int, str]]:
        return {}, {}

    def scale_problem(self, scale: float) -> str | None:
        return None if scale == 1.0 else "allows only 1"


_REGISTRY: dict[str, str] = {
    "mean": "composer_replication.exchange.rule_weighted:MeanRule",
    "trimmed_mean": "composer_replication.exchange.rule_coordinatewise:TrimmedMeanRule",
    "median": "composer_replication.exchange.rule_coordinatewise:MedianRule",
    "norm_clip": "composer_replication.exchange.rule_weighted:NormClipRule",
}
_BUILT: dict[str, AggregationRule] = {}


def names() -> tuple[str, ...]:
    """Every registered rule's name, in registration order."""
    return tuple(_REGISTRY)


AggregateName = Annotated[
    str, OneOf(names, 'an aggregation rule (docs/object-store.md, "Aggregation rules")')
]
"""A registered rule's name (the run config's ``diloco.aggregate``; the loader checks it)."""


def is_rule_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` (e.g. read from a stored record) is a registered rule."""
    return isinstance(name, str) and name in _REGISTRY


def check_rule(name: object) -> str:
    """Return ``name`` if it is a registered rule, else raise ValueError listing them."""
    if not is_rule_name(name):
        raise ValueError(f"unknown aggregation rule {name!r}: one of {list(_REGISTRY)}")
    return name


def get(name: str) -> AggregationRule:
    """The rule ``name`` (ValueError for an unknown name), imported on first use."""
    path = _REGISTRY[check_rule(name)]
    built = _BUILT.get(path)
    if built is None:
        module, _, cls = path.partition(":")
        built = _BUILT[path] = getattr(importlib.import_module(module), cls)()
    return built
