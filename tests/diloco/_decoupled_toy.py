"""A tiny model with repeated blocks and a deterministic data stream (decoupled tests only)."""

from __future__ import annotations

import torch
from torch import nn

D = 8


class Blocks(nn.Module):
    """Embedding, 4 residual blocks in a ModuleList (what strided fragments split), a head."""

    def __init__(self, seed: int = 0, width: int = D) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(16, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).mean(1)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


def batch(learner: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learner's batch at its inner step ``step`` (a pure function of both)."""
    g = torch.Generator().manual_seed(1_000_003 * (learner + 1) + step)
    idx = torch.randint(0, 16, (8, 5), generator=g)
    y = (idx[:, 0] % 3).long()
    return idx, y


def train_step(model: nn.Module, opt: torch.optim.Optimizer, learner: int, step: int) -> float:
    x, y = batch(learner, step)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


@torch.no_grad()
def eval_loss(model: nn.Module) -> float:
    g = torch.Generator().manual_seed(424242)
    idx = torch.randint(0, 16, (256, 5), generator=g)
    y = (idx[:, 0] % 3).long()
    return float(nn.functional.cross_entropy(model(idx), y))
