"""ObjectStoreAllReduce on file:// with real replica processes, plus the API's contract."""

from __future__ import annotations

import os
import time

import pytest
import torch
from allreduce_handles import exchange
from test_allreduce_workers import SHAPES, make_tensors, race_commits, run_replica, shared_pool
from tolerances import UBF16, assert_close, tol

from composer_replication.exchange import AllReduceConfig, ObjectStoreAllReduce
from composer_replication.exchange.allreduce import (
    ExchangeCancelledError,
    StoreTimeoutError,
)


@pytest.fixture(scope="module")
def pool():
    """The session's shared replica process pool (see test_allreduce_workers.shared_pool)."""
    return shared_pool()


def run_all(pool, uri, world_size, ranks, steps, dtype="float32", **kwargs):
    """Run ``ranks`` as concurrent processes; returns {rank: run_replica output}."""
    kwargs.setdefault("timeout_s", 10.0)
    kwargs.setdefault("poll_interval_s", 0.02)
    start = time.time() + 0.5
    futs = {
        r: pool.submit(run_replica, uri, world_size, r, steps, kwargs, dtype, start) for r in ranks
    }
    return {r: f.result(timeout=120) for r, f in futs.items()}


def independent_mean(ranks, step, dtype=torch.float32, weights=None):
    """Reference: plain mean (or weighted sum) in float64 of the replicas' tensors."""
    ts = [make_tensors(r, step, dtype) for r in ranks]
    ws = weights or {r: 1.0 / len(ranks) for r in ranks}
    return {n: sum(ws[r] * t[n].double() for r, t in zip(ranks, ts)).to(dtype) for n in SHAPES}


def assert_bit_identical_and_mean(outs, ranks, steps, dtype=torch.float32):
    """Every rank got the same bits, and they are the float64 mean's to the arithmetic's bound:
    the exchange sums len(ranks) weighted fp32 terms (gamma_{k+1} of the terms' size) and rounds
    to ``dtype``, the reference rounds its float64 mean once; for bf16 the two roundings can land
    one bf16 unit apart (2 u_bf16 relative)."""
    for i, step in enumerate(steps):
        ref = outs[ranks[0]]["results"][i]
        expected = independent_mean(ranks, step, dtype)
        for r in ranks:
            got = outs[r]["results"][i]
            for n in SHAPES:
                assert got[n].dtype == dtype and got[n].shape == SHAPES[n]
                assert torch.equal(got[n], ref[n]), f"rank {r} differs at step {step} ({n})"
                bounds = tol(len(ranks) + 1, float(expected[n].float().abs().max()))
                if dtype == torch.bfloat16:
                    bounds["rtol"] += 2 * UBF16
                torch.testing.assert_close(got[n], expected[n], **bounds)


def test_object_store_allreduce_world_size_1_passthrough(tmp_path):
    uri = f"file://{tmp_path}/run"
    ar = ObjectStoreAllReduce(uri, world_size=1)
    t = {"w": torch.randn(3, 4), "b": torch.randn(2, dtype=torch.bfloat16)}
    out = ar.allreduce(t, step=0)
    assert set(out) == set(t) and all(out[k] is t[k] for k in t)
    assert ar.last_result.included_ranks == [0] and ar.last_result.bytes_uploaded == 0
    assert not os.path.exists(f"{tmp_path}/run"), "world_size=1 must do no I/O"
    assert ar.uri == f"file://{tmp_path}/run/"


@pytest.mark.parametrize("rank", [2, 3, -1])
def test_rank_outside_world_raises(tmp_path, rank):
    with pytest.raises(ValueError, match="rank must be in"):
        ObjectStoreAllReduce(f"file://{tmp_path}", world_size=2, rank=rank)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timeout_s": 10, "upload_timeout_s": 10}, "upload < step"),
        ({"timeout_s": 10, "run_timeout_s": 5}, "step < run"),
        ({"codec": "fp8"}, "unknown codec"),
        ({"min_replicas": 3}, "min_replicas"),
        ({"weighting": "loss"}, "weighting"),
        ({"keep_rounds": 0}, "keep_rounds"),
    ],
)
def test_bad_arguments_raise_value_error(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        exchange(f"file://{tmp_path}", world_size=2, rank=0, **kwargs)


def test_driver_handle_and_bad_inputs_raise(tmp_path):
    driver = ObjectStoreAllReduce(str(tmp_path), world_size=2)
    assert driver.uri == f"file://{tmp_path}/" and driver.rank is None
    with pytest.raises(ValueError, match="driver handle"):
        driver.allreduce({"x": torch.zeros(2)}, step=0)
    ar = ObjectStoreAllReduce(
        str(tmp_path), world_size=2, rank=0, config=AllReduceConfig(weighting="tokens")
    )
    with pytest.raises(ValueError, match="tokens"):
        ar.allreduce({"x": torch.zeros(2)}, step=0)
    with pytest.raises(ValueError, match="floating"):
        ar.allreduce({"x": torch.zeros(2, dtype=torch.int64)}, step=0, tokens=1)
    with pytest.raises(ValueError, match="non-empty"):
        ar.allreduce({}, step=0, tokens=1)


@pytest.mark.slow
def test_replicas_bit_identical_and_equal_to_mean_file(pool, tmp_path):
    uri = f"file://{tmp_path}/run"
    steps = [0, 1, 2, 3, 4]
    outs = run_all(pool, uri, 4, [0, 1, 2, 3], steps, keep_rounds=2)
    assert all(o["error"] is None for o in outs.values()), outs
    assert_bit_identical_and_mean(outs, [0, 1, 2, 3], steps)
    for o in outs.values():
        sr = o["step_results"][-1]
        assert sr["included_ranks"] == [0, 1, 2, 3] and sr["excluded_ranks"] == []
        assert sr["bytes_uploaded"] > 0 and sr["bytes_downloaded"] >= 3 * sr["bytes_uploaded"]
    # GC keeps only the newest keep_rounds steps (beside them: the head hint)
    assert sorted(os.listdir(f"{tmp_path}/run/steps")) == ["0000000003", "0000000004", "head.json"]


@pytest.mark.slow
def test_bf16_model_tensors_keep_dtype_and_agree(pool, tmp_path):
    outs = run_all(pool, f"file://{tmp_path}", 2, [0, 1], [0, 1], dtype="bfloat16")
    assert all(o["error"] is None for o in outs.values()), outs
    assert_bit_identical_and_mean(outs, [0, 1], [0, 1], torch.bfloat16)


@pytest.mark.slow
def test_dead_replica_is_left_out_and_reported(pool, tmp_path):
    uri = f"file://{tmp_path}"
    outs = run_all(pool, uri, 3, [0, 1], [0], timeout_s=3.0, min_replicas=2)
    assert all(o["error"] is None for o in outs.values()), outs
    assert_bit_identical_and_mean(outs, [0, 1], [0])
    for o in outs.values():
        sr = o["step_results"][0]
        assert sr["included_ranks"] == [0, 1] and sr["excluded_ranks"] == [2]
        assert "missing" in sr["rejected"][2]
    # Whichever rank commits does so only once timeout_s has passed since its own upload, so it
    # waited at least that long. The other reads that record: its clock starts at its own
    # upload, which under load can come a little after the committer's (a fresh-clone run beside
    # a CPU hog measured 2.91 s for it), so its wait is not bounded by the timeout.
    assert max(o["step_results"][0]["wait_seconds"] for o in outs.values()) >= 3.0
    # the late replica arrives after the commit: left out, but gets the committed result
    late = run_all(pool, uri, 3, [2], [0], timeout_s=3.0, min_replicas=2)[2]
    assert late["error"] is None
    assert late["step_results"][0]["excluded_ranks"] == [2]
    for n in SHAPES:
        assert torch.equal(late["results"][0][n], outs[0]["results"][0][n])
    assert not os.path.exists(f"{tmp_path}/steps/0000000000/contrib/00002.safetensors")


@pytest.mark.slow
def test_min_replicas_unmet_times_out_and_commits_nothing(pool, tmp_path):
    outs = run_all(pool, f"file://{tmp_path}", 3, [0, 1], [0], timeout_s=1.5)
    for o in outs.values():
        kind, msg = o["error"]
        assert kind == "StoreTimeoutError"
        assert "step 0" in msg and "missing ranks [2]" in msg and "timeout_s=1.5" in msg
    assert not os.path.exists(f"{tmp_path}/steps/0000000000/commit.json")


@pytest.mark.slow
def test_token_weighting_across_processes(pool, tmp_path):
    outs = run_all(pool, f"file://{tmp_path}", 3, [0, 1, 2], [0], weighting="tokens")
    assert all(o["error"] is None for o in outs.values()), outs
    tokens = {r: 10 * (r + 1) for r in range(3)}
    weights = {r: tokens[r] / sum(tokens.values()) for r in range(3)}
    expected = independent_mean([0, 1, 2], 0, weights=weights)
    for o in outs.values():
        assert o["step_results"][0]["weights"] == weights
        for n in SHAPES:
            assert torch.equal(o["results"][0][n], outs[0]["results"][0][n])
            # token weights: a 3-term weighted fp32 sum vs the float64 one (n = k + 1)
            assert_close(o["results"][0][n], expected[n], n=4)


@pytest.mark.slow
def test_racing_commits_file(pool, tmp_path):
    check_commit_races(pool, f"file://{tmp_path}", None)


def check_commit_races(pool, uri, storage_options, world_size=4, races=20, period_s=0.1):
    """world_size processes race ``races`` times; exactly one winner each time, all obey it."""
    start = time.time() + 1.0
    futs = [
        pool.submit(race_commits, uri, world_size, r, races, storage_options, start, period_s)
        for r in range(world_size)
    ]
    per_rank = [f.result(timeout=120) for f in futs]
    for i in range(races):
        recs = [per_rank[r][i] for r in range(world_size)]
        assert sum(rec["i_won"] for rec in recs) == 1, recs
        assert len({(rec["committed_by"], tuple(rec["included_ranks"])) for rec in recs}) == 1


def test_cancel_aborts_wait(tmp_path):
    import threading

    with ObjectStoreAllReduce(
        str(tmp_path), world_size=2, rank=0, config=AllReduceConfig(timeout_s=30)
    ) as ar:
        threading.Timer(0.3, ar.cancel).start()  # cancel from another thread mid-wait
        t0 = time.monotonic()
        with pytest.raises(ExchangeCancelledError, match="step 0"):
            ar.allreduce({"x": torch.ones(2)}, step=0)
        assert time.monotonic() - t0 < 5


def test_stale_step_is_refused_quickly(tmp_path):
    import threading

    uri = str(tmp_path)
    res = {}

    def go(r):
        ar = ObjectStoreAllReduce(
            uri, 2, r, config=AllReduceConfig(timeout_s=5, poll_interval_s=0.01)
        )
        for step in (4, 5):  # a committed step follows a committed one (the chain)
            ar.allreduce({"x": torch.full((2,), float(r))}, step=step)
        res[r] = ar

    ths = [threading.Thread(target=go, args=(r,)) for r in range(2)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    assert res[0].latest_committed_step() == 5
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="already at step 5"):
        res[0].allreduce({"x": torch.ones(2)}, step=3)
    assert time.monotonic() - t0 < 4  # far below timeout_s=5 + the wait for a commit


def test_transient_store_errors_are_retried(tmp_path):
    """Faults injected through each replica's store (one rule set shared by both, hitting
    whichever replica gets there first): failing reads of peers' slots and a failing commit
    write; the step still agrees."""
    import threading

    from composer_replication.exchange.faulty_store import Fault, FaultyStore
    from composer_replication.exchange.store import ObjectStore

    commit_write = Fault("put_if_absent", "steps/*/commit.json", "fail")  # connection reset
    slot_reads = Fault("get", "steps/*/contrib/*", "fail", times=2)  # 503 slow down
    out = {}

    def go(r):
        store = FaultyStore(ObjectStore(str(tmp_path)), [commit_write, slot_reads])
        ar = ObjectStoreAllReduce(
            store, 2, r, config=AllReduceConfig(timeout_s=5, poll_interval_s=0.01)
        )
        out[r] = ar.allreduce({"x": torch.full((4,), float(r))}, step=0)["x"]

    threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert commit_write.hits == 1 and slot_reads.hits == 2
    assert torch.equal(out[0], torch.full((4,), 0.5)) and torch.equal(out[1], out[0])


class _ReadOnly(PermissionError):
    def __init__(self, message: str) -> None:
        super().__init__(f"Access Denied (the store is read-only): {message}")


def test_a_store_that_refuses_writes_for_a_while_is_ridden_out(tmp_path):
    """The bucket refuses every write of both replicas for a while (their contribution and
    owner-record uploads fail several times, one lost answer among them): each write is
    retried with backoff and the step commits, with the mean, and no contribution twice."""
    import threading

    from composer_replication.exchange.faulty_store import Fault, FaultyStore
    from composer_replication.exchange.store import ObjectStore

    contributions = Fault("put_if_absent", "steps/*/contrib/*", "fail", times=5, error=_ReadOnly)
    lost_answer = Fault("put_if_absent", "steps/*/contrib/*", "fail_after", times=1)
    owners = Fault("put_if_absent", "steps/*/owner/*", "fail", times=3, error=_ReadOnly)
    out = {}

    def go(r):
        store = FaultyStore(ObjectStore(str(tmp_path)), [contributions, lost_answer, owners])
        ar = ObjectStoreAllReduce(
            store, 2, r, config=AllReduceConfig(timeout_s=20, poll_interval_s=0.01)
        )
        out[r] = ar.allreduce({"x": torch.full((4,), float(r))}, step=0)["x"]

    threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert contributions.hits == 5 and lost_answer.hits == 1 and owners.hits == 3
    assert torch.equal(out[0], torch.full((4,), 0.5)) and torch.equal(out[1], out[0])


def test_a_store_read_only_past_the_upload_limit_fails_the_step_loudly(tmp_path, caplog):
    """Past upload_timeout_s the write is given up as a `StoreTimeoutError` naming the upload
    and the store's error (the step is retried next round); each retry was logged."""
    import logging

    from composer_replication.exchange.faulty_store import Fault, FaultyStore
    from composer_replication.exchange.store import ObjectStore

    refuse = Fault("put_if_absent", "steps/*/contrib/*", "fail", times=None, error=_ReadOnly)
    store = FaultyStore(ObjectStore(str(tmp_path)), [refuse])
    config = AllReduceConfig(timeout_s=4, upload_timeout_s=0.5, poll_interval_s=0.05)
    ar = ObjectStoreAllReduce(store, 2, 0, config=config)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(StoreTimeoutError) as err:
        ar.allreduce({"x": torch.ones(2)}, step=0)
    assert time.monotonic() - t0 < 3  # the upload's limit, not the step's
    assert "upload of" in str(err.value) and "Access Denied" in str(err.value)
    assert isinstance(err.value.__cause__, PermissionError)
    assert refuse.hits >= 3 and "retrying in" in caplog.text
    assert not ObjectStore(str(tmp_path)).list("steps/0/contrib")
