"""Per-writer keys (issue 22, item 1): with the run's slot secret, each rank's upload goes to a
key only its writer (and the run's readers) can name, so an object planted where "its slot" is
is never read and the honest upload counts; a contribution that is refused counts as that rank's
absence, and a step where every rank is judged and too few are valid raises `QuorumLostError`
at once (it can never commit) instead of passing for a retry."""

from __future__ import annotations

import time

import pytest
import torch
from test_robust_screening import honest, mean_of, run
from tolerances import assert_close

from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.protocol import (
    Encoding,
    contrib_key,
    encode_contribution,
    parse_contrib_name,
    step_keys,
)
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.vocabulary import QuorumLostError

SECRET = b"k" * 32


def _payload(tensors, *, rank, step, writer="attacker"):
    payload, _ = encode_contribution(
        tensors,
        rank=rank,
        step=step,
        tokens=1,
        inner_steps=1,
        encoding=Encoding(codec="fp32"),
        writer=writer,
    )
    return b"".join(payload)


def test_slot_keys_are_per_writer_and_unpredictable_without_the_secret(tmp_path):
    ar = ObjectStoreAllReduce(str(tmp_path), 3, 0, slot_secret=SECRET)
    other = ObjectStoreAllReduce(str(tmp_path), 3, 0, slot_secret=b"x" * 32)
    slots = {(s, r): ar.slot(s, r) for s in range(3) for r in range(3)}
    assert len(set(slots.values())) == 9  # a new key per rank and per step
    assert all(other.slot(s, r) != slot for (s, r), slot in slots.items())
    assert ObjectStoreAllReduce(str(tmp_path), 3, 0).slot(1, 1) == ""  # no secret: plain keys
    key = contrib_key(1, 2, ar.slot(1, 2))
    assert key != contrib_key(1, 2) and parse_contrib_name(key.rsplit("/", 1)[1]) == 2
    assert key in step_keys(1, 3, [ar.slot(1, r) for r in range(3)])
    with pytest.raises(ValueError, match="slot_secret must be bytes of length >= 16"):
        ObjectStoreAllReduce(str(tmp_path), 2, 0, slot_secret=b"short")


def test_an_object_planted_in_a_ranks_slot_is_ignored_and_the_honest_one_counts(tmp_path):
    """The issue's case: a finite, normal-looking object (rank 0's contribution of the step
    before, and one with a foreign writer id) where rank 1's upload would go, before rank 1
    writes. Every rank is included, with its own upload, and nothing is rejected."""
    uri = str(tmp_path)
    store = ObjectStore(uri)
    ar = ObjectStoreAllReduce(uri, 3, None, slot_secret=SECRET)
    earlier = _payload(honest(0), rank=0, step=0, writer=None)
    assert store.put_if_absent(contrib_key(1, 1), earlier)  # the plain key
    assert store.put_if_absent(contrib_key(1, 1, ar.slot(0, 1)), earlier)  # last step's name
    assert store.put_if_absent(contrib_key(1, 1, "0" * 32), _payload(honest(7), rank=1, step=1))
    t0 = time.monotonic()
    out = run(uri, [honest(r, 1) for r in range(3)], step=1, slot_secret=SECRET, timeout_s=20)
    assert time.monotonic() - t0 < 15  # nobody waited for a timeout
    first = out[0][0]
    for res, sr in out.values():
        assert not isinstance(res, Exception), res
        assert sr.included_ranks == [0, 1, 2] and sr.rejected == {}, sr
        assert torch.equal(res["w"], first["w"])
        assert_close(res["w"], mean_of([0, 1, 2], step=1)["w"], n=4)


def _plant_in_true_slot(uri, step, rank):
    """An insider (it knows the slot secret) takes rank's real key before rank writes."""
    ar = ObjectStoreAllReduce(uri, 2, None, slot_secret=SECRET)
    body = _payload(honest(0), rank=0, step=step - 1, writer=None)  # rank 0's earlier upload
    assert ObjectStore(uri).put_if_absent(contrib_key(step, rank, ar.slot(step, rank)), body)


def test_a_refused_contribution_counts_as_the_ranks_absence(tmp_path):
    uri = str(tmp_path)
    _plant_in_true_slot(uri, 1, 1)
    out = run(uri, [honest(r, 1) for r in range(2)], step=1, slot_secret=SECRET, min_replicas=1)
    for res, sr in out.values():
        assert not isinstance(res, Exception), res
        assert sr.included_ranks == [0] and sorted(sr.rejected) == [1], sr
        assert_close(res["w"], honest(0, 1)["w"], n=1)
    # the victim says why: its own failed write ("slot squatted"), or, when rank 0 judged the
    # round first, the header of the object in its slot (a race between the two, both true)
    why = out[1][1].rejected[1]
    assert "slot squatted" in why or "a stale or misplaced object" in why, why


def test_a_step_that_can_never_commit_raises_quorum_lost_at_once(tmp_path):
    """Every rank judged, one refused, min_replicas = 2: both ranks raise QuorumLostError
    naming the refusal, without waiting for timeout_s."""
    uri = str(tmp_path)
    _plant_in_true_slot(uri, 1, 1)
    t0 = time.monotonic()
    payloads = [honest(r, 1) for r in range(2)]
    out = run(uri, payloads, step=1, slot_secret=SECRET, min_replicas=2, timeout_s=60)
    assert time.monotonic() - t0 < 30
    for r in (0, 1):
        err = out[r][0]
        assert isinstance(err, QuorumLostError), err
        assert err.step == 1 and sorted(err.rejected) == [1], err.rejected
        assert "min_replicas=2" in str(err)
