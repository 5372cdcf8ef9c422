"""SparseLoCo vs full-precision DiLoCo on the same tokens: bytes on the wire and eval loss.

Both variants are `benchmarks/diloco_convergence.py`'s DiLoCo run (the byte-level TinyGPT on the
Python stdlib's source, k replicas as threads, each with its own model, AdamW, store handle and
ObjectStoreManager over a real file:// ObjectStoreAllReduce), from the same warm start, with the
same batches, seeds and inner learning-rate schedule:

  diloco      codec fp32, outer SGD with Nesterov momentum 0.9 at lr 0.4 (the best of a sweep
              0.25 / 0.4 / 0.7 / 1.0 on this benchmark; 0.7 is the repo's DiLoCo default);
  sparseloco  codec 'sparseloco' (chunk-wise top-k at --sl-density of every --sl-chunk elements,
              --sl-bits bits per value) with each replica's error-feedback accumulator
              (decay --sl-ef-decay), outer step plain SGD at --sl-outer-lr (no momentum: the
              error feedback replaces it), as in SparseLoCo (arXiv 2508.15706). The outer lr
              defaults to 3.0, the best of a sweep on this benchmark (docs/benchmarks-notebook.md):
              both variants are tuned the same way, each with its own outer-lr sweep.

Bytes are what the exchange really moved: the sizes of the contribution objects every replica
uploaded and downloaded (headers included), summed over replicas, per round. Eval loss is the
mean cross-entropy (nats per byte) of the global weights on held-out files.

    python benchmarks/sparseloco.py            # ~4-6 min on the shared 2-core machine
    python benchmarks/sparseloco.py --quick    # smoke-sized

Last line: JSON with sparseloco_bytes_ratio (bytes per round / fp32 DiLoCo's; target <= 0.03),
sparseloco_loss_gap_vs_diloco ((sparseloco - diloco) / diloco eval loss; target <= 0.005) and
the figures behind them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import diloco_convergence as dc  # noqa: E402


def run(cfg: dc.Cfg, batches: dc.Batches, evals: torch.Tensor) -> dict[str, float]:
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model, comm = dc.train_diloco(cfg, batches, "file://" + os.path.join(tmp, "run"))
    moved = comm["bytes_uploaded"] + comm["bytes_downloaded"]
    return {
        "eval_loss": dc.eval_loss(model, evals, cfg.ctx, cfg.eval_seqs),
        "bytes_per_round": moved / max(1, comm["rounds"]),
        "uploaded_per_round": comm["bytes_uploaded"] / max(1, comm["rounds"]),
        "rounds": comm["rounds"],
        "seconds": time.time() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="SparseLoCo vs fp32 DiLoCo (same tokens)")
    ap.add_argument("--quick", action="store_true", help="small smoke-sized run")
    ap.add_argument("--k", type=int, default=2, help="replicas")
    ap.add_argument("--h", type=int, default=10, help="inner steps per outer round")
    ap.add_argument("--rounds", type=int, default=30, help="outer rounds")
    ap.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3, help="inner AdamW peak lr")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seqs", type=int, default=256)
    ap.add_argument("--pretrain-steps", type=int, default=150, help="shared warm start")
    ap.add_argument(
        "--outer-lr", type=float, default=0.4, help="fp32 DiLoCo's outer lr (tuned: 0.25-1.0)"
    )
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="fp32 DiLoCo's")
    dc.add_sparseloco_args(ap)
    # tuned on this benchmark (docs/benchmarks-notebook.md: 1.0 ... 6.0); the run config's default is 1
    ap.set_defaults(sl_outer_lr=3.0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--only-sparseloco", action="store_true", help="tuning aid: run only SparseLoCo"
    )
    a = ap.parse_args()
    if a.quick:
        a.h, a.rounds, a.eval_seqs, a.pretrain_steps = 5, 3, 32, 10
        a.d_model, a.ctx = 64, 64
    torch.set_num_threads(a.threads)
    a.steps = a.rounds * a.h
    a.codec = "fp32"
    t_start = time.time()
    train, evals = dc.load_corpus(max_train_bytes=8_000_000, max_eval_bytes=600_000)
    batches = dc.Batches(train, a.batch, a.ctx, a.seed)
    cfg = dc.Cfg(a)
    n_params = sum(p.numel() for p in cfg.model().parameters())
    print(
        f"model {n_params:,} params; k={a.k} H={a.h} rounds={a.rounds} B={a.batch} "
        f"ctx={a.ctx}; sparseloco density={a.sl_density} chunk={a.sl_chunk} bits={a.sl_bits} "
        f"ef_decay={a.sl_ef_decay} outer_lr={a.sl_outer_lr}",
        flush=True,
    )
    cfg.start = dc.pretrain(cfg, batches)
    start_loss = dc.eval_loss(cfg.model(), evals, a.ctx, a.eval_seqs)
    print(f"warm start: eval loss {start_loss:.4f}", flush=True)

    sl_cfg = copy.copy(cfg)
    sl_cfg.codec = "sparseloco"
    if a.only_sparseloco:
        sl = run(sl_cfg, batches, evals)
        print(
            json.dumps(
                {
                    "sparseloco_eval_loss": round(sl["eval_loss"], 5),
                    "bytes_per_round": round(sl["bytes_per_round"]),
                }
            )
        )
        return
    dl = run(cfg, batches, evals)
    print(
        f"diloco (fp32)  eval loss {dl['eval_loss']:.4f}  {dl['bytes_per_round']:,.0f} B/round"
        f"  {dl['seconds']:.0f}s",
        flush=True,
    )
    sl = run(sl_cfg, batches, evals)
    print(
        f"sparseloco     eval loss {sl['eval_loss']:.4f}  {sl['bytes_per_round']:,.0f} B/round"
        f"  {sl['seconds']:.0f}s",
        flush=True,
    )
    result = {
        "sparseloco_bytes_ratio": round(sl["bytes_per_round"] / dl["bytes_per_round"], 5),
        "sparseloco_loss_gap_vs_diloco": round(
            (sl["eval_loss"] - dl["eval_loss"]) / dl["eval_loss"], 5
        ),
        "sparseloco_upload_ratio": round(sl["uploaded_per_round"] / dl["uploaded_per_round"], 5),
        "diloco_eval_loss": round(dl["eval_loss"], 5),
        "sparseloco_eval_loss": round(sl["eval_loss"], 5),
        "start_eval_loss": round(start_loss, 5),
        "diloco_bytes_per_round": round(dl["bytes_per_round"]),
        "sparseloco_bytes_per_round": round(sl["bytes_per_round"]),
        "rounds": sl["rounds"],
        "k": a.k,
        "h": a.h,
        "params": n_params,
        "sl_density": a.sl_density,
        "sl_chunk": a.sl_chunk,
        "sl_bits": a.sl_bits,
        "sl_ef_decay": a.sl_ef_decay,
        "sl_outer_lr": a.sl_outer_lr,
        "seconds": round(time.time() - t_start, 1),
        "quick": bool(a.quick),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
