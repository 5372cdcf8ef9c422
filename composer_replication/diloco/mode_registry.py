"""The registry of outer-loop modes: ``(mode, manager)`` of `[diloco]` -> its `OuterLoopMode`.

`outer_loop_mode(config)` is the one place that reads ``diloco.mode`` and ``diloco.manager``:
the run schema calls it to check a configuration, the composition root (assembly/) to build a
replica's outer loop and the driver's services, and the driver and the replica ask the mode
what to do instead of testing its name. Adding a mode: one class implementing `OuterLoopMode`
with its ``mode`` / ``manager`` names, one line in ``_MODES``, its tests and docs/diloco.md.
"""

from __future__ import annotations

from typing import Protocol

from composer_replication.diloco.decoupled.decoupled_mode import DecoupledDiLoCo
from composer_replication.diloco.outer_mode import OuterLoopMode
from composer_replication.diloco.section import DilocoConfig, ManagerName, ModeName
from composer_replication.diloco.sync.sync_mode import SyncDiLoCo
from composer_replication.diloco.torchft.torchft_mode import TorchftDiLoCo

__all__ = ["OUTER_LOOP_MODES", "outer_loop_mode"]


class _ModeClass(Protocol):
    mode: ModeName
    manager: ManagerName

    def __call__(self, config: DilocoConfig) -> OuterLoopMode: ...


_MODES: tuple[_ModeClass, ...] = (SyncDiLoCo, TorchftDiLoCo, DecoupledDiLoCo)

OUTER_LOOP_MODES: dict[tuple[ModeName, ManagerName], _ModeClass] = {
    (cls.mode, cls.manager): cls for cls in _MODES
}


def outer_loop_mode(config: DilocoConfig) -> OuterLoopMode:
    """The mode ``config`` names, built (its rules on the section checked: ``ValueError``)."""
    cls = OUTER_LOOP_MODES.get((config.mode, config.manager))
    if cls is None:
        managers = [m for mode, m in OUTER_LOOP_MODES if mode == config.mode]
        raise ValueError(
            f"diloco.manager: {config.manager!r} does not run diloco.mode = {config.mode!r} "
            f"(its replicas meet through {' or '.join(repr(m) for m in managers)}): set "
            f"diloco.manager = {managers[0]!r}"
        )
    return cls(config)
