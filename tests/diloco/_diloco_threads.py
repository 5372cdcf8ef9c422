"""Run N DiLoCo replicas as threads of the test process (not collected).

Each replica has its own model, inner optimizer, real `ObjectStoreAllReduce` handle and
`ObjectStoreManager` on a shared ``file://`` / ``memory://`` prefix, so the real exchange
protocol runs; threads only save the process start-up cost of the multi-process tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from _diloco_worker import build_model, inner_step
from allreduce_handles import exchange
from torch import nn

from composer_replication.diloco import make_diloco_outer_loop
from composer_replication.exchange import ObjectStoreManager

# Model factories seed torch's *global* RNG; without this lock two threads interleave their
# draws and the initial weights (hence which round-0 state gets published) become a race.
_INIT_LOCK = threading.Lock()


def run_replicas(
    uri: str,
    world_size: int,
    *,
    rounds: int,
    h: int,
    outer_kw: dict[str, Any] | None = None,
    store_kw: dict[str, Any] | None = None,
    model_fn: Callable[[int], nn.Module] | None = None,
    step_fn: Callable[[nn.Module, torch.optim.Optimizer, int, int], float] | None = None,
    ranks: list[int] | None = None,
) -> dict[int, dict[str, Any]]:
    """Train `rounds` outer rounds on every rank; returns per rank: globals per round, outer."""
    results: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []
    model_fn = model_fn or (lambda r: build_model(100 + r))
    step_fn = step_fn or inner_step

    def one(rank: int) -> None:
        try:
            with _INIT_LOCK:
                model = model_fn(rank)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            kw = {"timeout_s": 30.0, "poll_interval_s": 0.01, **(store_kw or {})}
            store = exchange(uri, world_size=world_size, rank=rank, **kw)
            outer = make_diloco_outer_loop(
                opt, ObjectStoreManager(store), h, model=model, **(outer_kw or {})
            )
            globals_ = {outer.round: outer.global_parameters()}
            with outer:
                while outer.round < rounds:
                    step_fn(model, opt, rank, outer.round * h + outer.local_step)
                    if outer.round not in globals_:
                        globals_[outer.round] = outer.global_parameters()
            results[rank] = {"globals": globals_, "outer": outer, "model": model}
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in (ranks or range(world_size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results
