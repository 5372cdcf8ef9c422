"""The object-store exchange's settings (`ExchangeConfig`): codec, quorum, timeout, screening.

The run schema's `[diloco]` section composes this dataclass (the keys ``codec``,
``min_replicas``, ``weighting``, ``timeout_s``, ``aggregate*`` and ``screen*``); the replica's
`ObjectStoreAllReduce` and the decoupled synchronizer take their values from it. The choices,
defaults and checks of the ``aggregate*`` / ``screen*`` keys are `robust.AggregatePolicy`'s,
the aggregation rules' names `rules.names()`, the codec names `codecs.names()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer_replication.exchange.codecs import CodecName
from composer_replication.exchange.robust import AggregatePolicy, ScreenName, WeightingName
from composer_replication.exchange.rules import AggregateName
from composer_replication.fields import require, setting

__all__ = ["CodecName", "ExchangeConfig", "default_quorum"]


def default_quorum(n_replicas: int) -> int:
    """``min_replicas`` when unset: ``max(1, n - 1)``. It tolerates one lost or refused replica
    (a contribution refused for a bad header, a non-finite value, a wrong writer, a failed
    signature or by screening counts as that rank's absence), so one dead replica or one object
    planted in the store cannot stop a run; with two or more missing a round does not commit."""
    return max(1, n_replicas - 1)


_POLICY = AggregatePolicy()  # every aggregate*/screen* default comes from here

# AggregatePolicy's argument for each TOML key whose name differs.
_POLICY_ARGS = {
    "aggregate": "method",
    "aggregate_outlier_ratio": "outlier_ratio",
    "aggregate_trim_fraction": "trim_fraction",
    "aggregate_clip_ratio": "clip_ratio",
    "aggregate_token_cap": "token_cap",
    "screen_loss_tolerance": "loss_tolerance",
}


@dataclass(frozen=True, kw_only=True)
class ExchangeConfig:
    """How replicas exchange pseudo-gradients through the store (see the module docstring)."""

    codec: CodecName = setting(
        "fp32",
        "pseudo-gradient encoding (exchange.codecs); 'sparseloco' = SparseLoCo: chunk-wise top-k "
        "+ few-bit values with local error feedback, outer step plain SGD at "
        "sparseloco_outer_lr (no outer momentum; outer_optimizer/outer_lr/outer_momentum are "
        "not used)",
    )
    min_replicas: int | None = setting(
        None,
        "contributions needed to commit a round (unset = max(1, n_replicas - 1): one lost or "
        "refused replica is tolerated; see default_quorum, commit_quorum)",
    )
    weighting: WeightingName = setting(_POLICY.weighting, "how contributions are weighted")
    timeout_s: float = setting(600.0, "how long a round waits for contributions")
    aggregate: AggregateName = setting(
        _POLICY.method, "how screened contributions are merged (docs/object-store.md)"
    )
    aggregate_outlier_ratio: float = setting(
        _POLICY.outlier_ratio,
        "leave out a contribution whose L2 norm exceeds this x the round's median (0 = off)",
    )
    aggregate_trim_fraction: float = setting(
        _POLICY.trim_fraction, "trimmed_mean: fraction of values dropped at each end"
    )
    aggregate_clip_ratio: float = setting(
        _POLICY.clip_ratio, "norm_clip: clip each contribution's norm to this x the median"
    )
    aggregate_token_cap: float = setting(
        _POLICY.token_cap, "weighting = 'tokens': cap claims at this x the median claim (0 = off)"
    )
    screen: ScreenName = setting(
        _POLICY.screen,
        "'loss': also leave out contributions that alone raise a held-out loss (Templar-style)",
    )
    screen_loss_tolerance: float = setting(
        _POLICY.loss_tolerance, "screen = 'loss': tolerated rise, as a fraction of the loss"
    )
    screen_examples: int = setting(4, "screen = 'loss': held-out examples in the probe batch")

    def __post_init__(self) -> None:
        try:
            self.aggregate_policy()
        except ValueError as exc:  # "<argument> must be ...": name it as the key
            argument, _, rest = str(exc).partition(" ")
            key = {arg: key for key, arg in _POLICY_ARGS.items()}.get(argument, argument)
            raise ValueError(f"{key}: {rest}") from None
        require(self.screen_examples >= 1, "screen_examples", "must be >= 1")
        if self.min_replicas is not None:
            require(self.min_replicas >= 1, "min_replicas", "must be >= 1")
        require(self.timeout_s > 0, "timeout_s", "must be > 0")

    def commit_quorum(self, n_replicas: int) -> int:
        """Contributions a round needs: ``min_replicas``, or `default_quorum` when unset."""
        return default_quorum(n_replicas) if self.min_replicas is None else self.min_replicas

    def aggregate_policy(self, **bounds: Any) -> AggregatePolicy:
        """The exchange's policy for these keys (``bounds``: the run's claim bounds)."""
        keys = ("weighting", "screen", *_POLICY_ARGS)
        values = {_POLICY_ARGS.get(k, k): getattr(self, k) for k in keys}
        return AggregatePolicy(**values, **bounds)
