"""Hostile or broken objects in the store: rejected with clear errors, never unpickled.

Ranks 0 and 1 are honest replicas (threads); rank 2's slot holds a forged/broken object. With
min_replicas=2 the step completes from the honest two and reports why rank 2 was refused; with
min_replicas=3 it fails cleanly and commits nothing. Committed records are never modified.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import threading

import pytest
import torch
from allreduce_handles import exchange
from safetensors.torch import save as st_save
from test_allreduce_workers import SHAPES, make_tensors
from tolerances import assert_close

from composer_replication.exchange.allreduce import (
    AllReduceConfig,
    CorruptContributionError,
    ObjectStoreAllReduce,
)
from composer_replication.exchange.protocol import (
    HEADER_KEY,
    Encoding,
    commit_key,
    contrib_key,
    encode_contribution,
)
from composer_replication.exchange.store import ObjectStore


class _Evil:
    """Unpickling this creates a marker file: proof that someone ran pickle on store data."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _blob(rank=2, step=0, tensors=None, codec="fp32"):
    tensors = make_tensors(rank, step) if tensors is None else tensors
    payload, _ = encode_contribution(
        tensors, rank=rank, step=step, tokens=1, inner_steps=1, encoding=Encoding(codec=codec)
    )
    return b"".join(payload)


def _forged_header_blob():
    """Valid safetensors + checksum, but the header claims int8 while the parts are fp32."""
    payload, contrib = encode_contribution(
        make_tensors(2, 0), rank=2, step=0, tokens=1, inner_steps=1, encoding=Encoding(codec="fp32")
    )
    blob = b"".join(payload)
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    h = json.loads(header[HEADER_KEY])
    h["codec"] = "int8"
    return st_save(contrib.parts, metadata={HEADER_KEY: json.dumps(h)})


def _torch_save_blob():
    buf = io.BytesIO()
    torch.save(make_tensors(2, 0), buf)
    return buf.getvalue()


def _flip_last_byte(b: bytes) -> bytes:
    return b[:-1] + bytes([b[-1] ^ 0xFF])


HOSTILE = {
    "truncated_in_data": (lambda m: _blob()[:-40], "malformed or truncated"),
    "truncated_in_header": (lambda m: _blob()[:60], "not a safetensors payload"),
    "bad_checksum": (lambda m: _flip_last_byte(_blob()), "checksum mismatch"),
    "wrong_shapes": (
        lambda m: _blob(tensors={n: torch.zeros(2, 2) for n in SHAPES}),
        "names/shapes/dtypes differ",
    ),
    "wrong_dtypes": (
        lambda m: _blob(tensors={n: t.half() for n, t in make_tensors(2, 0).items()}),
        "names/shapes/dtypes differ",
    ),
    "header_for_other_step": (lambda m: _blob(step=7), "step 7"),
    "header_for_other_rank": (lambda m: _blob(rank=1), "header says rank 1"),
    "forged_codec_header": (lambda m: _forged_header_blob(), "do not match the header"),
    "not_safetensors": (lambda m: b"just some text, not tensors " * 20, "not a safetensors"),
    "pickle": (lambda m: pickle.dumps({"grad": _Evil(m)}), "not a safetensors payload"),
    "torch_save_zip": (lambda m: _torch_save_blob(), "not a safetensors payload"),
}


@pytest.fixture
def no_pickle(monkeypatch):
    """Make any unpickling during the test fail loudly."""

    def refuse(*a, **k):
        raise AssertionError("something tried to unpickle data read from the store")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)


def run_honest(uri, ranks, world_size=3, **kwargs):
    """Ranks as threads; returns {rank: (result or exception, last_result)}."""
    out = {}

    def go(r):
        ar = exchange(uri, world_size, r, timeout_s=5, poll_interval_s=0.01, **kwargs)
        try:
            out[r] = (ar.allreduce(make_tensors(r, 0), step=0), ar.last_result)
        except Exception as e:
            out[r] = (e, ar.last_result)

    threads = [threading.Thread(target=go, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_payload_is_rejected_and_step_completes(tmp_path, kind, no_pickle):
    make, reason = HOSTILE[kind]
    marker = str(tmp_path / "pwned")
    uri = str(tmp_path / "run")
    assert ObjectStore(uri).put_if_absent(contrib_key(0, 2), make(marker))
    out = run_honest(uri, [0, 1], min_replicas=2)
    expected = {n: (make_tensors(0, 0)[n] + make_tensors(1, 0)[n]) / 2 for n in SHAPES}
    for r in (0, 1):
        res, sr = out[r]
        assert not isinstance(res, Exception), res
        assert sr.included_ranks == [0, 1] and sr.excluded_ranks == [2]
        assert reason in sr.rejected[2], sr.rejected[2]
        for n in SHAPES:
            assert torch.equal(res[n], out[0][0][n])
            # two fp32 means of the same 2 tensors, grouped differently: n = k + 1 = 3
            assert_close(res[n], expected[n], n=3)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("kind", ["pickle", "bad_checksum"])
def test_hostile_payload_with_min_replicas_unmet_fails_cleanly(tmp_path, kind, no_pickle):
    make, reason = HOSTILE[kind]
    uri = str(tmp_path / "run")
    ObjectStore(uri).put_if_absent(contrib_key(0, 2), make(str(tmp_path / "pwned")))
    out = run_honest(uri, [0, 1])  # min_replicas = world_size = 3
    for r in (0, 1):
        err = out[r][0]
        assert isinstance(err, CorruptContributionError)
        assert "only 2 valid contributions" in str(err) and "nothing committed" in str(err)
        assert reason in str(err)
    assert ObjectStore(uri).get(commit_key(0)) is None


def test_hostile_payload_on_moto_is_rejected(moto_server, no_pickle, tmp_path):
    _, bucket, options = moto_server
    uri = f"s3://{bucket}/hostile/{tmp_path.name}"
    marker = str(tmp_path / "pwned")
    ObjectStore(uri, options).put_if_absent(contrib_key(0, 2), HOSTILE["pickle"][0](marker))
    out = run_honest(uri, [0, 1], min_replicas=2, storage_options=options)
    assert all(sr.included_ranks == [0, 1] for _, sr in out.values())
    assert "not a safetensors payload" in out[0][1].rejected[2]
    assert not os.path.exists(marker)


def test_commit_record_is_never_modified(tmp_path):
    uri = str(tmp_path / "run")
    out = run_honest(uri, [0, 1, 2])
    store = ObjectStore(uri)
    original = store.get(commit_key(0))
    ar = ObjectStoreAllReduce(uri, 3, 1, config=AllReduceConfig(timeout_s=5))
    contribs = {
        r: encode_contribution(
            make_tensors(r, 0),
            rank=r,
            step=0,
            tokens=1,
            inner_steps=1,
            encoding=Encoding(codec="fp32"),
        )[1]
        for r in (1, 2)
    }
    commit = ar._write_commit(0, contribs, {0: "forged"})  # a second writer loses...
    assert commit["included_ranks"] == [0, 1, 2]  # ...and obeys the first record
    assert not store.put_if_absent(commit_key(0), b"{}")
    assert store.get(commit_key(0)) == original
    # a replica arriving late obeys the same record and gets the same bits
    late = ObjectStoreAllReduce(uri, 3, 1, config=AllReduceConfig(timeout_s=5)).allreduce(
        make_tensors(1, 0), step=0
    )
    assert all(torch.equal(late[n], out[0][0][n]) for n in SHAPES)


def test_tampered_contribution_after_commit_fails_instead_of_diverging(tmp_path):
    uri = str(tmp_path / "run")
    run_honest(uri, [0, 1, 2])
    # someone overwrites rank 1's object after the commit (bypassing put-if-absent)
    path = tmp_path / "run" / contrib_key(0, 1)
    os.unlink(path)
    path.write_bytes(_blob(rank=1, tensors=make_tensors(9, 9)))
    with pytest.raises(CorruptContributionError, match="does not match the checksum in the commit"):
        ObjectStoreAllReduce(uri, 3, 2, config=AllReduceConfig(timeout_s=5)).allreduce(
            make_tensors(2, 0), step=0
        )


def test_garbage_commit_record_fails_cleanly(tmp_path):
    uri = str(tmp_path / "run")
    store = ObjectStore(uri)
    store.put_if_absent(commit_key(0), b"\x80\x04not json")
    with pytest.raises(CorruptContributionError, match="commit record of step 0 is not JSON"):
        ObjectStoreAllReduce(uri, 2, 0, config=AllReduceConfig(timeout_s=5)).allreduce(
            make_tensors(0, 0), step=0
        )
    store.put_if_absent(commit_key(1), json.dumps({"format": 1, "kind": "commit"}).encode())
    with pytest.raises(CorruptContributionError, match="malformed"):
        ObjectStoreAllReduce(uri, 2, 0, config=AllReduceConfig(timeout_s=5)).allreduce(
            make_tensors(0, 1), step=1
        )
    assert store.get(commit_key(0)) == b"\x80\x04not json"


def test_a_committer_whose_own_upload_rotted_leaves_itself_out(tmp_path):
    """Rank 0's contribution is stored with one byte flipped (bit rot on write: FaultyStore):
    the others refuse it. Rank 0 arrives last and, as the lowest rank, commits at once while
    the others sleep between polls. With ``verify_own_upload`` it must not list its own
    contribution from memory (the others could not read it back and every one of them would fail
    the step); it checks its stored copy, leaves itself out and the step commits from ranks 1 and
    2 on every rank."""
    from composer_replication.exchange.faulty_store import Fault, FaultyStore

    uri = str(tmp_path / "run")
    out: dict[int, tuple[object, object]] = {}

    def go(r: int, store: object, poll: float) -> None:
        ar = exchange(
            store, 3, r, timeout_s=5, poll_interval_s=poll, min_replicas=2, verify_own_upload=True
        )
        try:
            out[r] = (ar.allreduce(make_tensors(r, 0), step=0), ar.last_result)
        except Exception as e:
            out[r] = (e, ar.last_result)

    late = [threading.Thread(target=go, args=(r, uri, 0.5)) for r in (1, 2)]
    for t in late:
        t.start()
    store = ObjectStore(uri)
    while not all(store.exists(contrib_key(0, r)) for r in (1, 2)):
        threading.Event().wait(0.01)
    rot = FaultyStore(
        ObjectStore(uri), [Fault("put_if_absent", "steps/*/contrib/00000*", "corrupt")]
    )
    first = threading.Thread(target=go, args=(0, rot, 0.01))
    first.start()
    for t in (first, *late):
        t.join(60)
    expected = {n: (make_tensors(1, 0)[n] + make_tensors(2, 0)[n]) / 2 for n in SHAPES}
    for r in (0, 1, 2):
        res, sr = out[r]
        assert not isinstance(res, Exception), (r, res)
        assert sr.included_ranks == [1, 2] and sr.excluded_ranks == [0], (r, sr)
        for n in SHAPES:
            assert torch.equal(res[n], out[1][0][n])
            assert_close(res[n], expected[n], n=3)
