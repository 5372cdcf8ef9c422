"""Peak memory and time of generalized JSD forward+backward: ours vs naive full-vocab.

    python benchmarks/loss_memory.py                  # CPU: B=1, T=1024, V=151936 (Qwen2.5's)
    python benchmarks/loss_memory.py --quick          # CPU: B=1, T=256, V=32768 (seconds)
    python benchmarks/loss_memory.py --device cuda    # GPU: from hidden states, bf16 (below)
    python benchmarks/loss_memory.py --quick --vocab 4096 --hidden 64   # smaller still
    python benchmarks/loss_memory.py --child chunked --shape 1,512,32768 --out /tmp/x --chunk-size 8
                                                      # one variant, figures in /tmp/x.json (tests)

Each variant runs in its own fresh subprocess (so one cannot inherit the other's freed pages or
cached blocks). Two comparisons:

**From logits (CPU, the default run).** Student logits with requires_grad and teacher logits
are allocated, then the kernel's peak-RSS counter is reset (``/proc/self/clear_refs``; VmHWM then
equals the current RSS, the baseline), forward+backward runs once, and ``VmHWM - baseline`` is
the memory the loss adds (gradient included), with its wall time. A small warm-up call first
loads kernels and thread pools so they count in the baseline. Variants:

- ``naive``: the straightforward plain-autograd formula (log-softmax both sides, mixture via
  logsumexp over a stack, two ``F.kl_div`` terms, token mean) - what TRL's
  ``GKDTrainer.generalized_jsd_loss`` does;
- ``chunked``: ``composer_replication.loss.distill.generalized_jsd`` (default chunking), one
  ``loss.backward()``: the gradient buffer is scaled in place and becomes ``.grad``;
- ``chunked_retain``: the same with ``loss.backward(retain_graph=True)``: backward returns a
  scaled copy and the retained graph keeps the buffer (what the in-place path saves);
- ``trl`` (full run only, when trl is installed): TRL's own ``generalized_jsd_loss``, for scale.

**From hidden states through the output layer** (issue 24: what channel 2 costs in a model).
Student and teacher last hidden states ``(B, T, H)`` and the output weight ``(V, H)``; the
student's hidden states get a gradient (``--weight-grad``: the weight too). Variants:

- ``naive_hidden``: full logits ``h @ W.T`` for both sides, then ``naive`` in float32 (the
  issue's "naive (full logits, fp32 softmax)" row);
- ``fused``: ``loss.fused_linear_jsd`` (backend ``auto``: our Triton kernels on CUDA, PyTorch
  on the CPU): never builds the ``(B, T, V)`` logits;
- CUDA only: ``fused_torch`` (the PyTorch backend on the GPU), ``chunked_logits``
  (``generalized_jsd`` on materialised bf16 logits: the issue's "ours, chunked" row) and
  ``liger`` (Liger-Kernel's ``LigerFusedLinearJSD`` through our adapter, when installed).

On the CPU (float32 by default) the peak is VmHWM as above; on CUDA (``--device cuda``;
bfloat16, B=1, T=1024, H=896, V=151936 by default: Qwen2.5-0.5B's head) it is
``torch.cuda.max_memory_allocated()`` minus the memory allocated once the inputs exist and two
warm-up runs are done (Triton compiled, cuBLAS workspaces allocated), and the time is the median
of ``--iters`` CUDA-synchronised runs. ``--device cuda`` without a CUDA device is an error.

Values agree: the loss and every 16th token's hidden-state (or logits) gradient are compared
with the naive variant (``max_abs_diff``). Last line: one JSON object. From logits:
``peak_memory_ratio``, ``time_ratio`` (chunked / naive), ``max_abs_diff``, ``floor_ratio`` (one
gradient buffer / naive peak), ``retain_peak_memory_ratio``, ``cpu_time_ratio`` (process CPU
seconds, all threads: steadier than wall time on a shared machine) and the per-repeat figures
(``*_runs``); from hidden states on the CPU: ``cpu_jsd_peak_ratio``, ``cpu_jsd_time_ratio``
(fused / naive_hidden), ``cpu_jsd_max_abs_diff``. ``--device cuda``: ``gpu_jsd_peak_ratio`` and
``gpu_jsd_time_ratio`` (fused / naive_hidden; goals <= 0.01 and <= 2.0), ``gpu_jsd_max_abs_diff``,
the same ratios for the other variants (``gpu_<variant>_peak_ratio`` / ``_time_ratio``), and
``gpu_jsd_peak_ratio_weight_grad`` / ``gpu_jsd_time_ratio_weight_grad`` (with the weight's
gradient: its ``(V, H)`` buffer is then a floor of both).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

BETA = 0.5
TEMPERATURE = 1.0
ROW_STRIDE = 16  # gradient rows kept for the value comparison
GPU_SHAPE = (1, 1024, 151936, 896)  # B, T, V, H: Qwen2.5-0.5B's output layer (issue 24)


def _naive(student, teacher):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F

    s = F.log_softmax(student / TEMPERATURE, -1)
    t = F.log_softmax(teacher / TEMPERATURE, -1)
    beta = torch.tensor(BETA, dtype=s.dtype, device=s.device)
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


# ---------------------------------------------------------------- from hidden states
def _naive_hidden(hs, ht, weight):  # type: ignore[no-untyped-def]
    import torch

    student = (hs @ weight.t()).float()  # the full logits, then the fp32 softmax formula
    with torch.no_grad():
        teacher = (ht @ weight.t()).float()
    return _naive(student, teacher)


def _fused_backend(backend: str):  # type: ignore[no-untyped-def]
    def fn(hs, ht, weight):  # type: ignore[no-untyped-def]
        from composer_replication.loss import fused_linear_jsd

        return fused_linear_jsd(
            hs, ht, weight, beta=BETA, temperature=TEMPERATURE, backend=backend
        )[0]

    return fn


def _chunked_logits(hs, ht, weight):  # type: ignore[no-untyped-def]
    from composer_replication.loss import generalized_jsd

    teacher = (ht @ weight.t()).detach()
    return generalized_jsd(hs @ weight.t(), teacher, beta=BETA, temperature=TEMPERATURE)[0]


# ---------------------------------------------------------------- channel 3 from hidden states
REPLAY_BETA = 0.1  # DPO beta (the default's)


def _replay_inputs(hc, hr, V):  # type: ignore[no-untyped-def]
    """The pair's token ids and reference sums: fixed by a seed, the same in every variant."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids_c = torch.randint(0, V, hc.shape[:2], generator=g).to(hc.device)
    ids_r = torch.randint(0, V, hr.shape[:2], generator=g).to(hr.device)
    refs = (-torch.rand(hc.shape[0], generator=g) * 10).to(hc.device)
    return ids_c, ids_r, refs


def _replay_logits(hc, hr, weight):  # type: ignore[no-untyped-def]
    """The current channel-3 path: each side's logits ``h @ W.T`` materialised, summed token
    log-probs by ``selective_log_softmax`` (loss._logprobs.sequence_logps), the DPO loss."""
    import torch

    from composer_replication.loss import dpo_loss, selective_log_softmax

    ids_c, ids_r, refs = _replay_inputs(hc, hr, weight.shape[0])
    chosen = selective_log_softmax(hc @ weight.t(), ids_c).sum(-1)
    rejected = selective_log_softmax(hr @ weight.t(), ids_r).sum(-1)
    return dpo_loss(chosen, rejected, refs, torch.zeros_like(refs), beta=REPLAY_BETA)[0]


def _replay_fused(hc, hr, weight):  # type: ignore[no-untyped-def]
    """``loss.fused_linear_logps``: the same log-probs from the hidden states, no logits; both
    sides in one call, as ``loss.fused_replay_term`` packs them (one weight gradient)."""
    import torch

    from composer_replication.loss import dpo_loss, fused_linear_logps

    ids_c, ids_r, refs = _replay_inputs(hc, hr, weight.shape[0])
    both = fused_linear_logps(torch.cat([hc, hr], 1), weight, None, torch.cat([ids_c, ids_r], 1))
    chosen, rejected = both[:, : hc.shape[1]].sum(-1), both[:, hc.shape[1] :].sum(-1)
    return dpo_loss(chosen, rejected, refs, torch.zeros_like(refs), beta=REPLAY_BETA)[0]


HIDDEN_VARIANTS = {
    "naive_hidden": _naive_hidden,
    "fused": _fused_backend("auto"),
    "fused_torch": _fused_backend("torch"),
    "chunked_logits": _chunked_logits,
    "liger": _fused_backend("liger"),
    "replay_logits": _replay_logits,
    "replay_fused": _replay_fused,
}
REPLAY_VARIANTS = {"replay_logits", "replay_fused"}  # both hidden-state inputs get a gradient


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
    """Run one from-logits variant in this (fresh) process and write its figures to ``out_path``."""
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


def child_hidden(
    variant: str,
    shape: tuple[int, int, int, int],
    *,
    device: str,
    dtype_name: str,
    weight_grad: bool,
    iters: int,
    out_path: str,
) -> None:
    """Run one from-hidden-states variant in this (fresh) process; figures to ``out_path``."""
    import torch

    B, T, V, H = shape
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    fn = HIDDEN_VARIANTS[variant]
    cuda = device == "cuda"
    g = torch.Generator().manual_seed(0)
    # unit-variance hidden states (as after a final RMSNorm); weights scaled so logits ~ N(0, 4)
    hs = torch.randn(B, T, H, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    ht = torch.randn(B, T, H, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(V, H, generator=g) * (2.0 / H**0.5)).to(device=device, dtype=dtype)
    weight.requires_grad_(weight_grad)
    params = [hs, weight] if weight_grad else [hs]
    if variant in REPLAY_VARIANTS:  # channel 3: hs the chosen side, ht the rejected, both trained
        ht.requires_grad_(True)
        params.append(ht)

    def run() -> Any:
        for p in params:
            p.grad = None
        loss = fn(hs, ht, weight)
        loss.backward()
        return loss

    if cuda:
        for _ in range(2):  # Triton compiles, cuBLAS and the caching allocator warm up
            run()
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        loss = run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - baseline
        times = []
        for _ in range(iters):
            start_ev = torch.cuda.Event(enable_timing=True)
            end_ev = torch.cuda.Event(enable_timing=True)
            start_ev.record()
            run()
            end_ev.record()
            torch.cuda.synchronize()
            times.append(start_ev.elapsed_time(end_ev) / 1000.0)
        seconds = statistics.median(times)
        cpu = float("nan")
        # the gradients of the last run, for the value comparison
        loss = fn(hs, ht, weight)
        for p in params:
            p.grad = None
        loss.backward()
    else:
        ws = torch.randn(1, 4, H, dtype=dtype, requires_grad=True)  # warm-up: a small problem
        wt = torch.randn(1, 4, H, dtype=dtype, requires_grad=variant in REPLAY_VARIANTS)
        fn(ws, wt, weight.detach()[: max(V // 8, 1)]).backward()
        del ws, wt
        baseline = _reset_peak()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = run()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        peak = _peak_bytes() - baseline
        times = [seconds]
    assert hs.grad is not None
    rows = hs.grad[:, ::ROW_STRIDE].float().cpu().clone()
    torch.save({"loss": loss.detach().float().cpu(), "rows": rows}, out_path)
    figures = {
        "peak_bytes": peak,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "loss": float(loss.detach()),
        "times": times,
    }
    if cuda:
        figures["device_name"] = torch.cuda.get_device_name()
    with open(out_path + ".json", "w") as fh:
        json.dump(figures, fh)


def _subprocess(args: list[str], out: str) -> dict[str, Any]:
    subprocess.run([sys.executable, __file__, *args, "--out", out], check=True)
    with open(out + ".json") as fh:
        figures: dict[str, Any] = json.load(fh)
    return figures


def run_variant(variant: str, B: int, T: int, V: int, tmp: str) -> dict[str, float]:
    out = os.path.join(tmp, variant + ".pt")
    return _subprocess(["--child", variant, "--shape", f"{B},{T},{V}"], out)


def run_hidden_variant(
    variant: str,
    shape: tuple[int, int, int, int],
    tmp: str,
    *,
    device: str,
    dtype: str,
    weight_grad: bool,
    iters: int,
) -> dict[str, Any]:
    tag = variant + ("_wgrad" if weight_grad else "")
    args = ["--child-hidden", variant, "--shape", ",".join(map(str, shape))]
    args += ["--device", device, "--dtype", dtype, "--iters", str(iters)]
    if weight_grad:
        args.append("--weight-grad")
    return _subprocess(args, os.path.join(tmp, tag + ".pt"))


def _max_diff(tmp: str, ref: str, others: list[str]) -> float:
    import torch

    base = torch.load(os.path.join(tmp, ref + ".pt"), weights_only=True)
    diff = 0.0
    for v in others:
        ours = torch.load(os.path.join(tmp, v + ".pt"), weights_only=True)
        diff = max(
            diff,
            float((base["loss"] - ours["loss"]).abs()),
            float((base["rows"] - ours["rows"]).abs().max()),
        )
    return diff


def compare_hidden(
    shape: tuple[int, int, int, int],
    *,
    device: str,
    dtype: str,
    repeats: int,
    iters: int,
    weight_grad_too: bool,
) -> dict[str, Any]:
    """The from-hidden-states comparison: figures per variant and the ratios to naive_hidden."""
    import importlib.util

    variants = ["naive_hidden", "fused"]
    if device == "cuda":
        variants += ["fused_torch", "chunked_logits"]
        if importlib.util.find_spec("liger_kernel") is not None:
            variants.append("liger")
    prefix = "gpu" if device == "cuda" else "cpu"
    B, T, V, H = shape
    print(
        f"generalized_jsd from hidden states, fwd+bwd, beta={BETA}, B={B} T={T} V={V} H={H}, "
        f"{dtype} on {device}, repeats={repeats}"
        + (f", {iters} timed runs each" if device == "cuda" else "")
    )
    result: dict[str, Any] = {}
    passes = [False, True] if weight_grad_too else [False]
    with tempfile.TemporaryDirectory() as tmp:
        for weight_grad in passes:
            names = variants if not weight_grad else ["naive_hidden", "fused"]
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in names}
            for _ in range(repeats):
                for v in names:
                    figures = run_hidden_variant(
                        v,
                        shape,
                        tmp,
                        device=device,
                        dtype=dtype,
                        weight_grad=weight_grad,
                        iters=iters,
                    )
                    runs[v].append(figures)
            fig = {
                v: {
                    "seconds": min(r["seconds"] for r in rs),
                    "peak_bytes": sorted(r["peak_bytes"] for r in rs)[len(rs) // 2],
                    "loss": rs[0]["loss"],
                }
                for v, rs in runs.items()
            }
            suffix = "_wgrad" if weight_grad else ""
            diff = _max_diff(tmp, "naive_hidden" + suffix, [v + suffix for v in names[1:]])
            label = " (with the weight's gradient)" if weight_grad else ""
            for v in names:
                f = fig[v]
                print(
                    f"  {v:15s} peak +{f['peak_bytes'] / 2**30:7.3f} GiB   "
                    f"{f['seconds'] * 1e3:9.2f} ms   loss {f['loss']:.6f}{label}"
                )
            naive = fig["naive_hidden"]
            for v in names[1:]:
                key = "jsd" if v == "fused" else v
                end = "_weight_grad" if weight_grad else ""
                result[f"{prefix}_{key}_peak_ratio{end}"] = round(
                    fig[v]["peak_bytes"] / naive["peak_bytes"], 5
                )
                result[f"{prefix}_{key}_time_ratio{end}"] = round(
                    fig[v]["seconds"] / naive["seconds"], 4
                )
            if not weight_grad:
                result[f"{prefix}_jsd_max_abs_diff"] = diff
                result[f"{prefix}_naive_peak_gib"] = round(naive["peak_bytes"] / 2**30, 4)
                result[f"{prefix}_fused_peak_gib"] = round(fig["fused"]["peak_bytes"] / 2**30, 4)
                result[f"{prefix}_naive_ms"] = round(naive["seconds"] * 1e3, 3)
                result[f"{prefix}_fused_ms"] = round(fig["fused"]["seconds"] * 1e3, 3)
                if device == "cuda":
                    result["gpu_device"] = runs["fused"][0].get("device_name", "")
            print(
                f"  fused / naive{label}: memory "
                f"{fig['fused']['peak_bytes'] / naive['peak_bytes']:.4f}x, time "
                f"{fig['fused']['seconds'] / naive['seconds']:.3f}x, max |diff| {diff:.2e}"
            )
    result[f"{prefix}_jsd_shape"] = list(shape)
    result[f"{prefix}_jsd_dtype"] = dtype
    return result


def compare_replay(
    shape: tuple[int, int, int, int],
    *,
    device: str,
    dtype: str,
    repeats: int,
    iters: int,
    weight_grad: bool,
) -> dict[str, Any]:
    """Channel 3 from hidden states (issue 39): a DPO pair's chosen and rejected sides ``(B, T,
    H)`` each, log-probs through the output layer; ``replay_fused`` against ``replay_logits``
    (the current path). Keys: CPU ``replay_peak_memory_ratio`` (the median over the repeats of
    each repeat's fused / current peak; goal <= 0.2), ``replay_time_ratio``, their ``*_runs``;
    CUDA ``gpu_replay_peak_ratio`` / ``gpu_replay_time_ratio``; ``*_max_abs_diff``."""
    B, T, V, H = shape
    names = ["replay_logits", "replay_fused"]
    cuda = device == "cuda"
    print(
        f"channel 3 (DPO) from hidden states, fwd+bwd, B={B} pairs T={T} V={V} H={H}, {dtype} on "
        f"{device}, repeats={repeats}" + (", with the weight's gradient" if weight_grad else "")
    )
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for v in names:
                runs[v].append(
                    run_hidden_variant(
                        v,
                        shape,
                        tmp,
                        device=device,
                        dtype=dtype,
                        weight_grad=weight_grad,
                        iters=iters,
                    )
                )
        suffix = "_wgrad" if weight_grad else ""
        diff = _max_diff(tmp, "replay_logits" + suffix, ["replay_fused" + suffix])
    peak_runs = [
        f["peak_bytes"] / c["peak_bytes"]
        for f, c in zip(runs["replay_fused"], runs["replay_logits"], strict=True)
    ]
    time_runs = [
        f["seconds"] / c["seconds"]
        for f, c in zip(runs["replay_fused"], runs["replay_logits"], strict=True)
    ]
    for v in names:
        peaks = [r["peak_bytes"] / 2**30 for r in runs[v]]
        secs = [r["seconds"] for r in runs[v]]
        print(
            f"  {v:14s} peak +{statistics.median(peaks):7.3f} GiB (runs "
            f"{', '.join(f'{p:.3f}' for p in peaks)})   {statistics.median(secs) * 1e3:9.1f} ms"
        )
    peak, spread = statistics.median(peak_runs), max(peak_runs) - min(peak_runs)
    print(
        f"  fused / current: memory {peak:.4f}x (spread {spread:.4f}), time "
        f"{statistics.median(time_runs):.3f}x, max |diff| {diff:.2e}"
    )
    prefix = "gpu_replay" if cuda else "replay"
    end = "_weight_grad" if weight_grad else ""
    key = f"{prefix}_peak_ratio{end}" if cuda else f"replay_peak_memory_ratio{end}"
    result: dict[str, Any] = {
        key: round(peak, 5),
        f"{key}_runs": [round(r, 5) for r in peak_runs],
        f"{prefix}_time_ratio{end}": round(statistics.median(time_runs), 4),
        f"{prefix}_time_ratio{end}_runs": [round(r, 4) for r in time_runs],
        f"{prefix}_max_abs_diff{end}": diff,
        f"{prefix}_current_peak_gib{end}": round(
            statistics.median(r["peak_bytes"] for r in runs["replay_logits"]) / 2**30, 4
        ),
        f"{prefix}_fused_peak_gib{end}": round(
            statistics.median(r["peak_bytes"] for r in runs["replay_fused"]) / 2**30, 4
        ),
        f"{prefix}_shape": list(shape),
        f"{prefix}_dtype": dtype,
    }
    return result


def _parse_shape(text: str, n: int) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != n:
        raise SystemExit(f"--shape needs {n} comma-separated ints, got {text!r}")
    return parts


def compare_logits(
    B: int, T: int, V: int, repeats: int, quick: bool, no_trl: bool
) -> dict[str, Any]:
    """The from-logits comparison (the CPU run): ``peak_memory_ratio`` and friends."""
    import torch

    variants = ["naive", "chunked", "chunked_retain"]
    if not (quick or no_trl):
        try:
            import trl  # noqa: F401

            variants.append("trl")
        except ImportError:
            pass
    print(
        f"generalized_jsd fwd+bwd, beta={BETA}, B={B} T={T} V={V}, "
        f"threads={torch.get_num_threads()}, repeats={repeats} (min time, median peak)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        # Variants alternate, each repeat in a fresh process; the minimum time of the repeats is
        # reported (the machine may be shared: the minimum is the least disturbed run), and the
        # median peak (peaks are nearly deterministic).
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for _ in range(repeats):
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
        diff = _max_diff(tmp, "naive", sorted(CHUNKED))
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
    result: dict[str, Any] = {
        "peak_memory_ratio": round(mem_ratio, 4),
        "time_ratio": round(time_ratio, 4),
        "max_abs_diff": diff,
        "shape": [B, T, V],
        "repeats": repeats,
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
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, skip the TRL variant")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: both comparisons on the CPU; cuda: the from-hidden-states one on the GPU",
    )
    parser.add_argument("--vocab", type=int, default=None, help="V (default 151936; quick 32768)")
    parser.add_argument("--tokens", type=int, default=None, help="T (default 1024; quick 256)")
    parser.add_argument("--hidden", type=int, default=None, help="H (default 896; quick 256)")
    parser.add_argument(
        "--dtype", choices=("bf16", "fp32"), default=None, help="cuda: bf16; cpu: fp32"
    )
    parser.add_argument("--iters", type=int, default=10, help="timed runs per CUDA variant")
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL variant")
    parser.add_argument("--no-hidden", action="store_true", help="cpu: skip the hidden-state rows")
    parser.add_argument(
        "--no-replay", action="store_true", help="skip channel 3's from-hidden-states comparison"
    )
    parser.add_argument(
        "--replay-only",
        action="store_true",
        help="only channel 3's comparison (replay_peak_memory_ratio; cuda: gpu_replay_*)",
    )
    parser.add_argument(
        "--replay-weight-grad",
        action="store_true",
        help="channel 3's comparison with the output layer's gradient too (*_weight_grad keys)",
    )
    parser.add_argument(
        "--no-weight-grad",
        action="store_true",
        help="cuda: skip the runs with the weight's gradient",
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs per variant (3; quick 2)")
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--child-hidden", choices=sorted(HIDDEN_VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--weight-grad", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="tokens per chunk (--child only; auto)"
    )
    args = parser.parse_args()
    if args.child:
        B, T, V = _parse_shape(args.shape, 3)
        child(args.child, B, T, V, args.out, args.chunk_size)
        return
    if args.child_hidden:
        B, T, V, H = _parse_shape(args.shape, 4)
        child_hidden(
            args.child_hidden,
            (B, T, V, H),
            device=args.device,
            dtype_name=args.dtype,
            weight_grad=args.weight_grad,
            iters=args.iters,
            out_path=args.out,
        )
        return

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda: no CUDA device is available here (torch.cuda.is_available() is "
            "False); run it on a GPU machine (scripts/gpu-check.sh), or use --device cpu"
        )
    quick = args.quick
    B = 1
    T = args.tokens or (256 if quick else 1024)
    V = args.vocab or (32768 if quick else 151936)
    H = args.hidden or (256 if quick else 896)
    repeats = args.repeats or (2 if quick else 3)
    device = args.device
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")

    def replay() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for weight_grad in [False, True] if args.replay_weight_grad else [False]:
            out.update(
                compare_replay(
                    (B, T, V, H),
                    device=device,
                    dtype=dtype,
                    repeats=repeats,
                    iters=args.iters,
                    weight_grad=weight_grad,
                )
            )
        return out

    if args.replay_only:
        print(json.dumps(replay()))
        return
    if args.device == "cuda":
        result = compare_hidden(
            (B, T, V, H),
            device="cuda",
            dtype=dtype,
            repeats=repeats,
            iters=args.iters,
            weight_grad_too=not args.no_weight_grad,
        )
        if not args.no_replay:
            result.update(replay())
        print(json.dumps(result))
        return
    result = compare_logits(B, T, V, repeats, quick, args.no_trl)
    if not args.no_replay:
        result.update(replay())
    if not args.no_hidden:
        result.update(
            compare_hidden(
                (B, T, V, H),
                device="cpu",
                dtype=args.dtype or "fp32",
                repeats=repeats,
                iters=1,
                weight_grad_too=False,
            )
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
