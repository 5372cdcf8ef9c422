"""Replica bodies run in spawned processes by the ObjectStoreAllReduce tests (no tests here).

Kept in their own module so ``multiprocessing`` (spawn) can import them by name in the child;
every function returns plain picklable data to the test process.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

SHAPES = {"layer.weight": (6, 5), "layer.bias": (5,), "head": (3, 7, 2)}
_POOL: ProcessPoolExecutor | None = None


def shared_pool() -> ProcessPoolExecutor:
    """One spawn pool of 4 replica processes for all allreduce test modules.

    Starting processes that import torch costs seconds on a loaded machine, so the pool is
    created once per test session (lazily) and joined by ProcessPoolExecutor's own exit hook.
    """
    global _POOL
    if _POOL is None:
        _POOL = ProcessPoolExecutor(4, mp_context=mp.get_context("spawn"))
    return _POOL


def make_tensors(rank: int, step: int, dtype: torch.dtype = torch.float32) -> dict:
    """Deterministic pseudo-gradient of ``rank`` at ``step`` (the tests recompute it)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in SHAPES.items()}


def run_replica(
    uri: str,
    world_size: int,
    rank: int,
    steps: list[int],
    kwargs: dict[str, Any],
    dtype: str = "float32",
    start_at: float = 0.0,
) -> dict[str, Any]:
    """Run ``allreduce`` for each step; returns results, StepResults, or the error raised."""
    from allreduce_handles import exchange

    ar = exchange(uri, world_size, rank, **kwargs)
    out: dict[str, Any] = {"results": [], "step_results": [], "error": None}
    while time.time() < start_at:
        time.sleep(0.005)
    try:
        for step in steps:
            tokens = 10 * (rank + 1) + step
            res = ar.allreduce(
                make_tensors(rank, step, getattr(torch, dtype)), step=step, tokens=tokens
            )
            out["results"].append(res)
            out["step_results"].append(dataclasses.asdict(ar.last_result))
    except Exception as e:  # reported to the test, which asserts on type and message
        out["error"] = (type(e).__name__, str(e))
    return out


def race_commits(
    uri: str,
    world_size: int,
    rank: int,
    races: int,
    storage_options: dict[str, Any] | None,
    start_at: float,
    period_s: float,
) -> list[dict[str, Any]]:
    """Race to write commit records: at each agreed instant every process tries to commit.

    Each racer proposes a different included set (all ranks but itself... except rank 0 who
    proposes everyone), so a process that obeyed anything but the winner's record would show.
    """
    from composer_replication.exchange.allreduce import ObjectStoreAllReduce
    from composer_replication.exchange.protocol import Contribution
    from composer_replication.exchange.settings import AllReduceConfig

    ar = ObjectStoreAllReduce(
        uri,
        world_size,
        rank,
        storage_options=storage_options,
        config=AllReduceConfig(timeout_s=5, poll_interval_s=0.01),
    )
    records = []
    for i in range(races):
        step = 100 + i
        proposal = {
            r: Contribution(r, step, 1, 1, "fp32", ["x"], [[1]], ["float32"], f"d{r}", {}, 0)
            for r in range(world_size)
            if r != rank or rank == 0
        }
        t = start_at + i * period_s
        while time.time() < t:
            pass  # busy-wait: the racers must fire within microseconds of each other
        commit = ar._write_commit(step, proposal, {})
        records.append(
            {
                "step": step,
                "committed_by": commit["committed_by"],
                "included_ranks": commit["included_ranks"],
                "i_won": commit["committed_by"] == rank,
            }
        )
    return records


def warm_up(servers: list[tuple[str, dict[str, Any]]], hold_s: float) -> int:
    """Import torch/s3fs and open one client per (bucket, storage_options) server, so timed
    steps skip cold start-up."""
    import os

    import fsspec

    for bucket, options in servers:
        fs = fsspec.filesystem("s3", use_listings_cache=False, **options)
        fs.ls(bucket)
    time.sleep(hold_s)  # keep this worker busy so the next warm-up task lands on another one
    return os.getpid()
