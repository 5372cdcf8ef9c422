"""The `[diloco]` section of a run: `DilocoConfig`, composed of the outer loop's component configs.

Each component owns its settings, with their defaults, help and checks, beside its code, and
`DilocoConfig` holds it as a field:

- ``outer``: `OuterOptimizerConfig` (diloco/outer_optimizer.py): ``outer_optimizer``,
  ``outer_lr``, ``outer_momentum``, ``outer_betas``, ``outer_eps``;
- ``exchange``: `ExchangeConfig` (exchange/settings.py): ``codec``, ``min_replicas``,
  ``weighting``, ``timeout_s``, ``aggregate*``, ``screen*``;
- ``sparseloco``: `SparseLoCoConfig` (diloco/sparseloco.py): ``sparseloco_*``;
- ``decoupled``: `DecoupledConfig` (diloco/decoupled/learner.py, with the synchronizer's
  `SynchronizerSettings`): ``fragments``, ``quorum``, ``grace_gamma``, ``grace_tau``, ``merge``,
  ``late``, ``alpha``, ``synchronizer``, ``lease_ttl_s``;
- ``torchft``: `TorchftConfig` (diloco/torchft/torchft_path.py): ``lighthouse``.

The section is flat in TOML (``[diloco] outer_lr = 0.5`` is ``DilocoConfig.outer.outer_lr``):
each component is a `fields.component` field, whose keys the loader reads and writes flat
(`config.loader.section_keys`). `DilocoConfig` adds the outer loop's own keys, ``sync_every_h``,
and ``mode`` / ``manager``, from which `mode_registry.outer_loop_mode` picks the `OuterLoopMode`
(whose rules on the combination are checked when the run config is built), and checks the one
rule across its components (``fragments`` divides ``sync_every_h``); each component checks its
own keys.
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
from composer_replication.fields import OneOf, component, require, setting

__all__ = ["DilocoConfig", "ManagerName", "ModeName"]


# Names the mode registry holds (one registration per mode: `mode_registry._MODES`), checked by
# the loader against the live registry.
ModeName = Annotated[str, OneOf(mode_names, "an outer-loop mode (docs/diloco.md)")]
ManagerName = Annotated[str, OneOf(manager_names, "who averages (docs/diloco.md)")]


@dataclass(frozen=True, kw_only=True)
class DilocoConfig:
    """The outer loop: every H inner steps replicas exchange pseudo-gradients (global - local)."""

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
    # The components, in the order docs/cli.md lists their keys.
    outer: OuterOptimizerConfig = component(OuterOptimizerConfig)
    exchange: ExchangeConfig = component(ExchangeConfig)
    sparseloco: SparseLoCoConfig = component(SparseLoCoConfig)
    decoupled: DecoupledConfig = component(DecoupledConfig)
    torchft: TorchftConfig = component(TorchftConfig)

    def __post_init__(self) -> None:
        require(self.sync_every_h >= 1, "sync_every_h", "must be >= 1")
        modes, managers = mode_names(), manager_names()
        require(self.mode in modes, "mode", f"{self.mode!r} is not one of {modes}")
        require(self.manager in managers, "manager", f"{self.manager!r} is not one of {managers}")
        fragments = self.decoupled.fragments
        require(
            self.sync_every_h % fragments == 0,
            "fragments",
            f"{fragments} must divide sync_every_h ({self.sync_every_h})",
        )
