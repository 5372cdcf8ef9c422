"""One DiLoCo replica process for the multi-process tests (run as a script, not collected).

A tiny MLP regression trained with plain SGD on data that is a pure function of
(rank, round, inner step), so the test process can recompute every replica's inner loop and the
outer step independently. After the initial sync and after every committed round the replica
writes its global weights to ``OUT/rank{r}_round{k}.safetensors`` (and its exchange history to
``OUT/rank{r}_history.json`` at the end).

Modes: ``store`` (ObjectStoreManager over --uri) and ``torchft`` (real Manager + --lighthouse).
Fault injection: ``--exit-at ROUND,STEP`` hard-exits (os._exit) at that inner step of that round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

IN, HID, OUT_DIM = 6, 12, 3
INNER_LR = 0.05


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT_DIM))


def batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch of global inner step t for `rank` (t = round * H + local step)."""
    g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + t)
    x = torch.randn(16, IN, generator=g)
    w = torch.linspace(-1.0, 1.0, IN * OUT_DIM).view(IN, OUT_DIM)
    y = torch.sin(x @ w) + 0.1 * (rank + 1)
    return x, y


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, t: int) -> float:
    x, y = batch(rank, t)
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["store", "torchft"], default="store")
    ap.add_argument("--uri", default="")
    ap.add_argument("--storage-options", default="{}")
    ap.add_argument("--lighthouse", default="")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--min-replicas", type=int, default=None)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--h", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--density", type=float, default=0.02, help="codec sparseloco")
    ap.add_argument("--chunk", type=int, default=4096, help="codec sparseloco")
    ap.add_argument("--bits", type=int, default=2, help="codec sparseloco")
    ap.add_argument("--ef-decay", type=float, default=0.95, help="codec sparseloco")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--nesterov", type=int, default=1)
    ap.add_argument("--init-seed", type=int, default=None, help="default: 100 + rank")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--exit-at", default="")
    ap.add_argument(
        "--until-all-included",
        action="store_true",
        help="after --rounds, keep going until a committed round includes every rank",
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from composer_replication.diloco import make_diloco_outer_loop
    from composer_replication.diloco.outer_optimizer import OuterOptimizerConfig

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(a.init_seed if a.init_seed is not None else 100 + a.rank)
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    close = None
    manager: Any
    if a.mode == "store":
        from composer_replication.exchange import AllReduceConfig, MockManager, ObjectStoreAllReduce
        from composer_replication.exchange.sparse import SparseSpec

        spec = SparseSpec(density=a.density, chunk=a.chunk, bits=a.bits)
        rendezvous = ObjectStoreAllReduce(
            uri=a.uri,
            world_size=a.world_size,
            rank=a.rank,
            config=AllReduceConfig(
                timeout_s=a.timeout,
                codec=a.codec,
                min_replicas=a.min_replicas,
                poll_interval_s=0.05,
                sparse=spec,
            ),
            storage_options=json.loads(a.storage_options),
        )
        manager = MockManager(allreduce=rendezvous)
        if a.codec == "sparseloco":
            from composer_replication.diloco.sparseloco import ErrorFeedbackManager

            manager = ErrorFeedbackManager(manager, spec, decay=a.ef_decay)
    else:
        from composer_replication.diloco.torchft.torchft_path import (
            TorchFTTimeouts,
            build_torchft_manager,
        )

        manager = build_torchft_manager(
            replica_id=f"replica_{a.rank}",
            lighthouse_addr=a.lighthouse,
            min_replicas=a.min_replicas or a.world_size,
            timeouts=TorchFTTimeouts(
                process_group_s=20, operation_s=30, join_s=40, quorum_s=120, heartbeat_s=5
            ),
        )
        close = manager.close
    factory = None
    if a.codec == "sparseloco":
        from composer_replication.diloco.sparseloco import sparseloco_outer_optimizer

        factory = sparseloco_outer_optimizer(a.outer_lr)
    outer = make_diloco_outer_loop(
        opt,
        manager,
        a.h,
        model=model,
        outer=factory
        if factory is not None
        else OuterOptimizerConfig(
            outer_optimizer="nesterov" if a.nesterov else "sgd",
            outer_lr=a.outer_lr,
            outer_momentum=a.momentum,
        ),
    )
    exit_round, exit_step = (int(v) for v in a.exit_at.split(",")) if a.exit_at else (-1, -1)

    def dump(k: int) -> None:
        tensors = {n: t.contiguous() for n, t in outer.global_parameters().items()}
        save_file(tensors, str(out / f"rank{a.rank}_round{k}.safetensors"))

    def all_included() -> bool:
        done = [h for h in outer.history if h["committed"] and not h["healed"]]
        return bool(done) and done[-1]["included_ranks"] == list(range(a.world_size))

    def more() -> bool:
        if outer.round < a.rounds:
            return True
        return a.until_all_included and not all_included() and outer.round < 10 * a.rounds

    dump(outer.round)
    last = outer.round
    with outer:
        while more():
            if outer.round == exit_round and outer.local_step == exit_step:
                sys.stdout.flush()
                os._exit(3)
            inner_step(model, opt, a.rank, outer.round * a.h + outer.local_step)
            if a.step_sleep:
                time.sleep(a.step_sleep)
            if outer.round != last:
                last = outer.round
                dump(last)
    (out / f"rank{a.rank}_history.json").write_text(json.dumps(outer.history))
    if close is not None:
        close()


if __name__ == "__main__":
    main()
