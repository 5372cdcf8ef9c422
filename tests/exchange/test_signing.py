"""Signed contributions ([security] sign = true): exchange/signing.py and the signed exchange.

The threat model of the issue: a rank cannot forge another rank's contribution; a party with
only bucket write access cannot inject anything (contribution, commit record, state, manifest);
an old round's (or another run's) object replayed is refused; with signing off nothing changes.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from allreduce_handles import exchange
from test_robust_screening import SHAPES, honest, mean_of
from tolerances import assert_close

from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.document_format import encode_state, state_key
from composer_replication.exchange.protocol import (
    HEADER_KEY,
    CorruptContributionError,
    Encoding,
    commit_key,
    contrib_key,
    decode_contribution,
    encode_contribution,
)
from composer_replication.exchange.settings import AllReduceConfig
from composer_replication.exchange.signing import (
    DRIVER,
    KEYS_KEY,
    SYNCHRONIZER,
    RunKeys,
    SignatureError,
    canonical_bytes,
    generate_private_key,
    make_key_manifest,
    parse_key_manifest,
    public_key_of,
    rank_identity,
)
from composer_replication.exchange.store import ObjectStore

WORLD = 3


class Run:
    """What the driver sets up: keys per rank, the signed manifest in the store."""

    def __init__(self, uri: str, run_id: str = "run-1", world: int = WORLD) -> None:
        self.uri = uri
        self.driver = generate_private_key()
        self.private = {rank_identity(r): generate_private_key() for r in range(world)}
        self.private[SYNCHRONIZER] = generate_private_key()
        public = {k: public_key_of(v) for k, v in self.private.items()}
        record = make_key_manifest(run_id, public, self.driver)
        ObjectStore(uri).put_if_absent(KEYS_KEY, json.dumps(record).encode())
        # what a replica does: verify the manifest with the driver key it got out of band
        self.keys = parse_key_manifest(ObjectStore(uri).get(KEYS_KEY), public_key_of(self.driver))

    def of(self, rank: int) -> RunKeys:
        ident = rank_identity(rank)
        return self.keys.with_identity(ident, self.private[ident])


def run_signed(run: Run, payloads, *, step=0, **kwargs):
    out = {}

    def go(r):
        ar = exchange(
            run.uri, len(payloads), r, timeout_s=10, poll_interval_s=0.01, keys=run.of(r), **kwargs
        )
        try:
            out[r] = (ar.allreduce(payloads[r], step=step), ar.last_result)
        except Exception as e:
            out[r] = (e, ar.last_result)

    ranks = [r for r, p in enumerate(payloads) if p is not None]
    threads = [threading.Thread(target=go, args=(r,)) for r in ranks]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    return out


def blob(tensors, *, rank, step=0, keys=None):
    payload, _ = encode_contribution(
        tensors,
        rank=rank,
        step=step,
        tokens=1,
        inner_steps=1,
        encoding=Encoding(codec="fp32"),
        keys=keys,
        writer="w",
    )
    return b"".join(payload)


def rewrite_header(raw: bytes, **changes) -> bytes:
    """The same payload with header fields changed (the signature left as it was)."""
    from safetensors.torch import load, save

    n = int.from_bytes(raw[:8], "little")
    h = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"][HEADER_KEY])
    h.update(changes)
    return save(load(raw), metadata={HEADER_KEY: json.dumps(h)})


# ----------------------------------------------------------------------------- keys


def test_key_manifest_verifies_only_with_the_drivers_key(tmp_path):
    run = Run(str(tmp_path))
    raw = ObjectStore(str(tmp_path)).get(KEYS_KEY)
    assert run.keys.public_keys[DRIVER] == public_key_of(run.driver)
    with pytest.raises(SignatureError, match="not signed by this run's driver key"):
        parse_key_manifest(raw, public_key_of(generate_private_key()))
    doc = json.loads(bytes(raw))
    doc["public_keys"]["rank-1"] = public_key_of(generate_private_key())  # substitute a key
    with pytest.raises(SignatureError, match="not signed by this run's driver key"):
        parse_key_manifest(json.dumps(doc).encode(), public_key_of(run.driver))
    with pytest.raises(SignatureError, match="missing"):
        parse_key_manifest(None, public_key_of(run.driver))


def test_a_private_key_from_another_run_is_refused_with_a_clear_error(tmp_path):
    run = Run(str(tmp_path))
    with pytest.raises(ValueError, match="does not match its public key"):
        run.keys.with_identity("rank-0", generate_private_key())
    with pytest.raises(ValueError, match="64 hex characters"):
        run.keys.with_identity("rank-0", "not-a-key")


def test_signature_covers_the_canonical_record():
    assert canonical_bytes({"b": 1, "a": [1, 2], "signature": "x"}).endswith(b'{"a":[1,2],"b":1}')


# ----------------------------------------------------------------------------- exchange


def test_signed_exchange_agrees_and_signs_every_record(tmp_path):
    run = Run(str(tmp_path))
    out = run_signed(run, [honest(r) for r in range(WORLD)])
    for res, sr in out.values():
        assert not isinstance(res, Exception), res
        assert sr.included_ranks == [0, 1, 2]
        assert_close(res["w"], mean_of([0, 1, 2])["w"], n=4)  # a 3-rank mean: n = k + 1
    commit = ObjectStore(str(tmp_path)).get_json(commit_key(0))
    assert commit["signer"] == rank_identity(commit["committed_by"]) and commit["run_id"] == "run-1"
    raw = bytes(ObjectStore(str(tmp_path)).get(contrib_key(0, 1)))
    c = decode_contribution(raw, step=0, rank=1, keys=run.keys)
    assert c.checksum_algo == "sha256"


def test_a_rank_cannot_forge_another_ranks_contribution(tmp_path):
    """Rank 2 (holding a valid key) writes into rank 1's slot: signed as itself it is refused
    (wrong signer), claiming to be rank 1 its signature does not verify."""
    run = Run(str(tmp_path))
    forged = blob(honest(7), rank=1, keys=run.of(2))
    with pytest.raises(SignatureError, match="signed by 'rank-2', but only \\['rank-1'\\]"):
        decode_contribution(forged, step=0, rank=1, keys=run.keys)
    as_rank1 = rewrite_header(forged, signer="rank-1")
    with pytest.raises(SignatureError, match="does not verify"):
        decode_contribution(as_rank1, step=0, rank=1, keys=run.keys)
    ObjectStore(str(tmp_path)).put_if_absent(contrib_key(0, 1), as_rank1)
    out = run_signed(run, [honest(0), None, honest(2)], min_replicas=2)
    assert all(sr.included_ranks == [0, 2] for _, sr in out.values())


@pytest.mark.parametrize("kind", ["unsigned", "unknown_key", "tampered_payload"])
def test_a_bucket_writer_cannot_inject_a_contribution(tmp_path, kind):
    run = Run(str(tmp_path))
    if kind == "unsigned":
        bad, match = blob(honest(7), rank=1), "not signed"
    elif kind == "unknown_key":
        other = Run(str(tmp_path / "other"))  # a key pair the run does not know, same ids
        bad, match = blob(honest(7), rank=1, keys=other.of(1)), "does not verify"
    else:  # a genuine signed object of rank 1 with other tensor bytes under the same header
        genuine = blob(honest(1), rank=1, keys=run.of(1))
        bad = genuine[:-4] + bytes(4)
        match = "sha256 checksum mismatch"
    ObjectStore(str(tmp_path)).put_if_absent(contrib_key(0, 1), bad)
    out = run_signed(run, [honest(0), None, honest(2)], min_replicas=2)
    for _, sr in out.values():
        assert sr.included_ranks == [0, 2] and match in sr.rejected[1], sr.rejected


def test_a_bucket_writer_cannot_inject_a_commit_record(tmp_path):
    """A forged commit record blocks the step (the key is taken) but is never obeyed."""
    run = Run(str(tmp_path))
    forged = {
        "format": 1,
        "kind": "commit",
        "step": 0,
        "world_size": WORLD,
        "included_ranks": [0],
        "weights": {"0": 1.0},
        "checksums": {"0": {"algo": "sha256", "value": "0" * 64}},
        "committed_by": 0,
        "run_id": "run-1",
        "signer": "rank-0",
        "signature": "ab" * 64,
    }
    ObjectStore(str(tmp_path)).put_if_absent(commit_key(0), json.dumps(forged).encode())
    out = run_signed(run, [honest(r) for r in range(WORLD)])
    for res, _ in out.values():
        assert isinstance(res, SignatureError) and "does not verify" in str(res)


def test_a_bucket_writer_cannot_inject_a_state(tmp_path):
    run = Run(str(tmp_path))
    signed = ObjectStoreAllReduce(str(tmp_path), WORLD, 0, keys=run.of(0))
    assert signed.publish_state({"w": torch.ones(2)}, round=1)
    planted = encode_state({"w": torch.full((2,), 9.0)}, name="global", round=2, extra={})
    ObjectStore(str(tmp_path)).put_if_absent(state_key("global", 2), planted)
    reader = ObjectStoreAllReduce(str(tmp_path), WORLD, 1, keys=run.of(1))
    with pytest.raises(SignatureError, match="state 'global' round 2 is not signed"):
        reader.fetch_state()
    assert torch.equal(reader.fetch_state(round=1)[1]["w"], torch.ones(2))
    # the synchronizer's key may sign states too (decoupled mode)
    sync = run.keys.with_identity(SYNCHRONIZER, run.private[SYNCHRONIZER])
    assert ObjectStoreAllReduce(str(tmp_path), WORLD, keys=sync).publish_state(
        {"w": torch.zeros(2)}, round=3
    )
    assert reader.fetch_state(round=3)[0] == 3


def test_a_bucket_writer_cannot_inject_a_manifest(tmp_path):
    run = Run(str(tmp_path))
    fingerprint = {"parameters": {"w": [[2], "float32"]}, "num_parameters": 2}
    planted = {
        "format": 1,
        "kind": "manifest",
        "world_size": WORLD,
        "codec": "fp32",
        "fingerprint": fingerprint,
    }
    ObjectStore(str(tmp_path)).put_if_absent("manifest.json", json.dumps(planted).encode())
    ar = ObjectStoreAllReduce(str(tmp_path), WORLD, 0, keys=run.of(0))
    with pytest.raises(SignatureError, match="run manifest .* is not signed"):
        ar.ensure_manifest(fingerprint)
    # a key manifest re-signed with an attacker's own "driver" key is refused as shown above;
    # a genuine signed run manifest is accepted by every rank
    fresh = Run(str(tmp_path / "fresh"))
    ObjectStoreAllReduce(fresh.uri, WORLD, 0, keys=fresh.of(0)).ensure_manifest(fingerprint)
    ObjectStoreAllReduce(fresh.uri, WORLD, 2, keys=fresh.of(2)).ensure_manifest(fingerprint)


def test_a_replayed_object_from_an_old_round_or_another_run_is_refused(tmp_path):
    run = Run(str(tmp_path))
    old = blob(honest(1), rank=1, step=0, keys=run.of(1))
    with pytest.raises(CorruptContributionError, match="header says rank 1 step 0"):
        decode_contribution(old, step=5, rank=1, keys=run.keys)
    with pytest.raises(SignatureError, match="does not verify"):
        decode_contribution(rewrite_header(old, step=5), step=5, rank=1, keys=run.keys)
    # the same rank key, another run (a key reused across runs would still be bound to its run)
    other_run = RunKeys("run-2", run.keys.public_keys).with_identity(
        "rank-1", run.private["rank-1"]
    )
    with pytest.raises(SignatureError, match="signed for run 'run-2'.*replayed from another run"):
        decode_contribution(blob(honest(1), rank=1, keys=other_run), step=0, rank=1, keys=run.keys)
    # an old commit record copied to a later step is refused (its signed step differs)
    run_signed(run, [honest(r) for r in range(WORLD)])
    store = ObjectStore(str(tmp_path))
    store.put_if_absent(commit_key(1), bytes(store.get(commit_key(0))))
    out = run_signed(run, [honest(r, 1) for r in range(WORLD)], step=1)
    assert all(isinstance(res, CorruptContributionError) for res, _ in out.values())


def test_signing_off_keeps_todays_behaviour(tmp_path):
    """No keys: no signature fields, any checksum, and unsigned objects are accepted."""
    payload, c = encode_contribution(
        honest(0),
        rank=0,
        step=0,
        tokens=None,
        inner_steps=None,
        encoding=Encoding(codec="fp32", checksum="xxh3-128"),
    )
    raw = b"".join(payload)
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"][HEADER_KEY])
    assert "signature" not in h and h["checksum"]["algo"] == "xxh3-128"
    assert decode_contribution(raw, step=0, rank=0).digest == c.digest
    out = {}

    def go(r):
        ar = ObjectStoreAllReduce(
            str(tmp_path), 2, r, config=AllReduceConfig(timeout_s=10, poll_interval_s=0.01)
        )
        out[r] = ar.allreduce(honest(r), step=0)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    for k in SHAPES:
        assert_close(out[0][k], mean_of([0, 1])[k], n=3)  # a 2-rank mean: n = k + 1
        assert torch.equal(out[0][k], out[1][k])
    assert "signature" not in ObjectStore(str(tmp_path)).get_json(commit_key(0))
