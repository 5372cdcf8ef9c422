"""Independent single-process DiLoCo reference for the tests (not collected).

Replays each replica's inner loop from the global weights with the worker's own data and inner
step, averages the pseudo-gradients (global - local) and applies Nesterov momentum SGD written
out by hand (not torch.optim), so the outer step is checked against the formula, not itself:

    buf <- mu * buf + g   (buf = g on the first step);  d = g + mu * buf (Nesterov) or buf
    global <- global - lr * d
"""

from __future__ import annotations

import torch
from _diloco_worker import INNER_LR, build_model, inner_step  # noqa: E402


def named_params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the ``f<i>.`` fragment prefix of `DiLoCoOuterLoop.global_parameters()` keys."""
    return {k.split(".", 1)[1]: v for k, v in state.items()}


def local_after(global_w: dict[str, torch.Tensor], rank: int, round_: int, h: int):
    model = build_model(0)
    model.load_state_dict({k: v.clone() for k, v in global_w.items()})
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    for i in range(h):
        inner_step(model, opt, rank, round_ * h + i)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_rounds(
    init: dict[str, torch.Tensor],
    *,
    ranks_per_round: list[list[int]],
    h: int,
    lr: float,
    momentum: float,
    nesterov: bool,
) -> list[dict[str, torch.Tensor]]:
    """Global weights after each round (index k = after k+1 rounds)."""
    g = {k: v.clone().float() for k, v in init.items()}
    buf: dict[str, torch.Tensor] = {}
    out = []
    for k, ranks in enumerate(ranks_per_round):
        locals_ = [local_after(g, r, k, h) for r in ranks]
        new = {}
        for name in g:
            grad = torch.stack([g[name] - loc[name] for loc in locals_]).mean(0)
            if momentum:
                buf[name] = grad.clone() if name not in buf else momentum * buf[name] + grad
                d = grad + momentum * buf[name] if nesterov else buf[name]
            else:
                d = grad
            new[name] = g[name] - lr * d
        g = new
        out.append({k: v.clone() for k, v in g.items()})
    return out
