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
from tolerances import gamma, tol


def reference_tol(init: dict[str, torch.Tensor], rounds: int, replicas: int) -> dict[str, float]:
    """How close a run's global weights are to `reference_rounds` (tests/tolerances.py): each
    outer step is about replicas + 7 fp32 roundings (the pseudo-gradient's subtraction, the
    k-term mean, momentum, Nesterov, lr * d, the update) of values no larger than the weights,
    and the h inner steps the reference replays from weights that differ by that much end as
    close (SGD at INNER_LR moves this small model's weights by a small fraction of themselves per
    step: the map is near the identity). n = rounds * (replicas + 7), scale = the largest weight."""
    scale = max(float(t.abs().max()) for t in init.values())
    return tol(rounds * (replicas + 7), scale)


def adam_reference_tol(
    init: dict[str, torch.Tensor], rounds: int, replicas: int, h: int, lr: float
) -> dict[str, float]:
    """`reference_rounds_adam` vs the run: Adam divides each pseudo-gradient element by its own
    size, so the absolute rounding of that difference of weights (gamma * max|w|) becomes a
    relative error max|w| / |g| times larger; each round's update (at most ~lr per element) is
    off by lr times that, over `rounds` rounds. |g|: the smallest pseudo-gradient element of the
    first round (which must not be 0: the bound would say nothing)."""
    locals_ = [local_after(init, r, 0, h) for r in range(replicas)]
    g_min = min(
        float(torch.stack([init[n] - loc[n] for loc in locals_]).mean(0).abs().min()) for n in init
    )
    assert g_min > 0, "a zero pseudo-gradient element: the Adam bound needs |g| > 0"
    w_max = max(float(t.abs().max()) for t in init.values())
    return {"rtol": 0.0, "atol": rounds * lr * 2 * gamma(replicas + 12) * w_max / g_min}


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


def reference_rounds_adam(
    init: dict[str, torch.Tensor],
    *,
    ranks_per_round: list[list[int]],
    h: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> list[dict[str, torch.Tensor]]:
    """Global weights after each round with an outer Adam written out by hand (bias-corrected):
    m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2;  global <- global - lr m^ / (sqrt(v^) + eps)."""
    b1, b2 = betas
    g = {k: v.clone().double() for k, v in init.items()}
    m: dict[str, torch.Tensor] = {k: torch.zeros_like(v) for k, v in g.items()}
    v2: dict[str, torch.Tensor] = {k: torch.zeros_like(v) for k, v in g.items()}
    out = []
    for k, ranks in enumerate(ranks_per_round):
        locals_ = [local_after({n: t.float() for n, t in g.items()}, r, k, h) for r in ranks]
        t = k + 1
        for name in g:
            grad = torch.stack([g[name] - loc[name].double() for loc in locals_]).mean(0)
            m[name] = b1 * m[name] + (1 - b1) * grad
            v2[name] = b2 * v2[name] + (1 - b2) * grad * grad
            m_hat, v_hat = m[name] / (1 - b1**t), v2[name] / (1 - b2**t)
            g[name] = g[name] - lr * m_hat / (v_hat.sqrt() + eps)
        out.append({n: x.float() for n, x in g.items()})
    return out
