"""The byzantine check: 4 real replica processes, one sending its pseudo-gradient x 1e6.

With norm screening off (so the merge alone is tested), ``trimmed_mean``, ``median`` and
``norm_clip`` keep the result within 10% of the honest ranks' mean; ``mean`` is dragged ~1e6/4
times the honest mean's size away. On file:// and on the local S3 server (SeaweedFS).
"""

from __future__ import annotations

import math
import time
import uuid

import pytest
import torch
from test_allreduce import pool  # noqa: F401  (a fixture)
from test_robust_screening import SHAPES, mean_of
from test_robust_workers import byzantine_replica

pytestmark = pytest.mark.slow
ATTACKER = 3


def _run(pool, uri, method, options=None):  # noqa: F811
    start = time.time() + 1.0
    futs = [
        pool.submit(
            byzantine_replica, uri, 4, r, method, 1e6 if r == ATTACKER else 1.0, options, start
        )
        for r in range(4)
    ]
    outs = [f.result(timeout=300) for f in futs]
    first = outs[0]["result"]
    for o in outs:
        assert o["included"] == [0, 1, 2, 3] and o["aggregate"] == method
        assert all(torch.equal(o["result"][k], first[k]) for k in SHAPES)  # bit-identical
    honest = mean_of([0, 1, 2])
    err = math.sqrt(sum(float((first[k] - honest[k]).double().pow(2).sum()) for k in SHAPES))
    size = math.sqrt(sum(float(honest[k].double().pow(2).sum()) for k in SHAPES))
    return err / size


@pytest.fixture(params=["file", "seaweedfs"])
def where(request, tmp_path):
    if request.param == "file":
        return lambda: (f"file://{tmp_path}/{uuid.uuid4().hex}", None)
    _, bucket, options = request.getfixturevalue("seaweedfs_server")
    return lambda: (f"s3://{bucket}/byzantine/{uuid.uuid4().hex}", options)


def test_robust_merges_keep_the_result_near_the_honest_mean_and_mean_does_not(
    pool,  # noqa: F811
    where,
):
    gaps = {}
    for method in ("trimmed_mean", "median", "norm_clip", "mean"):
        uri, options = where()
        gaps[method] = _run(pool, uri, method, options)
    for method in ("trimmed_mean", "median", "norm_clip"):
        assert gaps[method] < 0.1, gaps
    assert gaps["mean"] > 1e5, gaps
    print("relative distance to the honest mean:", gaps)
