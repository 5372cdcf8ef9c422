"""No squatting: a slot holds only what its rank wrote.

The issue's reproduction: a well-formed NaN contribution planted at rank 1's key before the step
was committed as rank 1's, and rank 1's real upload was dropped. Now rank 1 finds its slot taken
by an object it did not write (the writer id in the header is not its own), reports it, and the
round excludes the slot; unsigned runs also need a rank to confirm its slot (owner record)
before anyone commits it. With signing on, a planted object is refused outright.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from allreduce_handles import exchange
from test_robust_screening import SHAPES, honest, mean_of, run
from tolerances import assert_close

from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.protocol import (
    Encoding,
    contrib_key,
    encode_contribution,
    owner_key,
    squat_key,
)
from composer_replication.exchange.settings import AllReduceConfig
from composer_replication.exchange.signing import (
    RunKeys,
    generate_private_key,
    public_key_of,
    rank_identity,
)
from composer_replication.exchange.store import ObjectStore


def plant(uri, rank, tensors, *, step=0, writer=None, owner=False, keys=None):
    """What a party with bucket write access can do: put objects at a rank's keys first."""
    payload, _ = encode_contribution(
        tensors,
        rank=rank,
        step=step,
        tokens=1,
        inner_steps=1,
        encoding=Encoding(codec="fp32"),
        writer=writer,
        keys=keys,
    )
    store = ObjectStore(uri)
    assert store.put_if_absent(contrib_key(step, rank), b"".join(payload))
    if owner:
        assert store.put_if_absent(owner_key(step, rank), json.dumps({"writer": writer}).encode())


def test_a_planted_nan_contribution_is_not_committed_as_the_ranks(tmp_path):
    uri = str(tmp_path)
    plant(uri, 1, {k: torch.full(s, float("nan")) for k, s in SHAPES.items()})
    out = run(uri, [honest(r) for r in range(3)], min_replicas=2, timeout_s=3)
    for res, sr in out.values():
        assert not isinstance(res, Exception), res
        assert sr.included_ranks == [0, 2]
        assert_close(res["w"], mean_of([0, 2])["w"], n=3)  # a 2-rank mean: n = k + 1
        assert "slot squatted" in sr.rejected[1], sr.rejected
    assert "did not write" in out[1][1].rejected[1]
    assert ObjectStore(uri).get(squat_key(0, 1)) is not None  # the victim's report


def test_a_planted_plausible_contribution_is_excluded_too(tmp_path):
    """A finite, normal-looking payload passes screening; only ownership tells it apart."""
    uri = str(tmp_path)
    plant(uri, 1, honest(7), writer="attacker")
    t0 = time.monotonic()
    out = run(uri, [honest(r) for r in range(3)], min_replicas=2, timeout_s=20)
    assert time.monotonic() - t0 < 15, "the victim's report settles the slot without a timeout"
    assert all(sr.included_ranks == [0, 2] for _, sr in out.values())


def test_the_victims_report_excludes_a_slot_planted_with_an_owner_record(tmp_path):
    """The attacker also wrote the owner record; the victim arrives before the commit and
    reports the squat, which the committer checks before including the slot."""
    uri = str(tmp_path)
    plant(uri, 1, honest(7), writer="attacker", owner=True)
    victim = ObjectStoreAllReduce(
        uri, 3, 1, config=AllReduceConfig(timeout_s=10, poll_interval_s=0.01, min_replicas=2)
    )
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", victim.allreduce(honest(1), step=0)))
    t.start()
    deadline = time.monotonic() + 20
    while ObjectStore(uri).get(squat_key(0, 1)) is None:  # the victim has reported it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    out = run(uri, [honest(0), None, honest(2)], min_replicas=2)
    t.join(30)
    for r in (0, 2):
        assert out[r][1].included_ranks == [0, 2] and "slot squatted" in out[r][1].rejected[1]
    assert victim.last_result.included_ranks == [0, 2]


def test_a_retried_step_reuses_the_ranks_own_upload(tmp_path):
    """The same process retrying a step finds its own object (same writer id): not a squat."""
    uri = str(tmp_path)
    alone = ObjectStoreAllReduce(
        uri, 2, 0, config=AllReduceConfig(timeout_s=0.3, poll_interval_s=0.01)
    )
    try:
        alone.allreduce(honest(0), step=0)
    except Exception as e:  # nobody else came
        assert "timeout_s" in str(e)
    box = {}
    t = threading.Thread(
        target=lambda: box.setdefault("r", alone.allreduce(honest(9), step=0))  # old upload counts
    )
    alone.timeout_s = 10
    t.start()
    other = ObjectStoreAllReduce(
        uri, 2, 1, config=AllReduceConfig(timeout_s=10, poll_interval_s=0.01)
    )
    res = other.allreduce(honest(1), step=0)
    t.join(30)
    assert other.last_result.included_ranks == [0, 1] and alone.last_result.rejected == {}
    assert_close(res["w"], mean_of([0, 1])["w"], n=3)  # a 2-rank mean: n = k + 1


def _keys(world):
    private = {rank_identity(r): generate_private_key() for r in range(world)}
    public = {k: public_key_of(v) for k, v in private.items()}
    return private, public


def test_with_signing_a_planted_object_is_refused_outright(tmp_path):
    uri = str(tmp_path)
    private, public = _keys(3)
    run_keys = RunKeys("run-a", public)
    # signed with rank 2's real key, planted in rank 1's slot, owner record and all
    forger = run_keys.with_identity("rank-2", private["rank-2"])
    plant(uri, 1, honest(7), writer="w", owner=True, keys=forger)
    out = {}

    def go(r):
        ar = ObjectStoreAllReduce(
            uri,
            3,
            r,
            config=AllReduceConfig(timeout_s=10, poll_interval_s=0.01, min_replicas=2),
            keys=run_keys.with_identity(rank_identity(r), private[f"rank-{r}"]),
        )
        out[r] = (ar.allreduce(honest(r), step=0), ar.last_result)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    for r in range(3):
        assert out[r][1].included_ranks == [0, 2]
        assert "signed by 'rank-2', but only ['rank-1'] may sign it" in out[r][1].rejected[1]


def test_a_restarted_incarnation_with_the_same_writer_secret_reuses_its_earlier_upload(tmp_path):
    """Rank 0 uploads step 0 and dies before the commit; its next incarnation, given the same
    writer secret (what the run driver hands it), recognises that upload as its own and the step
    commits with both ranks. A different secret would see a squatted slot."""
    uri = str(tmp_path)
    secret = b"s" * 32
    first = ObjectStoreAllReduce(
        uri, 2, 0, config=AllReduceConfig(timeout_s=0.3, poll_interval_s=0.01), writer_secret=secret
    )
    with pytest.raises(Exception, match="timeout_s"):
        first.allreduce(honest(0), step=0)  # rank 1 never came: nothing committed
    first.close()

    stranger = ObjectStoreAllReduce(
        uri, 2, 0, config=AllReduceConfig(timeout_s=10), writer_secret=b"x" * 32
    )
    assert stranger.writer_id(0) != first.writer_id(0)
    restarted = ObjectStoreAllReduce(
        uri, 2, 0, config=AllReduceConfig(timeout_s=10, poll_interval_s=0.01), writer_secret=secret
    )
    assert restarted.writer_id(0) == first.writer_id(0)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", restarted.allreduce(honest(9), step=0)))
    t.start()
    other = ObjectStoreAllReduce(
        uri, 2, 1, config=AllReduceConfig(timeout_s=10, poll_interval_s=0.01)
    )
    res = other.allreduce(honest(1), step=0)
    t.join(30)
    assert restarted.last_result.rejected == {} and other.last_result.included_ranks == [0, 1]
    # the earlier upload (honest(0)); a 2-rank mean: n = k + 1
    assert_close(res["w"], mean_of([0, 1])["w"], n=3)
    assert torch.equal(box["r"]["w"], res["w"])  # every rank computes the same sum: same bits


def test_writer_secret_must_be_long_enough(tmp_path):
    with pytest.raises(ValueError, match="writer_secret must be bytes of length >= 16"):
        ObjectStoreAllReduce(str(tmp_path), 2, 0, writer_secret=b"short")


def test_a_contribution_read_before_its_owner_confirmed_it_is_not_downloaded_again(tmp_path):
    """Rank 0 reads rank 1's object before rank 1's owner record is visible to it (here: never,
    the reads of that record are dropped), so rank 1 commits after the grace period; rank 0 then
    averages the object it already holds (the commit pins its checksum) instead of downloading it
    a second time: the bytes a round reports are the bytes it needs, however the polls fall."""
    from composer_replication.exchange.faulty_store import Fault, FaultyStore

    uri = str(tmp_path)
    hidden = Fault("get", "steps/*/owner/00001*", "drop", times=None)
    kw = {"timeout_s": 8, "poll_interval_s": 0.01}
    r0 = exchange(FaultyStore(ObjectStore(uri), [hidden]), 2, 0, **kw)
    r1 = exchange(uri, 2, 1, **kw)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault(0, r0.allreduce(honest(0), step=0)))
    t.start()
    res1 = r1.allreduce(honest(1), step=0)
    t.join(30)
    assert hidden.hits > 0  # rank 0 never saw rank 1's confirmation
    assert r0.last_result.included_ranks == r1.last_result.included_ranks == [0, 1]
    # each rank downloaded its peer's object (the same size as its own upload) once
    for r in (r0, r1):
        assert r.last_result.bytes_downloaded == r.last_result.bytes_uploaded > 0
    assert torch.equal(box[0]["w"], res1["w"])
