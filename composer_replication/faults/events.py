"""The chaos harness's configuration: `ChaosEventConfig` (one fault) and `ChaosConfig` (the
`[chaos]` section: a schedule of them), beside the injector that runs them (faults/injector.py).

Rules that need the rest of the run (the local backend, restarts, replica ranks, the
outer-loop mode's synchronizer, an S3 store) are checked by the run config (config/schema.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from composer_replication.fields import require, setting

__all__ = [
    "CHAOS_ACTIONS",
    "PROXY_ACTIONS",
    "UNTARGETED_ACTIONS",
    "ChaosAction",
    "ChaosConfig",
    "ChaosEventConfig",
]

ChaosAction = Literal[
    "kill", "stop", "slow", "corrupt", "kill_synchronizer", "throttle", "read_only"
]
CHAOS_ACTIONS: tuple[ChaosAction, ...] = get_args(ChaosAction)
# Faults injected at the S3 endpoint, through the proxy the replicas are pointed at (an s3://
# store only: a file:// store has no connection to act on).
PROXY_ACTIONS: tuple[ChaosAction, ...] = ("throttle", "read_only")
# Faults whose `target` is not a replica rank.
UNTARGETED_ACTIONS: tuple[ChaosAction, ...] = ("kill_synchronizer", "corrupt", *PROXY_ACTIONS)


@dataclass(frozen=True, kw_only=True)
class ChaosEventConfig:
    """One fault the chaos harness injects (faults/injector.py; local backend only)."""

    at_s: float = setting(0.0, "seconds after every replica started training")
    action: ChaosAction = setting(
        "kill",
        "kill (-9), stop (SIGSTOP for duration_s), slow (factor x), corrupt (an object), "
        "kill_synchronizer (restarted after restart_after_s), throttle (the S3 endpoint), "
        "read_only (the S3 endpoint refuses every write with 403 AccessDenied for duration_s)",
    )
    target: str = setting(
        "0",
        "a replica rank; for corrupt 'push', 'push:<rank>', 'global' or 'contribution'; "
        "ignored by kill_synchronizer, throttle and read_only",
    )
    during: Literal["any", "upload"] = setting(
        "any", "kill: at once ('any', i.e. mid inner step) or while the replica uploads"
    )
    duration_s: float = setting(0.0, "stop / slow / throttle / read_only: how long")
    factor: float = setting(3.0, "slow: the replica runs this many times slower")
    rate_bytes_s: float = setting(1e6, "throttle: bytes per second through the store endpoint")
    restart_after_s: float = setting(1.0, "kill_synchronizer: seconds before it is started again")

    def __post_init__(self) -> None:
        require(self.at_s >= 0, "at_s", "must be >= 0")
        require(self.duration_s >= 0, "duration_s", "must be >= 0")
        require(self.factor >= 1, "factor", "must be >= 1")
        require(self.rate_bytes_s > 0, "rate_bytes_s", "must be > 0")
        require(self.restart_after_s >= 0, "restart_after_s", "must be >= 0")
        if self.action in ("stop", "slow", *PROXY_ACTIONS):
            require(self.duration_s > 0, "duration_s", f"must be > 0 for {self.action!r}")


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """Fault injection while the run trains (local backend): a schedule of events."""

    events: list[ChaosEventConfig] = setting([], "the faults ([[chaos.events]] tables)")
    upload_wait_s: float = setting(
        60.0, "kill during='upload': give up if no upload is caught within this many seconds"
    )

    def __post_init__(self) -> None:
        require(self.upload_wait_s > 0, "upload_wait_s", "must be > 0")
