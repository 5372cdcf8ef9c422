"""The object-store exchange's settings (`ExchangeConfig`): codec, quorum, timeout, screening.

The run schema's `[diloco]` section composes this dataclass (the keys ``codec``,
``min_replicas``, ``weighting``, ``timeout_s``, ``aggregate*`` and ``screen*``); the replica's
`ObjectStoreAllReduce` and the decoupled synchronizer take their values from it. The choices,
defaults and checks of the ``aggregate*`` / ``screen*`` keys are
`contribution_screening.AggregatePolicy`'s, the aggregation rules' names `rules.names()`, the codec
names `codecs.names()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer_replication.exchange.codecs import DEFAULT, CodecName, SparseSpec, check_codec
from composer_replication.exchange.contribution_screening import (
    AggregatePolicy,
    ScreenName,
    WeightingName,
)
from composer_replication.exchange.rules import AggregateName
from composer_replication.fields import require, setting

__all__ = [
    "KEEP_ROUNDS",
    "AllReduceConfig",
    "CodecName",
    "ExchangeConfig",
    "StoreConfig",
    "default_quorum",
]

KEEP_ROUNDS = 4  # rounds (versions) the store keeps before garbage collection: [store] keep_rounds


def default_quorum(n_replicas: int) -> int:
    """``min_replicas`` when unset: ``max(1, n - 1)``. It tolerates one lost or refused replica
    (a contribution refused for a bad header, a non-finite value, a wrong writer, a failed
    signature or by screening counts as that rank's absence), so one dead replica or one object
    planted in the store cannot stop a run; with two or more missing a round does not commit."""
    return max(1, n_replicas - 1)


_POLICY = AggregatePolicy()  # every aggregate*/screen* default comes from here

# The keys that are AggregatePolicy's fields, under the same names.
_POLICY_KEYS = (
    "aggregate",
    "weighting",
    "aggregate_outlier_ratio",
    "aggregate_trim_fraction",
    "aggregate_clip_ratio",
    "aggregate_token_cap",
    "screen",
    "screen_loss_tolerance",
)


@dataclass(frozen=True, kw_only=True)
class ExchangeConfig:
    """How replicas exchange pseudo-gradients through the store (see the module docstring)."""

    codec: CodecName = setting(
        DEFAULT,
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
        _POLICY.aggregate, "how screened contributions are merged (docs/object-store.md)"
    )
    aggregate_outlier_ratio: float = setting(
        _POLICY.aggregate_outlier_ratio,
        "leave out a contribution whose L2 norm exceeds this x the round's median (0 = off)",
    )
    aggregate_trim_fraction: float = setting(
        _POLICY.aggregate_trim_fraction, "trimmed_mean: fraction of values dropped at each end"
    )
    aggregate_clip_ratio: float = setting(
        _POLICY.aggregate_clip_ratio,
        "norm_clip: clip each contribution's norm to this x the median",
    )
    aggregate_token_cap: float = setting(
        _POLICY.aggregate_token_cap,
        "weighting = 'tokens': cap claims at this x the median claim (0 = off)",
    )
    screen: ScreenName = setting(
        _POLICY.screen,
        "'loss': also leave out contributions that alone raise a held-out loss (Templar-style)",
    )
    screen_loss_tolerance: float = setting(
        _POLICY.screen_loss_tolerance, "screen = 'loss': tolerated rise, as a fraction of the loss"
    )
    screen_examples: int = setting(4, "screen = 'loss': held-out examples in the probe batch")

    def __post_init__(self) -> None:
        try:
            self.aggregate_policy()
        except ValueError as exc:  # "<key> must be ...": "<key>: must be ..."
            key, _, rest = str(exc).partition(" ")
            raise ValueError(f"{key}: {rest}") from None
        require(self.screen_examples >= 1, "screen_examples", "must be >= 1")
        if self.min_replicas is not None:
            require(self.min_replicas >= 1, "min_replicas", "must be >= 1")
        require(self.timeout_s > 0, "timeout_s", "must be > 0")

    def commit_quorum(self, n_replicas: int) -> int:
        """Contributions a round needs: ``min_replicas``, or `default_quorum` when unset."""
        return default_quorum(n_replicas) if self.min_replicas is None else self.min_replicas

    def allreduce_config(
        self,
        n_replicas: int,
        *,
        keep_rounds: int,
        policy: AggregatePolicy | None = None,
        sparse: SparseSpec | None = None,
    ) -> AllReduceConfig:
        """A replica's `ObjectStoreAllReduce` settings for these keys: the run's quorum of
        ``n_replicas``, ``keep_rounds`` (``[store]``), ``policy`` (None: `aggregate_policy`
        without claim bounds) and SparseLoCo's ``sparse``."""
        return AllReduceConfig(
            codec=self.codec,
            sparse=sparse,
            min_replicas=self.commit_quorum(n_replicas),
            aggregate=self.aggregate_policy() if policy is None else policy,
            timeout_s=self.timeout_s,
            keep_rounds=keep_rounds,
        )

    def aggregate_policy(self, **bounds: Any) -> AggregatePolicy:
        """The exchange's policy for these keys (``bounds``: the run's claim bounds)."""
        return AggregatePolicy(**{k: getattr(self, k) for k in _POLICY_KEYS}, **bounds)


_EXCHANGE = ExchangeConfig()  # the codec and timeout defaults of AllReduceConfig come from here


@dataclass(frozen=True, kw_only=True)
class AllReduceConfig:
    """What one `ObjectStoreAllReduce` does, besides who it is and what it holds.

    ``codec`` and ``sparse`` (what codec ``sparseloco`` keeps; None: `SparseSpec`'s defaults):
    how this replica's contributions are encoded; ``checksum``: their algorithm (None:
    ``xxh3-128`` when the ``xxhash`` package is installed, else ``sha256``; signing forces
    ``sha256``). ``min_replicas``: contributions a step needs (None: every rank, the library's
    strict choice; `composer-replication train` passes the run's quorum,
    `ExchangeConfig.commit_quorum`). ``aggregate``: the merge method (an aggregation rule's
    name) or a full `contribution_screening.AggregatePolicy` (screening thresholds, claim bounds;
    its ``weighting`` then replaces ``weighting``). ``timeout_s``: how long a step waits for
    contributions; ``upload_timeout_s`` (None: ``timeout_s / 4``) < ``timeout_s`` <
    ``run_timeout_s`` (None: no overall limit). ``keep_rounds``: committed steps kept in the
    store before garbage collection (``[store] keep_rounds``). ``poll_interval_s``: how often a
    wait polls; ``departure_poll_s``: how often the departure records of missing ranks are read.
    ``verify_own_upload``: the committer reads its own contribution back from the store before
    listing it, and leaves it out if the stored copy rotted or was overwritten (otherwise it
    lists its in-memory copy and every other rank fails that step's merge on the stored one:
    their managers then wait for and load the round's published state instead, `store_manager`);
    it costs one download of this rank's contribution per step it commits (+25 % of a 2-replica
    round's downloads), so it is off unless the store is not trusted to keep what was written.
    """

    codec: CodecName = _EXCHANGE.codec
    sparse: SparseSpec | None = None
    checksum: str | None = None
    min_replicas: int | None = None
    weighting: WeightingName = _POLICY.weighting
    aggregate: AggregateName | AggregatePolicy = _POLICY.aggregate
    timeout_s: float = _EXCHANGE.timeout_s
    upload_timeout_s: float | None = None
    run_timeout_s: float | None = None
    keep_rounds: int = KEEP_ROUNDS
    poll_interval_s: float = 0.1
    departure_poll_s: float = 1.0
    verify_own_upload: bool = False

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        upload = self.upload_s
        if not 0 < upload < self.timeout_s:
            raise ValueError(
                f"timeouts must be ordered upload < step: upload_timeout_s={upload} "
                f"is not in (0, timeout_s={self.timeout_s})"
            )
        if self.run_timeout_s is not None and not self.run_timeout_s > self.timeout_s:
            raise ValueError(
                f"timeouts must be ordered step < run: run_timeout_s={self.run_timeout_s} must "
                f"exceed timeout_s={self.timeout_s} (or be None for no overall limit)"
            )
        if self.min_replicas is not None and (
            not isinstance(self.min_replicas, int) or self.min_replicas < 1
        ):
            raise ValueError(f"min_replicas must be an int >= 1, got {self.min_replicas!r}")
        if self.weighting not in ("equal", "tokens"):
            raise ValueError(f"weighting must be 'equal' or 'tokens', got {self.weighting!r}")
        self.policy()  # the aggregate / weighting combination
        if not isinstance(self.keep_rounds, int) or self.keep_rounds < 1:
            raise ValueError(f"keep_rounds must be an int >= 1, got {self.keep_rounds!r}")
        for key in ("poll_interval_s", "departure_poll_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)!r}")
        check_codec(self.codec)
        if self.sparse is not None and not isinstance(self.sparse, SparseSpec):
            raise TypeError(f"sparse must be a SparseSpec, got {type(self.sparse).__name__}")

    @property
    def upload_s(self) -> float:
        """``upload_timeout_s``, or a quarter of ``timeout_s`` when unset."""
        return self.timeout_s / 4 if self.upload_timeout_s is None else self.upload_timeout_s

    def policy(self) -> AggregatePolicy:
        """The aggregation policy: ``aggregate`` itself, or its rule with ``weighting``."""
        if isinstance(self.aggregate, AggregatePolicy):
            if self.weighting != "equal" and self.weighting != self.aggregate.weighting:
                raise ValueError(
                    f"weighting={self.weighting!r} contradicts the policy's "
                    f"{self.aggregate.weighting!r}"
                )
            return self.aggregate
        return AggregatePolicy(aggregate=self.aggregate, weighting=self.weighting)


@dataclass(frozen=True)
class StoreConfig:
    """The object store the replicas meet in (one prefix per run)."""

    uri: str = setting(
        "", "file:///..., s3://bucket/prefix/, gs://...; empty = <run folder>/store/"
    )
    storage_options: dict[str, Any] = setting({}, "fsspec options (e.g. endpoint_url for S3)")
    keep_rounds: int = setting(
        KEEP_ROUNDS, "rounds of pseudo-gradients kept before garbage collection"
    )

    def __post_init__(self) -> None:
        require(self.keep_rounds >= 1, "store.keep_rounds", "must be >= 1")
