"""Replica bodies for the robust-exchange tests that need real processes (no tests here).

Importable by name in spawned children (like test_allreduce_workers); every function returns
plain picklable data.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch

BOTO_KIND = {
    "PutObject": "put",
    "GetObject": "get",
    "HeadObject": "head",
    "ListObjectsV2": "list",
    "DeleteObjects": "delete",
    "DeleteObject": "delete",
}


def count_requests(
    uri: str, world: int, rank: int, steps: list[int], options: dict[str, Any], start_at: float
) -> list[tuple[dict[str, int], dict[str, int]]]:
    """Run ``steps`` on S3; per step (what the store counted, what botocore sent)."""
    import fsspec
    from test_robust_screening import honest

    from composer_replication.exchange.allreduce import ObjectStoreAllReduce
    from composer_replication.exchange.settings import AllReduceConfig

    # the same s3fs instance the store uses (fsspec caches it per process and options)
    fs = fsspec.core.url_to_fs(uri, **{**options, "use_listings_cache": False})[0]
    fs.ls(uri.split("://")[1].split("/")[0])  # connect, so that the client exists
    sent: list[str] = []
    fs.s3.meta.events.register("before-call.s3", lambda model, **kw: sent.append(model.name))
    ar = ObjectStoreAllReduce(
        uri,
        world,
        rank,
        config=AllReduceConfig(timeout_s=30, poll_interval_s=0.02, keep_rounds=2),
        storage_options=options,
    )
    while time.time() < start_at:
        time.sleep(0.005)
    out = []
    for step in steps:
        sent.clear()
        ar.allreduce(honest(rank, step), step=step)
        assert ar.last_result is not None
        actual = Counter(BOTO_KIND[name] for name in sent)
        out.append(({k: v for k, v in ar.last_result.requests.items() if v}, dict(actual)))
    ar.close()
    return out


def byzantine_replica(
    uri: str,
    world: int,
    rank: int,
    method: str,
    scale: float,
    options: dict[str, Any] | None,
    start_at: float,
) -> dict[str, Any]:
    """One step with merge ``method`` and norm screening off; ``scale`` multiplies this rank's
    honest pseudo-gradient (1e6 for the attacker)."""
    from test_robust_screening import honest

    from composer_replication.exchange.allreduce import ObjectStoreAllReduce
    from composer_replication.exchange.contribution_screening import AggregatePolicy
    from composer_replication.exchange.settings import AllReduceConfig

    policy = AggregatePolicy(aggregate=method, aggregate_outlier_ratio=0)
    ar = ObjectStoreAllReduce(
        uri,
        world,
        rank,
        config=AllReduceConfig(timeout_s=60, poll_interval_s=0.02, aggregate=policy),
        storage_options=options,
    )
    while time.time() < start_at:
        time.sleep(0.005)
    tensors = {k: scale * v for k, v in honest(rank).items()}
    result = ar.allreduce(tensors, step=0)
    assert ar.last_result is not None
    ar.close()
    return {
        "result": {k: v.clone() for k, v in result.items()},
        "included": ar.last_result.included_ranks,
        "aggregate": ar.last_result.aggregate,
        "dtype": str(next(iter(result.values())).dtype),
        "ok": isinstance(result["w"], torch.Tensor),
    }
