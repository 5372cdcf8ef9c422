"""Departed ranks (the driver's record that a replica is gone) and run generations (fencing),
as the exchange sees them: single processes against file://, with real waits."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from allreduce_handles import exchange

from composer_replication.exchange import AllReduceConfig, ObjectStore, ObjectStoreAllReduce
from composer_replication.exchange.allreduce import StoreTimeoutError
from composer_replication.exchange.fencing import (
    GENERATION_KEY,
    Fence,
    FencedError,
    bump_generation,
    read_generation,
)
from composer_replication.exchange.liveness import (
    REPLICA_ROLE,
    clear_departure,
    departure_key,
    read_departure,
    write_departure,
)
from composer_replication.exchange.protocol import HEAD_KEY, commit_key


def _ar(uri: str, rank: int, **kw) -> ObjectStoreAllReduce:
    kw.setdefault("timeout_s", 30.0)
    kw.setdefault("poll_interval_s", 0.02)
    kw.setdefault("departure_poll_s", 0.2)
    return exchange(uri, 3, rank, **kw)


def test_departure_records_round_trip_and_bad_ones_are_ignored(tmp_path):
    store = ObjectStore(str(tmp_path))
    assert read_departure(store, REPLICA_ROLE, 1) is None
    write_departure(store, REPLICA_ROLE, 1, reason="exit code 1; no restarts left")
    assert read_departure(store, REPLICA_ROLE, 1) == "exit code 1; no restarts left"
    assert clear_departure(store, REPLICA_ROLE, 1) and not clear_departure(store, REPLICA_ROLE, 1)
    assert read_departure(store, REPLICA_ROLE, 1) is None
    # damaged or foreign records never drop a rank
    for body in (
        b"not json",
        b"[1]",
        json.dumps(
            {"format": 1, "kind": "departure", "role": REPLICA_ROLE, "id": "2", "reason": "x"}
        ).encode(),
    ):
        store.put(departure_key(REPLICA_ROLE, 1), body)
        assert read_departure(store, REPLICA_ROLE, 1) is None
    with pytest.raises(ValueError, match="reason"):
        write_departure(store, REPLICA_ROLE, 1, reason="")
    with pytest.raises(ValueError, match="role"):
        departure_key("../x", 1)


def _both(uri: str, timeout_s: float, min_replicas: int) -> dict:
    """Ranks 0 and 1 of 3 exchange step 0 in threads (rank 2 never comes)."""
    out: dict = {}

    def go(r: int) -> None:
        ar = _ar(uri, r, timeout_s=timeout_s, min_replicas=min_replicas)
        t0 = time.monotonic()
        try:
            res = ar.allreduce({"x": torch.full((4,), float(r + 1))}, step=0)
            out[r] = (res, ar.last_result, time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001  (the test inspects it)
            out[r] = (exc, None, time.monotonic() - t0)
        finally:
            ar.close()

    threads = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    return out


def test_a_departed_rank_is_not_waited_for(tmp_path):
    uri = str(tmp_path)
    write_departure(ObjectStore(uri), REPLICA_ROLE, 2, reason="killed by signal SIGKILL")
    out = _both(uri, timeout_s=30.0, min_replicas=2)
    for r in (0, 1):
        res, sr, seconds = out[r]
        assert not isinstance(res, Exception), res
        # not timeout_s = 30 s (the departure poll is 0.2 s; a loaded machine adds seconds, so
        # the bound is the property itself: it did not wait out the timeout)
        assert seconds < 30.0
        assert sr.included_ranks == [0, 1] and sr.excluded_ranks == [2]
        assert sr.rejected[2] == "departed: killed by signal SIGKILL"
        assert torch.equal(res["x"], torch.full((4,), 1.5))  # mean of 1 and 2


def test_with_the_slot_secret_only_a_macd_departure_counts(tmp_path):
    """A departure record planted by a bucket writer (no MAC under the run's slot secret) does
    not make the others leave a rank out: rank 2, late but alive, is still waited for and
    included; one written with the secret (the driver's, a replica's) is honoured."""
    uri, secret = str(tmp_path), b"d" * 32
    store = ObjectStore(uri)
    write_departure(store, REPLICA_ROLE, 2, reason="planted")  # no MAC
    assert read_departure(store, REPLICA_ROLE, 2, secret=secret) is None
    out: dict = {}

    def go(r: int, delay: float) -> None:
        time.sleep(delay)
        ar = _ar(uri, r, timeout_s=30.0, min_replicas=2, slot_secret=secret)
        try:
            ar.allreduce({"x": torch.full((4,), float(r + 1))}, step=0)
            out[r] = ar.last_result
        finally:
            ar.close()

    threads = [threading.Thread(target=go, args=(r, 1.5 if r == 2 else 0.0)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    assert all(out[r].included_ranks == [0, 1, 2] for r in range(3)), out
    write_departure(store, REPLICA_ROLE, 2, reason="exit code 1", secret=secret)
    assert read_departure(store, REPLICA_ROLE, 2, secret=secret) == "exit code 1"
    assert read_departure(store, REPLICA_ROLE, 2) == "exit code 1"  # readers without it


def test_without_the_record_the_survivors_wait_the_timeout(tmp_path):
    out = _both(str(tmp_path), timeout_s=2.0, min_replicas=2)
    for r in (0, 1):
        _, sr, _seconds = out[r]
        assert sr.excluded_ranks == [2]
        assert sr.rejected[2].startswith("missing")
    # the committer commits once timeout_s has passed since its own upload; the other rank's
    # clock starts at its own (under load, possibly later), so only the longest wait is bounded
    assert max(out[r][2] for r in (0, 1)) >= 2.0


def test_a_departed_rank_the_others_cannot_do_without_is_still_waited_for(tmp_path):
    """min_replicas = world size: a rank being restarted is waited for (not failed at once),
    and when its new incarnation arrives in time the step includes it."""
    uri = str(tmp_path)
    store = ObjectStore(uri)
    write_departure(store, REPLICA_ROLE, 2, reason="killed; being restarted")

    def relaunched() -> None:
        time.sleep(1.0)
        clear_departure(store, REPLICA_ROLE, 2)
        ar = _ar(uri, 2, min_replicas=3)
        ar.allreduce({"x": torch.full((4,), 3.0)}, step=0)
        ar.close()

    late = threading.Thread(target=relaunched)
    late.start()
    out = _both(uri, timeout_s=30.0, min_replicas=3)
    late.join(timeout=60)
    for r in (0, 1):
        res, sr, seconds = out[r]
        assert not isinstance(res, Exception), res
        # waited for the relaunched rank (it is included), not failed at once, and not timed
        # out (seconds bounds only by the property: load can stretch the 1 s relaunch delay)
        assert sr.included_ranks == [0, 1, 2] and seconds < 30.0
        assert torch.equal(res["x"], torch.full((4,), 2.0))


def test_a_rank_that_came_back_is_waited_for_again(tmp_path):
    uri = str(tmp_path)
    store = ObjectStore(uri)
    write_departure(store, REPLICA_ROLE, 2, reason="being restarted")
    assert not isinstance(_both(uri, timeout_s=30.0, min_replicas=2)[0][0], Exception)
    clear_departure(store, REPLICA_ROLE, 2)  # the relaunched incarnation is ready
    ar = _ar(uri, 0, timeout_s=1.5, min_replicas=3)
    with pytest.raises(StoreTimeoutError, match=r"missing ranks \[1, 2\]"):
        ar.allreduce({"x": torch.ones(4)}, step=1)  # rank 2 is expected again (and 1 too)


def _commit(step: int) -> bytes:
    """A well-formed commit record of ``step`` naming rank 0 (what the run wrote)."""
    record = {
        "format": 1,
        "kind": "commit",
        "step": step,
        "world_size": 2,
        "included_ranks": [0],
        "weights": {"0": 1.0},
        "checksums": {"0": {"algo": "sha256", "value": "0" * 64}},
    }
    return json.dumps(record).encode()


def test_a_stalled_rank_does_not_commit_a_step_the_run_left_behind(tmp_path):
    """Rank 1 stalled in step 1 while rank 0 committed up to step 5 (step 1's record is
    garbage-collected) and finished: rank 0's departure must not let rank 1 commit step 1
    alone; it is told to rejoin from the latest state instead."""
    uri = str(tmp_path)
    store = ObjectStore(uri)
    write_departure(store, REPLICA_ROLE, 0, reason="finished training")
    # the head hint lags (a committer stopped between its record and the hint set it back)
    store.put_json(HEAD_KEY, {"kind": "head", "step": 0})
    ar = ObjectStoreAllReduce(
        uri,
        2,
        1,
        config=AllReduceConfig(
            timeout_s=30.0, min_replicas=1, poll_interval_s=0.02, departure_poll_s=1.0
        ),
    )
    # the run moves past step 1 while rank 1 waits in it (after its upload)
    # (well-formed records of steps 4 and 5: a lone or malformed one is not believed)
    threading.Timer(0.3, lambda: [store.put(commit_key(s), _commit(s)) for s in (4, 5)]).start()
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="already at step 5"):
        ar.allreduce({"x": torch.ones(4)}, step=1)
    assert time.monotonic() - t0 < 5.0
    assert store.get("steps/0000000001/commit.json") is None


def test_generations_count_launches_and_fence_older_ones(tmp_path):
    store = ObjectStore(str(tmp_path))
    assert read_generation(store) == 0  # started by hand: no launch wrote one
    assert bump_generation(store) == 1 and bump_generation(store) == 2
    fence = Fence(store, 2)
    fence()  # current: nothing happens
    old = Fence(store, 1)
    with pytest.raises(FencedError, match="launch 1 .* launch 2"):
        old()
    store.put(GENERATION_KEY, b'{"format": 1, "kind": "generation", "generation": -3}')
    with pytest.raises(ValueError, match="generation -3"):
        read_generation(store)
    with pytest.raises(ValueError, match="generation must be"):
        Fence(store, -1)


@pytest.mark.parametrize(
    "planted",
    [
        b'{"format": 1, "kind": "generation", "generation": 999}',  # no MAC
        b'{"format": 1, "kind": "generation", "generation": 999, "mac": "00"}',  # a wrong one
        b'{"format": 1, "kind": "generation", "gener',  # damaged
    ],
    ids=["no-mac", "wrong-mac", "damaged"],
)
def test_a_planted_generation_does_not_fence_the_runs_replicas(tmp_path, planted):
    """With the run's slot secret, only a launch of the run can fence its replicas: a planted
    or damaged run_generation.json is ignored (and noted); a real newer launch still fences."""
    secret = b"k" * 32
    store = ObjectStore(str(tmp_path))
    assert bump_generation(store, secret) == 1
    fence = Fence(store, 1, secret=secret)
    fence()
    store.put(GENERATION_KEY, planted)  # written once by anyone with bucket access
    fence()  # not tripped
    fence()
    assert fence.tripped is None and fence.refused is not None
    assert "not written by a launch of this run" in fence.refused or "generation" in fence.refused
    if planted.endswith(b"}"):
        assert bump_generation(store, secret) == 1000  # a relaunch numbers itself above it
    else:
        store.delete(GENERATION_KEY)  # the driver names a damaged one: delete it to resume
        assert bump_generation(store, secret) == 1
        fence = Fence(store, 0, secret=secret)
    with pytest.raises(FencedError, match="launch 0|launch 1 "):
        fence()  # a real newer launch (MACed under the secret) fences


def test_a_fenced_store_writes_nothing_and_a_fenced_exchange_uploads_nothing(tmp_path):
    uri = str(tmp_path)
    store = ObjectStore(uri)
    bump_generation(store)
    store.write_guard = Fence(store, 1)
    store.put_json("replicas/0/status.json", {"ok": 1})  # current launch: written
    bump_generation(ObjectStore(uri))  # a --resume took over
    for write in (
        lambda: store.put_json("replicas/0/status.json", {"ok": 2}),
        lambda: store.put_if_absent("replicas/0/metrics/00000001.jsonl", b"{}\n"),
        lambda: store.delete("replicas/0/status.json"),
    ):
        with pytest.raises(FencedError):
            write()
    assert store.get_json("replicas/0/status.json") == {"ok": 1}
    assert store.get("replicas/0/metrics/00000001.jsonl") is None
    ar = _ar(uri, 0, fence=Fence(ObjectStore(uri), 1))
    with pytest.raises(FencedError):
        ar.allreduce({"x": torch.ones(4)}, step=0)
    assert ObjectStore(uri).list("steps/") == []  # no contribution, no owner record
