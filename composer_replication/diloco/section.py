"""The `[diloco]` section of a run: `DilocoConfig`, composed of the outer loop's component configs.

Each component owns its settings, with their defaults, help and checks, beside its code:

- `OuterOptimizerConfig` (diloco/outer_optimizer.py): ``outer_optimizer``, ``outer_lr``,
  ``outer_momentum``, ``outer_betas``, ``outer_eps``;
- `ExchangeConfig` (exchange/settings.py): ``codec``, ``min_replicas``, ``weighting``,
  ``timeout_s``, ``aggregate*``, ``screen*``;
- `SparseLoCoConfig` (diloco/sparseloco.py): ``sparseloco_*``;
- `DecoupledConfig` (diloco/decoupled/learner.py, with the synchronizer's `SynchronizerSettings`):
  ``fragments``, ``quorum``, ``grace_gamma``, ``grace_tau``, ``merge``, ``late``, ``alpha``,
  ``synchronizer``, ``lease_ttl_s``;
- `TorchftConfig` (diloco/torchft/torchft_path.py): ``lighthouse``.

The section is flat in TOML (``[diloco] outer_lr = 0.5``), so `DilocoConfig` inherits their
fields under the same names and adds the outer loop's own: ``sync_every_h``, and ``mode`` /
``manager``, from which `mode_registry.outer_loop_mode` picks the `OuterLoopMode` (whose rules
on the combination are checked when the run config is built).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from composer_replication.diloco.decoupled.learner import DecoupledConfig
from composer_replication.diloco.mode_registry import manager_names, mode_names
from composer_replication.diloco.outer_optimizer import OuterOptimizerConfig
from composer_replication.diloco.sparseloco import SparseLoCoConfig
from composer_replication.diloco.torchft.torchft_path import TorchftConfig
from composer_replication.exchange.settings import ExchangeConfig
from composer_replication.fields import OneOf, require, setting

__all__ = ["DilocoConfig", "ManagerName", "ModeName", "OuterLoopSettings"]


# Names the mode registry holds (one registration per mode: `mode_registry._MODES`), checked by
# the loader against the live registry.
ModeName = Annotated[str, OneOf(mode_names, "an outer-loop mode (docs/diloco.md)")]
ManagerName = Annotated[str, OneOf(manager_names, "who averages (docs/diloco.md)")]


@dataclass(frozen=True, kw_only=True)
class OuterLoopSettings:
    """The outer loop's own keys: its period and which `OuterLoopMode` runs it."""

    sync_every_h: int = setting(20, "inner steps between outer synchronisations (H)")
    mode: ModeName = setting(
        "sync",
        "'sync': every round is a barrier; 'decoupled': learners never wait, a synchronizer "
        "merges each fragment once a quorum has pushed (docs/diloco.md, Decoupled DiLoCo)",
    )
    manager: ManagerName = setting(
        "object_store",
        "who averages the replicas: 'object_store' (they meet only in store.uri) or 'torchft' "
        "(torchft's Manager and lighthouse; replicas must reach each other over TCP)",
    )

    def __post_init__(self) -> None:
        require(self.sync_every_h >= 1, "sync_every_h", "must be >= 1")
        modes, managers = mode_names(), manager_names()
        require(self.mode in modes, "mode", f"{self.mode!r} is not one of {modes}")
        require(self.manager in managers, "manager", f"{self.manager!r} is not one of {managers}")


# Fields are laid out base-most first: the outer loop's own keys, the outer optimizer, the
# exchange, SparseLoCo, the decoupled mode, torchft.
@dataclass(frozen=True, kw_only=True)
class DilocoConfig(
    TorchftConfig,
    DecoupledConfig,
    SparseLoCoConfig,
    ExchangeConfig,
    OuterOptimizerConfig,
    OuterLoopSettings,
):
    """The outer loop: every H inner steps replicas exchange pseudo-gradients (global - local)."""

    def __post_init__(self) -> None:
        for part in (
            OuterLoopSettings,
            OuterOptimizerConfig,
            ExchangeConfig,
            SparseLoCoConfig,
            DecoupledConfig,
            TorchftConfig,
        ):
            part.__post_init__(self)
        require(
            self.sync_every_h % self.fragments == 0,
            "fragments",
            f"{self.fragments} must divide sync_every_h ({self.sync_every_h})",
        )
