"""Peak memory and time of generalized JSD forward+backward: chunked (ours) vs naive full-vocab.

    python benchmarks/loss_memory.py            # B=1, T=1024, V=151936 (Qwen2.5 vocabulary)
    python benchmarks/loss_memory.py --quick    # B=1, T=256, V=32768 (a few seconds)
    python benchmarks/loss_memory.py --child chunked --shape 1,512,32768 --out /tmp/x --chunk-size 8
                                                # one variant, figures in /tmp/x.json (tests)

Each variant runs in its own fresh subprocess (so one cannot inherit the other's freed pages).
Inside it: allocate the inputs (student logits with requires_grad, teacher logits), reset the
kernel's peak-RSS counter (``/proc/self/clear_refs``; VmHWM then equals the current RSS, which is
the baseline), run forward+backward once, and report ``VmHWM - baseline`` (the memory the loss
itself adds, gradient included) and the wall time. A
small warm-up call first loads kernels and thread pools so they count in the baseline, not in the
loss. Variants:

- ``naive``: the straightforward plain-autograd formula (log-softmax both sides, mixture via
  logsumexp over a stack, two ``F.kl_div`` terms, token mean) - what TRL's
  ``GKDTrainer.generalized_jsd_loss`` does;
- ``chunked``: ``composer_replication.loss.distill.generalized_jsd`` (default chunking), one
  ``loss.backward()``: the gradient buffer is scaled in place and becomes ``.grad``;
- ``chunked_retain``: the same with ``loss.backward(retain_graph=True)``: backward returns a
  scaled copy and the retained graph keeps the buffer (what the in-place path saves);
- ``trl`` (full run only, when trl is installed): TRL's own ``generalized_jsd_loss``, for scale.

Values agree: the loss and a sample of gradient rows are compared (``max_abs_diff``, naive vs
chunked and vs chunked_retain). Last line: JSON with ``peak_memory_ratio``, ``time_ratio``
(chunked / naive), ``max_abs_diff``, ``floor_ratio`` (one gradient buffer / naive peak),
``retain_peak_memory_ratio``, ``cpu_time_ratio`` (process CPU seconds, all threads: steadier
than wall time on a shared machine) and the per-repeat figures (``*_runs``: the spread).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

BETA = 0.5
TEMPERATURE = 1.0
ROW_STRIDE = 16  # gradient rows kept for the value comparison


def _naive(student, teacher):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F

    s = F.log_softmax(student / TEMPERATURE, -1)
    t = F.log_softmax(teacher / TEMPERATURE, -1)
    beta = torch.tensor(BETA, dtype=s.dtype)
    m = torch.logsumexp(torch.stack([s + torch.log1p(-beta), t + torch.log(beta)]), dim=0)
    kl_t = F.kl_div(m, t, reduction="none", log_target=True)
    kl_s = F.kl_div(m, s, reduction="none", log_target=True)
    jsd = (BETA * kl_t + (1 - BETA) * kl_s).sum(-1)
    return jsd.mean()


def _chunked(student, teacher, chunk_size=None):  # type: ignore[no-untyped-def]
    from composer_replication.loss.distill import generalized_jsd

    return generalized_jsd(
        student, teacher, beta=BETA, temperature=TEMPERATURE, chunk_size=chunk_size
    )[0]


def _trl(student, teacher):  # type: ignore[no-untyped-def]
    import torch
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    labels = torch.zeros(student.shape[:2], dtype=torch.long)
    return GKDTrainer.generalized_jsd_loss(
        student, teacher, labels=labels, beta=BETA, temperature=TEMPERATURE
    )


VARIANTS = {"naive": _naive, "chunked": _chunked, "chunked_retain": _chunked, "trl": _trl}
RETAIN = {"chunked_retain"}  # variants whose backward keeps the graph
CHUNKED = {"chunked", "chunked_retain"}  # variants that take --chunk-size


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Reset the peak-RSS counter to the current RSS (Linux); return the current RSS in bytes.

    Without the reset, ``ru_maxrss`` would still hold the transient peak of building the inputs
    and hide part of the loss's own allocation.
    """
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return _status_bytes("VmRSS")
    except OSError:  # no procfs reset: fall back to getrusage's lifetime peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_bytes() -> int:
    try:
        return _status_bytes("VmHWM")
    except (OSError, RuntimeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(variant: str, B: int, T: int, V: int, out_path: str, chunk_size: int | None) -> None:
    """Run one variant in this (fresh) process and write its figures to ``out_path``."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import functools

    import torch

    fn = VARIANTS[variant]
    if variant in CHUNKED:
        fn = functools.partial(fn, chunk_size=chunk_size)
    retain = variant in RETAIN
    # warm-up on a small problem: thread pools, kernels, lazy imports
    ws = torch.randn(1, 4, max(V // 8, 1), requires_grad=True)
    fn(ws, torch.randn(1, 4, max(V // 8, 1))).backward(retain_graph=retain)
    del ws
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(B, T, V, generator=g) * 2).requires_grad_(True)
    teacher = torch.randn(B, T, V, generator=g) * 2
    baseline = _reset_peak()
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = fn(student, teacher)
    loss.backward(retain_graph=retain)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _peak_bytes()
    assert student.grad is not None
    rows = student.grad[:, ::ROW_STRIDE].clone()
    torch.save({"loss": loss.detach(), "rows": rows}, out_path)
    result = {
        "peak_bytes": peak - baseline,
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "loss": float(loss.detach()),
    }
    with open(out_path + ".json", "w") as fh:
        json.dump(result, fh)


def run_variant(variant: str, B: int, T: int, V: int, tmp: str) -> dict[str, float]:
    out = os.path.join(tmp, variant + ".pt")
    cmd = [sys.executable, __file__, "--child", variant, "--shape", f"{B},{T},{V}", "--out", out]
    subprocess.run(cmd, check=True)
    with open(out + ".json") as fh:
        figures: dict[str, float] = json.load(fh)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shape, skip the TRL variant")
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL variant")
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="tokens per chunk (--child only; auto)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs per variant (3; quick: 2)")
    args = parser.parse_args()
    if args.child:
        B, T, V = (int(x) for x in args.shape.split(","))
        child(args.child, B, T, V, args.out, args.chunk_size)
        return

    import torch

    B, T, V = (1, 256, 32768) if args.quick else (1, 1024, 151936)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    variants = ["naive", "chunked", "chunked_retain"]
    if not (args.quick or args.no_trl):
        try:
            import trl  # noqa: F401

            variants.append("trl")
        except ImportError:
            pass
    print(
        f"generalized_jsd fwd+bwd, beta={BETA}, B={B} T={T} V={V}, "
        f"threads={torch.get_num_threads()}, repeats={args.repeats} (min time, median peak)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        # Variants alternate, each repeat in a fresh process; the minimum time of the repeats is
        # reported (the machine may be shared: the minimum is the least disturbed run), and the
        # median peak (peaks are nearly deterministic).
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v in variants:
                runs[v].append(run_variant(v, B, T, V, tmp))
        figures = {
            v: {
                "seconds": min(r["seconds"] for r in rs),
                "cpu_seconds": min(r["cpu_seconds"] for r in rs),
                "peak_bytes": sorted(r["peak_bytes"] for r in rs)[len(rs) // 2],
                "loss": rs[0]["loss"],
            }
            for v, rs in runs.items()
        }
        ref = torch.load(os.path.join(tmp, "naive.pt"), weights_only=True)
        diff = 0.0
        for v in CHUNKED:
            ours = torch.load(os.path.join(tmp, v + ".pt"), weights_only=True)
            diff = max(
                diff,
                float((ref["loss"] - ours["loss"]).abs()),
                float((ref["rows"] - ours["rows"]).abs().max()),
            )
    for v in variants:
        f = figures[v]
        print(
            f"  {v:8s} peak +{f['peak_bytes'] / 2**30:6.2f} GiB   {f['seconds']:6.2f} s   loss {f['loss']:.6f}"
        )
    grad_bytes = B * T * V * 4
    naive_peak = figures["naive"]["peak_bytes"]
    mem_ratio = figures["chunked"]["peak_bytes"] / naive_peak
    time_ratio = figures["chunked"]["seconds"] / figures["naive"]["seconds"]
    print(
        f"  gradient tensor alone: {grad_bytes / 2**30:.2f} GiB "
        f"(the floor: {grad_bytes / naive_peak:.3f}x naive)"
    )
    print(
        f"  chunked / naive: memory {mem_ratio:.3f}x, time {time_ratio:.3f}x, max |diff| {diff:.2e}"
    )
    result = {
        "peak_memory_ratio": round(mem_ratio, 4),
        "time_ratio": round(time_ratio, 4),
        "max_abs_diff": diff,
        "shape": [B, T, V],
        "repeats": args.repeats,
        "naive_peak_gib": round(figures["naive"]["peak_bytes"] / 2**30, 3),
        "chunked_peak_gib": round(figures["chunked"]["peak_bytes"] / 2**30, 3),
        "naive_seconds": round(figures["naive"]["seconds"], 3),
        "chunked_seconds": round(figures["chunked"]["seconds"], 3),
        "floor_ratio": round(grad_bytes / naive_peak, 4),
        "retain_peak_memory_ratio": round(figures["chunked_retain"]["peak_bytes"] / naive_peak, 4),
        "retain_peak_gib": round(figures["chunked_retain"]["peak_bytes"] / 2**30, 3),
        "retain_seconds": round(figures["chunked_retain"]["seconds"], 3),
        # process CPU seconds (all threads): less sensitive to other jobs than wall time
        "cpu_time_ratio": round(
            figures["chunked"]["cpu_seconds"] / figures["naive"]["cpu_seconds"], 4
        ),
        "retain_cpu_time_ratio": round(
            figures["chunked_retain"]["cpu_seconds"] / figures["naive"]["cpu_seconds"], 4
        ),
        # per repeat, in run order: ratios against the same repeat's naive run
        "peak_memory_ratio_runs": [
            round(c["peak_bytes"] / n["peak_bytes"], 4)
            for c, n in zip(runs["chunked"], runs["naive"], strict=True)
        ],
        "time_ratio_runs": [
            round(c["seconds"] / n["seconds"], 4)
            for c, n in zip(runs["chunked"], runs["naive"], strict=True)
        ],
    }
    if "trl" in figures:
        result["trl_peak_gib"] = round(figures["trl"]["peak_bytes"] / 2**30, 3)
        result["trl_seconds"] = round(figures["trl"]["seconds"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
