"""The torchft path, the ``mode = "sync"``, ``manager = "torchft"`` outer-loop mode: its
`OuterLoopMode` (`torchft_mode.TorchftDiLoCo`: sync DiLoCo's hooks over a torchft Manager, the
lighthouse the driver runs for a local run) and the adapter of torchft's real Manager
(`torchft_path`: `TorchFTManager`, its `[diloco]` settings `TorchftConfig`)."""

from __future__ import annotations

from composer_replication.lazy import lazy_getattr

_LAZY = {
    "TorchftDiLoCo": "composer_replication.diloco.torchft.torchft_mode",
    "TorchFTManager": "composer_replication.diloco.torchft.torchft_path",
    "TorchftConfig": "composer_replication.diloco.torchft.torchft_path",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
