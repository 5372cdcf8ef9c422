"""The decoupled synchronizer's configuration.

`SynchronizerSettings` are the keys a user writes (`[diloco]` ``quorum``, ``grace_gamma``,
``grace_tau``, ``merge``, ``late``, ``lease_ttl_s``; the run schema composes them through
`decoupled.DecoupledConfig`); `SynchronizerConfig` is those settings and what the synchronizer
needs besides: the outer step (``outer``, the section's own `OuterOptimizerConfig`: SGD with or
without Nesterov momentum), the screening (``weighting``, ``aggregate``,
``aggregate_outlier_ratio``, as the exchange names them), how many versions the store keeps
(``keep_rounds``) and its timings. Every setting is named as its TOML key, so a run config
becomes a `SynchronizerConfig` without renaming anything (`decoupled_mode.synchronizer_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, get_args

from composer_replication.diloco.outer_optimizer import OuterOptimizerConfig
from composer_replication.exchange import rules
from composer_replication.exchange.contribution_screening import (
    WEIGHTINGS,
    AggregatePolicy,
    WeightingName,
)
from composer_replication.exchange.liveness import DEAD_AFTER_S, STALE_AFTER_S
from composer_replication.exchange.rules import AggregateName
from composer_replication.exchange.settings import KEEP_ROUNDS
from composer_replication.fields import require, setting

__all__ = [
    "KEEP_ROUNDS",
    "LATE_POLICIES",
    "MERGE_METHODS",
    "LatePolicy",
    "MergeMethod",
    "SynchronizerConfig",
    "SynchronizerSettings",
    "check_outer_step",
]

MergeMethod = Literal["mean", "rda"]
LatePolicy = Literal["drop", "carry"]
MERGE_METHODS: tuple[MergeMethod, ...] = get_args(MergeMethod)
LATE_POLICIES: tuple[LatePolicy, ...] = get_args(LatePolicy)

_POLICY = AggregatePolicy()


def _choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    require(value in choices, key, f"{value!r} is not one of {list(choices)}")


def check_outer_step(*, outer_optimizer: str, merge: str, aggregate: str) -> None:
    """The synchronizer's rules on the keys it shares with sync mode, stated once (the
    synchronizer's config and the decoupled mode's check of ``[diloco]`` both call this):
    its outer step is SGD, and ``merge = 'rda'`` takes a plain mean. ValueError naming the key."""
    require(
        outer_optimizer != "adam",
        "outer_optimizer",
        "'adam' runs in sync mode only; the decoupled synchronizer's outer step is SGD "
        "with (Nesterov) momentum: use 'nesterov' or 'sgd'",
    )
    require(
        merge == "mean" or not rules.get(aggregate).robust,
        "merge",
        "'rda' averages directions itself: use aggregate = 'mean' with it",
    )


@dataclass(frozen=True, kw_only=True)
class SynchronizerSettings:
    """How the synchronizer decides a merge (docs/diloco.md, Decoupled DiLoCo)."""

    quorum: int | None = setting(
        None,
        "decoupled: learners that must push a fragment before it is merged (unset = all but one)",
    )
    grace_gamma: float = setting(
        0.8, "decoupled: grace window = grace_gamma * max(0, grace_tau * step - quorum - sync)"
    )
    grace_tau: float = setting(2.0, "decoupled: inner steps a fragment may stay in flight (tau)")
    merge: MergeMethod = setting(
        "mean", "decoupled: 'mean' or 'rda' (radial-directional averaging) of the pushes"
    )
    late: LatePolicy = setting(
        "carry", "decoupled: a push based on an already merged version is merged next or dropped"
    )
    lease_ttl_s: float = setting(
        10.0,
        "decoupled: a silent synchronizer's lease expires after this (then another takes over)",
    )

    def __post_init__(self) -> None:
        if self.quorum is not None:
            require(
                isinstance(self.quorum, int) and self.quorum >= 1,
                "quorum",
                f"must be an int >= 1, got {self.quorum!r}",
            )
        require(0.0 <= self.grace_gamma <= 1.0, "grace_gamma", "must be in [0, 1]")
        require(self.grace_tau >= 0, "grace_tau", "must be >= 0")
        _choice("merge", self.merge, MERGE_METHODS)
        _choice("late", self.late, LATE_POLICIES)
        require(self.lease_ttl_s > 0, "lease_ttl_s", "must be > 0")

    def resolved_quorum(self, n_learners: int) -> int:
        """The quorum for ``n_learners``: ``quorum``, or all learners but one (at least one)."""
        return self.quorum if self.quorum is not None else max(1, n_learners - 1)


@dataclass(frozen=True, kw_only=True)
class SynchronizerConfig(SynchronizerSettings):
    """Everything a `Synchronizer` needs (see the module docstring; defaults in docs/diloco.md).

    ``outer``: the outer step, checked by `OuterOptimizerConfig` itself. ``max_steps``: a
    learner counts as done at "done" with at least this many steps.
    """

    outer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    # one of exchange.contribution_screening's WEIGHTINGS
    weighting: WeightingName = _POLICY.weighting
    aggregate: AggregateName = _POLICY.aggregate  # an aggregation rule (exchange.rules)
    aggregate_outlier_ratio: float = _POLICY.aggregate_outlier_ratio  # 0 = no norm screening
    keep_rounds: int = KEEP_ROUNDS
    poll_interval_s: float = 0.1
    ema: float = 0.2
    stale_after_s: float = STALE_AFTER_S
    dead_after_s: float = DEAD_AFTER_S
    heartbeat_every_s: float = 1.0
    progress_every_s: float = 0.5
    max_steps: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("weighting", self.weighting, WEIGHTINGS)
        _choice("aggregate", self.aggregate, rules.names())
        check_outer_step(
            outer_optimizer=self.outer.outer_optimizer, merge=self.merge, aggregate=self.aggregate
        )
        require(
            isinstance(self.keep_rounds, int) and self.keep_rounds >= 1,
            "keep_rounds",
            f"must be an int >= 1, got {self.keep_rounds!r}",
        )
        require(0 < self.ema <= 1, "ema", f"must be in (0, 1], got {self.ema!r}")
        for key in ("poll_interval_s", "heartbeat_every_s", "progress_every_s"):
            require(getattr(self, key) > 0, key, "must be > 0")

    @classmethod
    def run_keys(cls) -> tuple[str, ...]:
        """The fields a run's `[diloco]` section sets under the same names: the
        `SynchronizerSettings` and the screening keys (not ``outer``, the section's
        `OuterOptimizerConfig` itself, the store's ``keep_rounds``, the run length and the
        synchronizer's own timings)."""
        own = {*_OWN, "outer"}
        return tuple(f.name for f in fields(cls) if f.name not in own)


_OWN = (
    "keep_rounds",
    "poll_interval_s",
    "ema",
    "stale_after_s",
    "dead_after_s",
    "heartbeat_every_s",
    "progress_every_s",
    "max_steps",
)
