"""The outer optimizer: its settings (`OuterOptimizerConfig`, the `[diloco] outer_*` keys) and
the factory that builds it over one fragment's parameters.

Every outer-optimizer default and check is written here once: the run schema's `[diloco]`
section, `make_diloco_outer_loop` and the decoupled synchronizer's outer step take them from
this dataclass. DiLoCo's outer step is SGD with Nesterov momentum, lr 0.7, momentum 0.9 (the
paper's values); ``"sgd"`` is heavy-ball momentum (0 = plain SGD: with lr 1 exactly the
average of the replicas); ``"adam"`` uses ``outer_betas`` and ``outer_eps`` (torch's defaults).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from composer_replication.fields import require, setting

__all__ = [
    "OUTER_OPTIMIZERS",
    "OuterOptimizerConfig",
    "OuterOptimizerFactory",
    "OuterOptimizerName",
]

OuterOptimizerName = Literal["nesterov", "sgd", "adam"]
OUTER_OPTIMIZERS: tuple[OuterOptimizerName, ...] = get_args(OuterOptimizerName)

OuterOptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True, kw_only=True)
class OuterOptimizerConfig:
    """The outer optimizer of DiLoCo (see the module docstring)."""

    outer_optimizer: OuterOptimizerName = setting(
        "nesterov",
        "the outer optimizer: 'nesterov' (SGD + Nesterov momentum, DiLoCo's), 'sgd' (heavy-ball "
        "momentum; 0 = plain averaging at lr 1) or 'adam'",
    )
    outer_lr: float = setting(0.7, "outer learning rate")
    outer_momentum: float = setting(0.9, "outer momentum ('nesterov', 'sgd')")
    outer_betas: list[float] = setting([0.9, 0.999], "outer Adam betas ('adam')")
    outer_eps: float = setting(1e-8, "outer Adam epsilon ('adam')")

    def __post_init__(self) -> None:
        require(
            self.outer_optimizer in OUTER_OPTIMIZERS,
            "outer_optimizer",
            f"{self.outer_optimizer!r} is not one of {list(OUTER_OPTIMIZERS)}",
        )
        require(self.outer_lr > 0, "outer_lr", f"must be > 0, got {self.outer_lr}")
        require(
            0.0 <= self.outer_momentum < 1.0,
            "outer_momentum",
            f"must be in [0, 1), got {self.outer_momentum}",
        )
        require(
            self.outer_optimizer != "nesterov" or self.outer_momentum > 0,
            "outer_momentum",
            "0 with outer_optimizer = 'nesterov'; use outer_optimizer = 'sgd' for no momentum",
        )
        require(
            len(self.outer_betas) == 2 and all(0.0 <= b < 1.0 for b in self.outer_betas),
            "outer_betas",
            f"{list(self.outer_betas)} must be two numbers in [0, 1)",
        )
        require(self.outer_eps > 0, "outer_eps", "must be > 0")

    @property
    def nesterov(self) -> bool:
        """Nesterov momentum in the outer step (outer_optimizer = 'nesterov')."""
        return self.outer_optimizer == "nesterov"

    def build_outer_optimizer(self) -> OuterOptimizerFactory:
        """The outer optimizer as a factory of fragment parameters."""
        lr, momentum, nesterov = self.outer_lr, self.outer_momentum, self.nesterov
        if self.outer_optimizer == "adam":
            betas = (self.outer_betas[0], self.outer_betas[1])
            eps = self.outer_eps
            return lambda params: torch.optim.Adam(params, lr=lr, betas=betas, eps=eps)
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)
