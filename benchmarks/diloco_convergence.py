"""DiLoCo convergence benchmark: a small reproduction of the DiLoCo paper's Table 2.

A GPT-style byte-level causal LM (a few pre-norm transformer blocks, written out below) is
trained on the Python standard library's own source files (offline, real text), split into
train and eval *by file*. Compared, side by side in one run:

  (a) single  one replica, B sequences per step, S steps (the paper's baseline: the same steps
              as one DiLoCo replica, 1/k of the tokens);
  (a') single_equal_tokens  one replica, B per step, k*S steps (the same tokens as (b)/(c));
  (b) dp      the data-parallel equivalent: k*B per step (replica r's batch r of every step),
              S steps, gradients averaged every step;
  (c) diloco  k replicas, each B per step, S inner steps, pseudo-gradients exchanged every H
              steps through a real ObjectStoreAllReduce on file:// and an outer Nesterov step
              (lr 0.7, momentum 0.9). The k replicas are threads of this process, each with its
              own model, AdamW, store handle and ObjectStoreManager (the real protocol; threads
              only avoid k interpreter start-ups).

(b) and (c) see exactly the same tokens. Eval loss is mean cross-entropy (nats per byte) on held-
out files, on DiLoCo's global weights. Bytes: DiLoCo's are measured by the store (contribution
uploads + downloads, all replicas); DP's are what the same exchange pattern would move every step
(each replica uploads its fp32 gradient and downloads the k-1 others), so comm_ratio_vs_dp is
apples to apples (~H). Checkpoint uploads (the outer state published each round) are reported
separately.

    python benchmarks/diloco_convergence.py            # full (k=4, H=50), ~10 min on 2 cores
    python benchmarks/diloco_convergence.py --quick    # a smoke-sized run
    python benchmarks/diloco_convergence.py --codec sparseloco --sl-outer-lr 3   # (c) as SparseLoCo

Sweeps (each an extra run on the same warm start and tokens; the default run's point is reused):
``--sweep-h 10,25,50,100`` (DiLoCo at each H with the same S, so rounds = S / H),
``--sweep-outer-lr 0.4,0.7,1.0``, ``--sweep-diloco-lr`` (DiLoCo's inner lr),
``--sweep-batch 8,32,64,128`` (DP and DiLoCo at other per-replica batches, each a complete run
with its own warm start and token stream: the gap's dependence on the batch) and
``--sweep-dp-lr 1e-3,2e-3,4e-3`` (the data-parallel baseline's lr, so that it is tuned fairly;
the JSON then also has ``dp_best_lr`` and ``loss_gap_vs_best_dp``). With ``--sweep-batch``,
``--sweep-dp-lr`` and ``--sweep-diloco-lr`` are swept at EVERY batch: each batch's
``loss_gap_vs_dp`` is tuned DiLoCo (its best inner lr) against tuned data parallel (its best lr),
printed per batch (and as ``loss_gap_vs_dp_b<B>``); ``critical_batch`` is the first swept batch
from which the next larger one improves tuned DP's eval loss by less than ``--critical-gain``
(1% by default: data parallel has stopped gaining from a larger batch), with
``loss_gap_vs_dp_at_critical_batch`` (``critical_batch_reached`` false: DP still gained at the
largest batch, which is then reported).

``--sweep-outer-momentum 0.8,0.9,0.95`` adds a grid at ``--batch``: DiLoCo at every outer lr of
``--sweep-outer-lr`` (or ``--outer-lr``) times every outer momentum of the list, each at
DiLoCo's best inner lr of ``--sweep-diloco-lr`` (or ``--lr``), on the default run's warm start
and tokens. Each cell's ``loss_gap_vs_dp`` is against tuned data parallel (its best lr of
``--sweep-dp-lr``); the JSON has the cells (``sweeps.outer_grid``), the best cell
(``best_outer_lr``, ``best_outer_momentum``, ``best_outer_eval_loss``) and its
``loss_gap_vs_dp_at_best_outer``, with ``outer_grid_batch`` / ``_lrs`` / ``_momenta`` /
``_inner_lr`` / ``_dp_lr`` / ``_dp_eval_loss``. At the critical batch (``--batch 256``, k = 4,
scripts/gpu-check.sh's diloco phase) this is the outer step's tuning.

``--device cuda`` trains every model on the GPU (the corpus, every batch and the evaluation live
there; DiLoCo's replicas are threads sharing the device, their pseudo-gradients still go through
the object store, whose codecs move them to the CPU and back). The token streams are the same on
every device (a CPU generator picks the windows). With any sweep the result is
written to ``--out`` (default docs/diloco_convergence.json) and a plot of eval loss against bytes
communicated (like the DiLoCo paper's figures) next to it (.png; needs matplotlib, the
``report`` extra). ``--outer-warmup R`` ramps the outer lr linearly over the first R rounds.

    python benchmarks/diloco_convergence.py --sweep-h 10,25,50,100
    python benchmarks/diloco_convergence.py --device cuda --sweep-batch 128,256,512 \
        --sweep-dp-lr 1e-3,2e-3,4e-3 --sweep-diloco-lr 1e-3,2e-3,4e-3

With ``--codec sparseloco`` (c) is SparseLoCo (error feedback, plain SGD outer step at
``--sl-outer-lr``; ``--sl-density/--sl-chunk/--sl-bits/--sl-ef-decay``); benchmarks/sparseloco.py
runs it beside fp32 DiLoCo on the same tokens.

Last line: JSON with single_eval_loss, dp_eval_loss, diloco_eval_loss, loss_gap_vs_dp
(relative, positive = worse than DP), comm_ratio_vs_dp, and the other figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- data


def load_corpus(max_train_bytes: int, max_eval_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stdlib .py files (no site-packages, no tests), sorted; ~1 in 10 files held out by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
    train, evals = bytearray(), bytearray()
    for p in files:
        rel = str(p.relative_to(root))
        held_out = zlib.crc32(rel.encode()) % 10 == 0
        buf = evals if held_out else train
        cap = max_eval_bytes if held_out else max_train_bytes
        if len(buf) < cap:
            try:
                buf.extend(p.read_bytes()[: cap - len(buf)])
            except OSError:
                continue
        if len(train) >= max_train_bytes and len(evals) >= max_eval_bytes:
            break
    if len(train) < 10_000 or len(evals) < 2_000:
        raise RuntimeError(f"stdlib corpus too small under {root}")
    return (
        torch.frombuffer(train, dtype=torch.uint8).long(),
        torch.frombuffer(evals, dtype=torch.uint8).long(),
    )


class Batches:
    """Replica r's batch at step t: B random windows, a pure function of (seed, r, t), drawn by a
    CPU generator (the same windows on every device) from the corpus on ``data``'s device."""

    def __init__(self, data: torch.Tensor, batch: int, ctx: int, seed: int) -> None:
        self.data, self.batch, self.ctx, self.seed = data, batch, ctx, seed

    def get(self, replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + replica * 100_003 + step)
        starts = torch.randint(0, len(self.data) - self.ctx - 1, (self.batch,), generator=g)
        idx = starts[:, None] + torch.arange(self.ctx + 1)
        seq = self.data[idx.to(self.data.device)]
        return seq[:, :-1], seq[:, 1:]


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Byte-level GPT: token + position embeddings, pre-norm blocks, tied output head."""

    def __init__(self, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.01)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.layers:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.t()


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


@torch.no_grad()
def eval_loss(model: nn.Module, data: torch.Tensor, ctx: int, n_seq: int) -> float:
    model.eval()
    stride = max(1, (len(data) - ctx - 1) // n_seq)
    starts = torch.arange(n_seq, device=data.device) * stride
    seq = data[starts[:, None] + torch.arange(ctx + 1, device=data.device)]
    total = 0.0
    for i in range(0, n_seq, 32):
        total += float(loss_of(model, seq[i : i + 32, :-1], seq[i : i + 32, 1:])) * len(
            seq[i : i + 32]
        )
    model.train()
    return total / n_seq


# --------------------------------------------------------------------------- runs


class Cfg:
    def __init__(self, a: argparse.Namespace) -> None:
        self.__dict__.update(vars(a))

    start: dict[str, torch.Tensor] | None = None  # the shared pretrained checkpoint
    outer_warmup: int = 0  # rounds of outer-lr warm-up (callers without the flag: none)
    device: str = "cpu"  # where every model trains (--device)

    def model(self) -> TinyGPT:
        torch.manual_seed(self.seed)
        m = TinyGPT(self.d_model, self.layers, self.heads, self.ctx)  # initialised on the CPU
        if self.start is not None:
            m.load_state_dict(self.start)
        return m.to(self.device)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            model.parameters(), lr=self.lr, weight_decay=0.1, betas=(0.9, 0.95)
        )

    def outer_lr_at(self, round_: int) -> float:
        return outer_lr_at(self, round_)

    def lr_at(self, step: int) -> float:
        warm = max(1, self.steps // 20)
        if step < warm:
            return self.lr * (step + 1) / warm
        frac = (step - warm) / max(1, self.steps - warm)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def outer_lr_in_use(cfg: Cfg | argparse.Namespace) -> float:
    """The variant's outer lr: --sl-outer-lr for codec 'sparseloco' (its plain SGD outer step),
    else --outer-lr (DiLoCo's Nesterov step)."""
    return float(cfg.sl_outer_lr if cfg.codec == "sparseloco" else cfg.outer_lr)


def outer_lr_at(cfg: Cfg, round_: int) -> float:
    """--outer-warmup R: the outer lr rises linearly over the first R rounds (0: constant)."""
    base = outer_lr_in_use(cfg)
    if cfg.outer_warmup <= 0:
        return base
    return base * min(1.0, (round_ + 1) / cfg.outer_warmup)


def train_single(cfg: Cfg, batches: Batches, steps: int, schedule_steps: int) -> nn.Module:
    """One replica; step t uses replica (t mod k)'s batch (t div k), i.e. the DP/DiLoCo tokens
    in order when steps = k * S, and replica 0's stream when steps = S and k = 1."""
    model, k = cfg.model(), cfg.k if steps > cfg.steps else 1
    opt = cfg.optimizer(model)
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(t * schedule_steps // steps)
        x, y = batches.get(t % k, t // k)
        loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


def pretrain(cfg: Cfg, batches: Batches) -> dict[str, torch.Tensor]:
    """The shared starting checkpoint: k*B per step on a stream no variant uses afterwards.

    Like the paper's Table 2, which starts every variant from the same pretrained model (DiLoCo's
    outer Nesterov step on a randomly initialised network is a different, harder regime).
    """
    model = cfg.model()
    opt = cfg.optimizer(model)
    n = cfg.pretrain_steps
    for t in range(n):
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (t + 1) / max(1, n // 10))
        xs, ys = zip(*(batches.get(1000 + r, t) for r in range(cfg.k)))
        loss = loss_of(model, torch.cat(xs), torch.cat(ys))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_dp(cfg: Cfg, batches: Batches) -> nn.Module:
    """k*B per step: the concatenation of every replica's batch of that step."""
    model = cfg.model()
    opt = cfg.optimizer(model)
    for t in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(t)
        xs, ys = zip(*(batches.get(r, t) for r in range(cfg.k)))
        loss = loss_of(model, torch.cat(xs), torch.cat(ys))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


def sparse_spec(cfg: Cfg) -> Any:
    """codec 'sparseloco': what each replica sends (--sl-density, --sl-chunk, --sl-bits)."""
    from composer_replication.exchange.sparse import SparseSpec

    if cfg.codec != "sparseloco":
        return None
    return SparseSpec(density=cfg.sl_density, chunk=cfg.sl_chunk, bits=cfg.sl_bits)


def error_feedback(cfg: Cfg, manager: Any) -> Any:
    """codec 'sparseloco': SparseLoCo's error feedback (decay --sl-ef-decay) around manager."""
    if cfg.codec != "sparseloco":
        return manager
    from composer_replication.diloco.sparseloco import ErrorFeedbackManager

    return ErrorFeedbackManager(manager, sparse_spec(cfg), decay=cfg.sl_ef_decay)


def outer_factory(cfg: Cfg) -> Any:
    """codec 'sparseloco': plain SGD at --sl-outer-lr (no momentum); else DiLoCo's Nesterov at
    --outer-lr / --outer-momentum."""
    if cfg.codec != "sparseloco":
        from composer_replication.diloco.outer_optimizer import OuterOptimizerConfig

        return OuterOptimizerConfig(outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum)
    from composer_replication.diloco.sparseloco import sparseloco_outer_optimizer

    return sparseloco_outer_optimizer(cfg.sl_outer_lr)


def train_diloco(cfg: Cfg, batches: Batches, uri: str) -> tuple[nn.Module, dict[str, int]]:
    from composer_replication.diloco import make_diloco_outer_loop
    from composer_replication.exchange import (
        AllReduceConfig,
        ObjectStoreAllReduce,
        ObjectStoreManager,
    )

    results: dict[int, tuple[nn.Module, ObjectStoreManager]] = {}
    errors: list[BaseException] = []
    stores: list[ObjectStoreAllReduce] = []

    def replica(rank: int) -> None:
        try:
            model = cfg.model()
            opt = cfg.optimizer(model)
            store = ObjectStoreAllReduce(
                uri,
                world_size=cfg.k,
                rank=rank,
                config=AllReduceConfig(timeout_s=1800.0, codec=cfg.codec, sparse=sparse_spec(cfg)),
            )
            stores.append(store)
            manager = ObjectStoreManager(store)
            outer = make_diloco_outer_loop(
                opt,
                error_feedback(cfg, manager),
                cfg.h,
                model=model,
                outer=outer_factory(cfg),
            )
            with outer:
                for t in range(cfg.steps):
                    for g in opt.param_groups:
                        g["lr"] = cfg.lr_at(t)
                    if t % cfg.h == 0:  # the outer step that ends this round uses this lr
                        for oopt in outer.outer_optimizers:
                            for g in oopt.param_groups:
                                g["lr"] = cfg.outer_lr_at(t // cfg.h)
                    x, y = batches.get(rank, t)
                    loss = loss_of(model, x, y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            outer.load_global_weights()
            results[rank] = (model, manager)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            for other in stores:  # the peers would wait timeout_s for this replica otherwise
                other.cancel()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(cfg.k)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    model0 = results[0][0]
    for r in range(1, cfg.k):
        for p, q in zip(model0.parameters(), results[r][0].parameters()):
            if not torch.equal(p, q):
                raise RuntimeError(f"replica {r} ended with different global weights")
    managers = [m for _, m in results.values()]
    comm = {
        "bytes_uploaded": sum(m.bytes_uploaded for m in managers),
        "bytes_downloaded": sum(m.bytes_downloaded for m in managers),
        "checkpoint_bytes": sum(m.checkpoint_bytes for m in managers),
        "rounds": managers[0].current_step(),
    }
    return model0, comm


# --------------------------------------------------------------------------- sweeps


def parse_list(text: str, kind: type, flag: str) -> list[Any]:
    """'10,25,50' -> [10, 25, 50]; a clear error naming the flag otherwise."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(
            f"{flag}: expected comma-separated {kind.__name__}s, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"{flag}: expected positive values, got {text!r}")
    return values


def parse_momenta(text: str, flag: str) -> list[float]:
    """Outer momenta: in (0, 1) (Nesterov needs a momentum; 1 never forgets)."""
    values = parse_list(text, float, flag)
    if any(v >= 1 for v in values):
        raise SystemExit(f"{flag}: expected momenta in (0, 1), got {text!r}")
    return values


def outer_grid(
    cfg: Cfg,
    batches: Batches,
    evals: torch.Tensor,
    outer_lrs: list[float],
    momenta: list[float],
    inner_lr: float,
    dp: dict[float, float],
    done: list[dict[str, Any]],
) -> dict[str, Any]:
    """DiLoCo at every (outer lr, outer momentum) of the grid, at inner lr ``inner_lr`` (DiLoCo's
    best) and the run's batch, H and tokens; each cell's ``loss_gap_vs_dp`` against tuned data
    parallel (``dp``: lr -> eval loss, its best taken). A cell whose settings a run in ``done``
    already had (same H, inner lr, outer lr and momentum) reuses its eval loss. Returns the cells
    and the best one (lowest eval loss): ``best_outer_lr``, ``best_outer_momentum``,
    ``loss_gap_vs_dp_at_best_outer``."""
    dp_lr = min(dp, key=lambda lr: dp[lr])
    best_dp = dp[dp_lr]
    cells = []
    for olr in outer_lrs:
        for mom in momenta:
            point = next(
                (
                    p
                    for p in done
                    if (p["h"], p["lr"], p["outer_lr"], p["outer_momentum"], p["outer_warmup"])
                    == (cfg.h, inner_lr, olr, mom, cfg.outer_warmup)
                ),
                None,
            )
            if point is None:
                point = diloco_point(
                    cfg, batches, evals, lr=inner_lr, outer_lr=olr, outer_momentum=mom
                )
            cells.append(
                {
                    "outer_lr": olr,
                    "outer_momentum": mom,
                    "lr": inner_lr,
                    "eval_loss": point["eval_loss"],
                    "loss_gap_vs_dp": round((point["eval_loss"] - best_dp) / best_dp, 5),
                    "seconds": point["seconds"],
                }
            )
    best = min(cells, key=lambda c: c["eval_loss"])
    print(
        f"  outer grid at batch {cfg.batch} (inner lr {inner_lr:g}; DP {best_dp:.4f} at lr "
        f"{dp_lr:g}): best outer lr {best['outer_lr']:g}, momentum {best['outer_momentum']:g}: "
        f"{best['eval_loss']:.4f}, loss_gap_vs_dp {100 * best['loss_gap_vs_dp']:+.2f}%",
        flush=True,
    )
    return {
        "cells": cells,
        "outer_grid_batch": cfg.batch,
        "outer_grid_lrs": list(outer_lrs),
        "outer_grid_momenta": list(momenta),
        "outer_grid_inner_lr": inner_lr,
        "outer_grid_dp_lr": dp_lr,
        "outer_grid_dp_eval_loss": round(best_dp, 5),
        "best_outer_lr": best["outer_lr"],
        "best_outer_momentum": best["outer_momentum"],
        "best_outer_eval_loss": best["eval_loss"],
        "loss_gap_vs_dp_at_best_outer": best["loss_gap_vs_dp"],
    }


def diloco_point(cfg: Cfg, batches: Batches, evals: torch.Tensor, **changes: Any) -> dict[str, Any]:
    """One DiLoCo run with some settings changed (h keeps S = rounds * H fixed)."""
    import copy

    c = copy.copy(cfg)
    for key, value in changes.items():
        setattr(c, key, value)
    if c.steps % c.h:
        raise SystemExit(f"--sweep-h: H={c.h} does not divide S={c.steps} inner steps")
    c.rounds = c.steps // c.h
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        m, comm = train_diloco(c, batches, "file://" + os.path.join(tmp, "run"))
    point = {
        "h": c.h,
        "outer_lr": outer_lr_in_use(c),
        "outer_momentum": c.outer_momentum,
        "lr": c.lr,
        "outer_warmup": c.outer_warmup,
        "rounds": comm["rounds"],
        "eval_loss": round(eval_loss(m, evals, c.ctx, c.eval_seqs), 5),
        "bytes": comm["bytes_uploaded"] + comm["bytes_downloaded"],
        "seconds": round(time.time() - t0, 1),
    }
    print(f"  diloco {changes}: {json.dumps(point)}", flush=True)
    return point


def dp_point(cfg: Cfg, batches: Batches, evals: torch.Tensor, lr: float) -> dict[str, Any]:
    """One data-parallel run at inner lr `lr` (same tokens, optimizer and schedule shape)."""
    import copy

    c = copy.copy(cfg)
    c.lr = lr
    t0 = time.time()
    m = train_dp(c, batches)
    point = {
        "lr": lr,
        "eval_loss": round(eval_loss(m, evals, c.ctx, c.eval_seqs), 5),
        "seconds": round(time.time() - t0, 1),
    }
    print(f"  dp lr={lr}: {json.dumps(point)}", flush=True)
    return point


def batch_record(
    batch: int,
    start: float,
    dp: dict[float, float],
    di: dict[float, float],
    seconds: float,
) -> dict[str, Any]:
    """One point of ``--sweep-batch``: at per-replica batch ``batch``, the eval loss of data
    parallel and of DiLoCo at each inner lr tried (``dp`` / ``di``: lr -> eval loss), the best of
    each, and ``loss_gap_vs_dp``: tuned DiLoCo against tuned data parallel."""
    dp_lr = min(dp, key=lambda lr: dp[lr])
    di_lr = min(di, key=lambda lr: di[lr])
    best_dp, best_di = dp[dp_lr], di[di_lr]
    return {
        "batch": batch,
        "start_eval_loss": round(start, 5),
        "dp_eval_loss": round(best_dp, 5),
        "dp_best_lr": dp_lr,
        "diloco_eval_loss": round(best_di, 5),
        "diloco_best_lr": di_lr,
        "loss_gap_vs_dp": round((best_di - best_dp) / best_dp, 5),
        "dp_lr": [{"lr": lr, "eval_loss": round(v, 5)} for lr, v in sorted(dp.items())],
        "diloco_lr": [{"lr": lr, "eval_loss": round(v, 5)} for lr, v in sorted(di.items())],
        "seconds": round(seconds, 1),
    }


def print_batch(point: dict[str, Any]) -> None:
    print(
        f"  batch {point['batch']}: DP {point['dp_eval_loss']:.4f} (lr {point['dp_best_lr']:g}), "
        f"DiLoCo {point['diloco_eval_loss']:.4f} (lr {point['diloco_best_lr']:g}), "
        f"loss_gap_vs_dp {100 * point['loss_gap_vs_dp']:+.2f}%  {json.dumps(point)}",
        flush=True,
    )


def batch_point(
    cfg: Cfg,
    train: torch.Tensor,
    evals: torch.Tensor,
    batch: int,
    dp_lrs: list[float],
    diloco_lrs: list[float],
) -> dict[str, Any]:
    """DP and DiLoCo at another per-replica batch B, each at every inner lr of its list: its own
    warm start (``pretrain_steps`` at k*B, at ``--lr``) and token stream, so each B is a complete
    run, tuned on the same grid for both."""
    import copy

    c = copy.copy(cfg)
    c.batch = batch
    t0 = time.time()
    batches = Batches(train, batch, c.ctx, c.seed)
    c.start = pretrain(c, batches)
    start = eval_loss(c.model(), evals, c.ctx, c.eval_seqs)
    dp: dict[float, float] = {}
    di: dict[float, float] = {}
    for lr in dp_lrs:
        c.lr = lr
        dp[lr] = eval_loss(train_dp(c, batches), evals, c.ctx, c.eval_seqs)
    for lr in diloco_lrs:
        c.lr = lr
        with tempfile.TemporaryDirectory() as tmp:
            m, _ = train_diloco(c, batches, "file://" + os.path.join(tmp, "run"))
        di[lr] = eval_loss(m, evals, c.ctx, c.eval_seqs)
    point = batch_record(batch, start, dp, di, time.time() - t0)
    print_batch(point)
    return point


def critical_batch(points: list[dict[str, Any]], gain: float) -> tuple[dict[str, Any], bool]:
    """The batch where data parallel stops gaining from a larger one: the first swept batch
    (ascending) from which the next improves tuned DP's eval loss by less than ``gain``
    (relative); (the largest batch, False) when every step up still gained that much. Sets each
    point's ``dp_gain_vs_previous`` (None for the smallest)."""
    pts = sorted(points, key=lambda p: p["batch"])
    pts[0]["dp_gain_vs_previous"] = None
    for prev, this in zip(pts, pts[1:]):
        this["dp_gain_vs_previous"] = round(
            (prev["dp_eval_loss"] - this["dp_eval_loss"]) / prev["dp_eval_loss"], 5
        )
    for this, nxt in zip(pts, pts[1:]):
        if nxt["dp_gain_vs_previous"] < gain:
            return this, True
    return pts[-1], False


def plot_sweeps(result: dict[str, Any], path: Path) -> None:
    """Eval loss against bytes communicated (log x), like the DiLoCo paper's figures."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise SystemExit(
            "the sweep plot needs matplotlib: pip install 'composer-replication[report]'"
        ) from exc
    sweeps = result["sweeps"]
    by_batch = sorted(sweeps.get("batch") or [], key=lambda p: p["batch"])
    fig = Figure(figsize=(12 if by_batch else 7, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    if by_batch:
        ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [7, 5]})
        bx.plot(
            [p["batch"] for p in by_batch],
            [100 * p["loss_gap_vs_dp"] for p in by_batch],
            "o-",
            color="C3",
        )
        for p in by_batch:
            bx.annotate(
                f"{100 * p['loss_gap_vs_dp']:.1f}%",
                (p["batch"], 100 * p["loss_gap_vs_dp"]),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=8,
            )
        bx.axhline(2.0, color="gray", linestyle="--", linewidth=1, label="2% target")
        bx.set_xscale("log", base=2)
        bx.set_xlabel("sequences per replica per step (B; DP steps on k*B)")
        bx.set_ylabel("DiLoCo eval loss above DP (%)")
        bx.set_title(f"gap vs per-replica batch (k={result['k']}, H={result['h']})")
        bx.grid(alpha=0.3, which="both")
        bx.legend(fontsize=7)
    else:
        ax = fig.subplots()
    if sweeps.get("h"):
        pts = sorted(sweeps["h"], key=lambda p: p["bytes"])
        ax.plot(
            [p["bytes"] for p in pts],
            [p["eval_loss"] for p in pts],
            "o-",
            color="C0",
            label=f"DiLoCo k={result['k']}, H sweep (outer lr {result['outer_lr']})",
        )
        for p in pts:
            ax.annotate(
                f"H={p['h']}",
                (p["bytes"], p["eval_loss"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
    if sweeps.get("outer_lr"):
        pts = sweeps["outer_lr"]
        ax.scatter(
            [p["bytes"] for p in pts],
            [p["eval_loss"] for p in pts],
            marker="s",
            color="C1",
            label=f"DiLoCo H={result['h']}, outer lr sweep",
            zorder=3,
        )
        for p in pts:
            ax.annotate(
                f"{p['outer_lr']}",
                (p["bytes"], p["eval_loss"]),
                textcoords="offset points",
                xytext=(6, -3),
                fontsize=8,
                color="C1",
            )
    ax.scatter(
        [result["diloco_bytes"]],
        [result["diloco_eval_loss"]],
        marker="*",
        s=160,
        color="C3",
        label=f"DiLoCo H={result['h']} (default run)",
        zorder=4,
    )
    ax.scatter(
        [result["dp_bytes"]],
        [result["dp_eval_loss"]],
        marker="D",
        color="k",
        label=f"data parallel (lr {result['lr']})",
        zorder=4,
    )
    if sweeps.get("dp_lr"):
        best = min(sweeps["dp_lr"], key=lambda p: p["eval_loss"])
        ax.scatter(
            [result["dp_bytes"]],
            [best["eval_loss"]],
            marker="D",
            facecolors="none",
            edgecolors="k",
            label=f"data parallel, best lr of sweep ({best['lr']})",
        )
    ax.axhline(
        result["single_eval_loss"],
        color="gray",
        linestyle="--",
        linewidth=1,
        label="single replica, 1/k tokens (no communication)",
    )
    ax.set_xscale("log")
    ax.set_xlabel("bytes communicated (all replicas, whole run)")
    ax.set_ylabel("eval loss (nats/byte)")
    ax.set_title(f"DiLoCo vs data parallel, same {result['tokens_dp_diloco']:,} tokens")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


# --------------------------------------------------------------------------- main


def add_sparseloco_args(ap: argparse.ArgumentParser) -> None:
    """--sl-*: codec 'sparseloco' settings (defaults: the run config's, docs/cli.md)."""
    from composer_replication.config.schema import DilocoConfig

    d = DilocoConfig().sparseloco
    ap.add_argument("--sl-density", type=float, default=d.sparseloco_density)
    ap.add_argument("--sl-chunk", type=int, default=d.sparseloco_chunk)
    ap.add_argument("--sl-bits", type=int, default=d.sparseloco_bits)
    ap.add_argument("--sl-ef-decay", type=float, default=d.sparseloco_ef_decay)
    ap.add_argument("--sl-outer-lr", type=float, default=d.sparseloco_outer_lr)


def main() -> None:
    ap = argparse.ArgumentParser(description="DiLoCo vs single vs data-parallel (Table 2)")
    ap.add_argument("--quick", action="store_true", help="small smoke-sized run")
    ap.add_argument("--k", type=int, default=4, help="replicas")
    ap.add_argument("--h", type=int, default=50, help="inner steps per outer round")
    ap.add_argument("--rounds", type=int, default=8, help="outer rounds (S = rounds * H)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per replica per step (B)")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seqs", type=int, default=256)
    ap.add_argument("--codec", default="fp32", help="pseudo-gradient wire codec for (c)")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    add_sparseloco_args(ap)
    ap.add_argument(
        "--only-diloco", action="store_true", help="tuning aid: run only (c), print its loss"
    )
    ap.add_argument("--pretrain-steps", type=int, default=150, help="shared warm start")
    ap.add_argument(
        "--outer-warmup",
        type=int,
        default=0,
        help="rounds over which the outer lr rises linearly (0: constant)",
    )
    ap.add_argument(
        "--sweep-h",
        default="",
        help="extra DiLoCo runs at these H (e.g. 10,25,50,100), same S = rounds * H",
    )
    ap.add_argument(
        "--sweep-outer-lr",
        default="",
        help="extra DiLoCo runs at --h with these outer lrs (e.g. 0.4,0.7,1.0)",
    )
    ap.add_argument(
        "--sweep-outer-momentum",
        default="",
        help="with it, a grid: DiLoCo at --batch at every (outer lr of --sweep-outer-lr, or "
        "--outer-lr) x (outer momentum of this list), at its tuned inner lr, each cell's gap "
        "to tuned data parallel (e.g. 0.8,0.9,0.95)",
    )
    ap.add_argument(
        "--sweep-dp-lr",
        default="",
        help="extra data-parallel runs at these inner lrs (e.g. 1e-3,2e-3,4e-3)",
    )
    ap.add_argument(
        "--sweep-batch",
        default="",
        help="comma-separated per-replica batches: DP and DiLoCo at each, own warm start",
    )
    ap.add_argument(
        "--sweep-diloco-lr", default="", help="extra DiLoCo runs at --h with these inner lrs"
    )
    ap.add_argument(
        "--out",
        default="docs/diloco_convergence.json",
        help="with a sweep: write the result JSON here and the plot next to it (.png)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: OpenMP spin-waiting makes 2 threads ~9x slower on a "
        "loaded 2-core machine; the DiLoCo replicas are threads anyway)",
    )
    ap.add_argument(
        "--critical-gain",
        type=float,
        default=0.01,
        help="--sweep-batch: relative DP improvement below which a larger batch no "
        "longer gains (the critical batch)",
    )
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where models train")
    a = ap.parse_args()
    try:
        device = torch.device(a.device)
    except RuntimeError:
        raise SystemExit(f"--device: {a.device!r} is not a torch device (cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device cuda: torch {torch.__version__} sees no CUDA device (use --device cpu)"
        )
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device: {a.device!r} (cpu or cuda)")
    sweep_h = parse_list(a.sweep_h, int, "--sweep-h") if a.sweep_h else []
    sweep_olr = parse_list(a.sweep_outer_lr, float, "--sweep-outer-lr") if a.sweep_outer_lr else []
    sweep_dp = parse_list(a.sweep_dp_lr, float, "--sweep-dp-lr") if a.sweep_dp_lr else []
    sweep_dl = (
        parse_list(a.sweep_diloco_lr, float, "--sweep-diloco-lr") if a.sweep_diloco_lr else []
    )
    sweep_b = parse_list(a.sweep_batch, int, "--sweep-batch") if a.sweep_batch else []
    sweep_om = (
        parse_momenta(a.sweep_outer_momentum, "--sweep-outer-momentum")
        if a.sweep_outer_momentum
        else []
    )
    if sweep_om and a.codec == "sparseloco":
        raise SystemExit("--sweep-outer-momentum: codec 'sparseloco' has no outer momentum")
    if a.quick:
        a.h, a.rounds, a.eval_seqs, a.pretrain_steps = 10, 3, 64, 30
    if a.threads:
        torch.set_num_threads(a.threads)
    a.steps = a.rounds * a.h
    a.device = str(device)
    cfg = Cfg(a)
    t_start = time.time()
    train, evals = load_corpus(max_train_bytes=8_000_000, max_eval_bytes=600_000)
    train, evals = train.to(device), evals.to(device)
    batches = Batches(train, a.batch, a.ctx, a.seed)
    n_params = sum(p.numel() for p in cfg.model().parameters())
    tokens_per_replica = a.steps * a.batch * a.ctx
    print(
        f"corpus: {len(train):,} train bytes, {len(evals):,} eval bytes (stdlib, split by file); "
        f"model {n_params:,} params; k={a.k} H={a.h} rounds={a.rounds} steps={a.steps} "
        f"B={a.batch} ctx={a.ctx}; device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        flush=True,
    )
    t0 = time.time()
    cfg.start = pretrain(cfg, batches)
    start_loss = eval_loss(cfg.model(), evals, a.ctx, a.eval_seqs)
    timings = {"pretrain": time.time() - t0}
    print(
        f"pretrained {a.pretrain_steps} steps ({timings['pretrain']:.0f}s): eval loss "
        f"{start_loss:.4f}",
        flush=True,
    )
    rows = {}
    if a.only_diloco:
        with tempfile.TemporaryDirectory() as tmp:
            m, comm = train_diloco(cfg, batches, "file://" + os.path.join(tmp, "run"))
        loss = eval_loss(m, evals, a.ctx, a.eval_seqs)
        nbytes = comm["bytes_uploaded"] + comm["bytes_downloaded"]
        print(
            json.dumps(
                {
                    "diloco_eval_loss": round(loss, 5),
                    "diloco_bytes": nbytes,
                    "codec": a.codec,
                    "outer_lr": outer_lr_in_use(a),
                    "outer_momentum": a.outer_momentum,
                }
            )
        )
        return

    t0 = time.time()
    m = train_single(cfg, batches, a.steps, a.steps)
    rows["single"] = (eval_loss(m, evals, a.ctx, a.eval_seqs), tokens_per_replica, 0)
    timings["single"] = time.time() - t0
    print(f"(a) single done in {timings['single']:.0f}s", flush=True)

    t0 = time.time()
    m = train_single(cfg, batches, a.k * a.steps, a.steps)
    rows["single_equal_tokens"] = (
        eval_loss(m, evals, a.ctx, a.eval_seqs),
        a.k * tokens_per_replica,
        0,
    )
    timings["single_equal_tokens"] = time.time() - t0
    print(f"(a') single, equal tokens done in {timings['single_equal_tokens']:.0f}s", flush=True)

    t0 = time.time()
    m = train_dp(cfg, batches)
    param_bytes = n_params * 4
    dp_bytes = a.steps * a.k * (param_bytes + (a.k - 1) * param_bytes)
    rows["dp"] = (eval_loss(m, evals, a.ctx, a.eval_seqs), a.k * tokens_per_replica, dp_bytes)
    timings["dp"] = time.time() - t0
    print(f"(b) data-parallel done in {timings['dp']:.0f}s", flush=True)

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        m, comm = train_diloco(cfg, batches, "file://" + os.path.join(tmp, "run"))
    diloco_bytes = comm["bytes_uploaded"] + comm["bytes_downloaded"]
    rows["diloco"] = (
        eval_loss(m, evals, a.ctx, a.eval_seqs),
        a.k * tokens_per_replica,
        diloco_bytes,
    )
    timings["diloco"] = time.time() - t0
    print(f"(c) DiLoCo done in {timings['diloco']:.0f}s ({comm['rounds']} rounds)", flush=True)

    print()
    print(f"{'variant':<22}{'eval loss':>10}{'tokens':>14}{'bytes communicated':>22}")
    for name, (loss, tok, nbytes) in rows.items():
        print(f"{name:<22}{loss:>10.4f}{tok:>14,}{nbytes:>22,}")
    print(
        f"DiLoCo checkpoint uploads (outer state, not in the ratio): {comm['checkpoint_bytes']:,}"
    )
    dp_loss, di_loss = rows["dp"][0], rows["diloco"][0]
    result = {
        "start_eval_loss": round(start_loss, 5),
        "single_eval_loss": round(rows["single"][0], 5),
        "single_equal_tokens_eval_loss": round(rows["single_equal_tokens"][0], 5),
        "dp_eval_loss": round(dp_loss, 5),
        "diloco_eval_loss": round(di_loss, 5),
        "loss_gap_vs_dp": round((di_loss - dp_loss) / dp_loss, 5),
        "comm_ratio_vs_dp": round(rows["dp"][2] / diloco_bytes, 2),
        "dp_bytes": rows["dp"][2],
        "diloco_bytes": diloco_bytes,
        "diloco_checkpoint_bytes": comm["checkpoint_bytes"],
        "k": a.k,
        "h": a.h,
        "batch": a.batch,
        "codec": a.codec,
        "rounds": a.rounds,
        "pretrain_steps": a.pretrain_steps,
        "params": n_params,
        "tokens_dp_diloco": a.k * tokens_per_replica,
        "seconds": round(time.time() - t_start, 1),
        "quick": bool(a.quick),
        "device": str(device),
    }
    if sweep_h or sweep_olr or sweep_dp or sweep_dl or sweep_b or sweep_om:
        print("sweeps (same tokens, same warm start; the default run's points are reused):")
        main_point = {
            "h": a.h,
            "outer_lr": outer_lr_in_use(a),
            "outer_momentum": a.outer_momentum,
            "lr": a.lr,
            "outer_warmup": a.outer_warmup,
            "rounds": comm["rounds"],
            "eval_loss": round(di_loss, 5),
            "bytes": diloco_bytes,
            "seconds": round(timings["diloco"], 1),
        }
        sweeps: dict[str, list[dict[str, Any]]] = {
            "h": [],
            "outer_lr": [],
            "dp_lr": [],
            "lr": [],
            "batch": [],
            "outer_grid": [],
        }
        for h in sweep_h:
            sweeps["h"].append(main_point if h == a.h else diloco_point(cfg, batches, evals, h=h))
        for olr in sweep_olr:
            sweeps["outer_lr"].append(
                main_point if olr == a.outer_lr else diloco_point(cfg, batches, evals, outer_lr=olr)
            )
        for lr in sweep_dl:
            sweeps["lr"].append(
                main_point if lr == a.lr else diloco_point(cfg, batches, evals, lr=lr)
            )
        for lr in sweep_dp:
            sweeps["dp_lr"].append(
                {"lr": lr, "eval_loss": round(dp_loss, 5), "seconds": round(timings["dp"], 1)}
                if lr == a.lr
                else dp_point(cfg, batches, evals, lr)
            )
        if sweep_om:
            # the outer lr x momentum grid at --batch: DiLoCo at its best inner lr of the sweep
            # above, against data parallel at its best lr; the cells already run are reused
            done = [main_point, *sweeps["outer_lr"], *sweeps["lr"]]
            dp_tuned = {a.lr: dp_loss, **{p["lr"]: p["eval_loss"] for p in sweeps["dp_lr"]}}
            di_tuned = {a.lr: di_loss, **{p["lr"]: p["eval_loss"] for p in sweeps["lr"]}}
            grid = outer_grid(
                cfg,
                batches,
                evals,
                sweep_olr or [a.outer_lr],
                sweep_om,
                inner_lr=min(di_tuned, key=lambda lr: di_tuned[lr]),
                dp=dp_tuned,
                done=done,
            )
            sweeps["outer_grid"] = grid["cells"]
            result.update({k: v for k, v in grid.items() if k != "cells"})
        # Every batch is tuned on the same grids (the default lr when a grid is not given); the
        # default batch reuses the default run and the lr sweeps above.
        dp_lrs, diloco_lrs = sweep_dp or [a.lr], sweep_dl or [a.lr]
        main_seconds = (
            timings["pretrain"]
            + timings["dp"]
            + timings["diloco"]
            + sum(p["seconds"] for p in sweeps["dp_lr"] + sweeps["lr"] if p["lr"] != a.lr)
        )
        for b in sweep_b:
            if b == a.batch:
                point = batch_record(
                    b,
                    start_loss,
                    {a.lr: dp_loss, **{p["lr"]: p["eval_loss"] for p in sweeps["dp_lr"]}},
                    {a.lr: di_loss, **{p["lr"]: p["eval_loss"] for p in sweeps["lr"]}},
                    main_seconds,
                )
                print_batch(point)
            else:
                point = batch_point(cfg, train, evals, b, dp_lrs, diloco_lrs)
            sweeps["batch"].append(point)
        if sweep_b:
            crit, reached = critical_batch(sweeps["batch"], a.critical_gain)
            for p in sweeps["batch"]:
                result[f"loss_gap_vs_dp_b{p['batch']}"] = p["loss_gap_vs_dp"]
            result.update(
                critical_batch=crit["batch"],
                critical_batch_reached=reached,
                loss_gap_vs_dp_at_critical_batch=crit["loss_gap_vs_dp"],
            )
            print(
                f"critical batch {crit['batch']}"
                + ("" if reached else f" (not reached: DP still gained >= {a.critical_gain:.0%})")
                + f": tuned DiLoCo {100 * crit['loss_gap_vs_dp']:+.2f}% vs tuned DP",
                flush=True,
            )
        if sweep_dp:
            best = min(sweeps["dp_lr"], key=lambda p: p["eval_loss"])
            result["dp_best_lr"] = best["lr"]
            result["loss_gap_vs_best_dp"] = round(
                (di_loss - best["eval_loss"]) / best["eval_loss"], 5
            )
        result.update(
            lr=a.lr,
            outer_lr=outer_lr_in_use(a),
            outer_momentum=a.outer_momentum,
            outer_warmup=a.outer_warmup,
        )
        result["seconds"] = round(time.time() - t_start, 1)
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**result, "sweeps": sweeps}, indent=1) + "\n")
        plot_sweeps({**result, "sweeps": sweeps}, out.with_suffix(".png"))
        print(f"sweeps: {out}, plot: {out.with_suffix('.png')}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
