"""Request counts per round, and no LIST in the steady state of a sync round.

`ObjectStore` counts its requests by kind; `StepResult.requests` is one allreduce's share and
the manager's round record the whole round's (quorum check, exchange, state publication). On S3
the counts are checked against the requests botocore actually sends (its ``before-call`` event).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
from test_allreduce import pool  # noqa: F401  (a fixture)
from test_robust_screening import honest
from test_robust_workers import count_requests

from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.settings import AllReduceConfig
from composer_replication.exchange.store_manager import ObjectStoreManager


def _steps(uri, world, steps):
    """Each rank runs ``steps`` in a thread; returns {rank: [StepResult]}."""
    out: dict[int, list] = {}

    def go(r):
        ar = ObjectStoreAllReduce(
            uri, world, r, config=AllReduceConfig(timeout_s=20, poll_interval_s=0.02, keep_rounds=2)
        )
        out[r] = []
        for step in steps:
            ar.allreduce(honest(r, step), step=step)
            out[r].append(ar.last_result)
        ar.close()

    threads = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_a_sync_round_sends_no_list_request_file(tmp_path):
    out = _steps(str(tmp_path), 3, [0, 1, 2, 3])
    for r, results in out.items():
        for sr in results:
            assert sr.requests["list"] == 0, (r, sr.step, sr.requests)
            assert sr.requests["put"] >= 2  # contribution + owner record (+ commit, head hint)
            assert sr.requests["get"] >= 3  # head hint, commit record, the peers' objects
        committed = [sr for sr in results if sr.committed_by == r]
        for sr in committed:
            assert sr.requests["put"] == 4  # contribution, owner record, commit, head hint
            # file:// deletes key by key: step - 2's commit + 3 ranks x (slot, owner, squat)
            assert sr.requests["delete"] == (10 if sr.step >= 2 else 0)


@pytest.mark.server
@pytest.mark.slow
def test_request_counts_match_what_botocore_sends_and_include_no_list(seaweedfs_server, pool):  # noqa: F811
    """Real processes on SeaweedFS: per step, the store's counts equal the requests botocore
    sent (its before-call event), and none is a LIST."""
    _, bucket, options = seaweedfs_server
    uri = f"s3://{bucket}/requests/{uuid.uuid4().hex}"
    start = time.time() + 1.0
    futs = [pool.submit(count_requests, uri, 3, r, [0, 1, 2, 3], options, start) for r in range(3)]
    for f in futs:
        for counted, actual in f.result(timeout=300):
            assert counted == actual
            assert "list" not in actual


def test_manager_rounds_record_their_requests_and_no_list(tmp_path):
    """Whole rounds through the manager (quorum check, exchange, publication): no LIST after
    the initial sync."""
    from test_manager import _in_threads

    def replica(rank):
        ar = ObjectStoreAllReduce(
            f"file://{tmp_path}/run",
            2,
            rank,
            config=AllReduceConfig(timeout_s=20, poll_interval_s=0.01),
        )
        m = ObjectStoreManager(ar)
        w = torch.zeros(3)
        m.register_state_dict_fn("w", lambda s: w.copy_(s["w"]), lambda: {"w": w})
        m.initial_sync({"w": w})
        for _ in range(3):
            t = torch.full((3,), float(rank))
            m.start_quorum()
            m.allreduce(t).wait()
            assert m.should_commit()
            m.publish_if_due()
        return m.history

    h0, h1 = _in_threads(lambda: replica(0), lambda: replica(1))
    for history in (h0, h1):
        assert [rec["round"] for rec in history] == [1, 2, 3]
        for rec in history:
            assert rec["requests"]["list"] == 0, rec
            assert rec["requests"]["get"] >= 3 and rec["requests"]["put"] >= 2
    publishers = [rec for rec in h0 + h1 if rec["requests"]["put"] >= 3]
    assert publishers, "the publisher's round includes its state upload"


def test_a_replica_left_behind_learns_it_from_the_head_hint_without_listing(tmp_path):
    """Rank 0 commits steps 0-3 alone (step 1 is garbage-collected); rank 1, still at step 1,
    is told to rejoin after two GETs (the step's commit record, the head hint)."""
    uri = str(tmp_path)
    for step in range(4):
        ar = ObjectStoreAllReduce(
            uri,
            2,
            0,
            config=AllReduceConfig(
                min_replicas=1, timeout_s=0.2, poll_interval_s=0.01, keep_rounds=2
            ),
        )
        ar.allreduce(honest(0, step), step=step)
    late = ObjectStoreAllReduce(
        uri, 2, 1, config=AllReduceConfig(timeout_s=5, poll_interval_s=0.01)
    )
    assert late.head_step() == 3
    before = late.store.requests.snapshot()
    with pytest.raises(Exception, match="already at step 3"):
        late.allreduce(honest(1, 1), step=1)
    spent = late.store.requests.since(before)
    # commit of step 1 (gone), the head hint, and the records that confirm it (issue: a
    # planted hint must not stop a run): step 3's commit record and step 2's
    assert spent["list"] == 0 and spent["get"] == 4
