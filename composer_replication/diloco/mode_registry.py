"""The registry of outer-loop modes: ``(mode, manager)`` of `[diloco]` -> its `OuterLoopMode`.

`outer_loop_mode(config)` is the one place that reads ``diloco.mode`` and ``diloco.manager``:
the run schema calls it to check a configuration, the composition root (assembly/) to build a
replica's outer loop and the driver's services, and the driver and the replica ask the mode
what to do instead of testing its name. Adding a mode: one class implementing `OuterLoopMode`
with its ``mode`` / ``manager`` names, one line in ``_MODES`` (the loader then accepts the names),
its tests and docs/diloco.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from composer_replication.diloco.mode_protocol import OuterLoopMode

__all__ = ["manager_names", "mode_names", "outer_loop_mode", "outer_loop_modes"]


class _Names(Protocol):
    """What the registry reads of a `[diloco]` section (`section.DilocoConfig`, which imports
    this module for the names its loader accepts)."""

    @property
    def mode(self) -> str: ...

    @property
    def manager(self) -> str: ...


class _ModeClass(Protocol):
    mode: str
    manager: str

    def __call__(self, config: _Names) -> OuterLoopMode: ...


# The one registration of a mode: ``(diloco.mode, diloco.manager)`` -> ``"module:Class"``,
# imported when first built (the classes import the `[diloco]` section, whose loader checks a
# name against this table). `diloco.mode` and `diloco.manager` accept the names here.
_MODES: dict[tuple[str, str], str] = {
    ("sync", "object_store"): "composer_replication.diloco.sync.sync_mode:SyncDiLoCo",
    ("sync", "torchft"): "composer_replication.diloco.torchft.torchft_mode:TorchftDiLoCo",
    ("decoupled", "object_store"): (
        "composer_replication.diloco.decoupled.decoupled_mode:DecoupledDiLoCo"
    ),
}


def mode_names() -> list[str]:
    """The registered ``diloco.mode`` names."""
    return sorted({mode for mode, _ in _MODES})


def manager_names() -> list[str]:
    """The registered ``diloco.manager`` names."""
    return sorted({manager for _, manager in _MODES})


def _load(key: tuple[str, str]) -> _ModeClass:
    module, name = _MODES[key].split(":")
    cls: _ModeClass = getattr(importlib.import_module(module), name)
    if (cls.mode, cls.manager) != key:
        raise TypeError(
            f"{_MODES[key]} says mode {cls.mode!r}, manager {cls.manager!r}; it is registered "
            f"as {key}: make its names and its _MODES entry agree"
        )
    return cls


def outer_loop_modes() -> dict[tuple[str, str], _ModeClass]:
    """``(mode, manager)`` -> the class of every registered mode."""
    return {key: _load(key) for key in _MODES}


def outer_loop_mode(config: _Names) -> OuterLoopMode:
    """The mode ``config`` names, built (its rules on the section checked: ``ValueError``)."""
    key = (config.mode, config.manager)
    if key not in _MODES:
        managers = [m for mode, m in _MODES if mode == config.mode]
        raise ValueError(
            f"diloco.manager: {config.manager!r} does not run diloco.mode = {config.mode!r} "
            f"(its replicas meet through {' or '.join(repr(m) for m in managers)}): set "
            f"diloco.manager = {managers[0]!r}"
        )
    return _load(key)(config)
