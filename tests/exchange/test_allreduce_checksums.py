"""Self-describing contribution checksums (docs/object-store.md, "Checksums").

The writer picks the algorithm (``checksum=`` on ObjectStoreAllReduce, default xxh3-128 when
``xxhash`` imports, else sha256); headers carry ``{"algo", "value"}``, the commit record pins
both per rank, and readers verify with whatever algorithm the header names. Replicas are
in-process threads on file:// under tmp_path; a broken/foreign object is planted in rank 2's
slot before the honest ranks start (as in test_allreduce_hostile.py).
"""

from __future__ import annotations

import json
import os
import sys
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
from composer_replication.exchange.checksums import default_checksum
from composer_replication.exchange.protocol import (
    HEADER_KEY,
    Encoding,
    commit_key,
    contrib_key,
    decode_contribution,
    encode_contribution,
)
from composer_replication.exchange.store import ObjectStore

ALGOS = ["sha256", "xxh3-128"]


def run_replicas(uri: str, checksums: dict[int, str | None], world_size: int = 3, **kwargs):
    """Ranks ``checksums`` as threads (value: their ``checksum=``); {rank: (result|exc, last)}."""
    out: dict[int, tuple] = {}

    def go(r: int) -> None:
        ar = exchange(
            uri, world_size, r, timeout_s=5, poll_interval_s=0.01, checksum=checksums[r], **kwargs
        )
        try:
            out[r] = (ar.allreduce(make_tensors(r, 0), step=0), ar.last_result)
        except Exception as e:
            out[r] = (e, ar.last_result)

    threads = [threading.Thread(target=go, args=(r,)) for r in checksums]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == set(checksums), "a replica thread hung"
    return out


def header_of(blob: bytes) -> dict:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(json.loads(bytes(blob[8 : 8 + n]))["__metadata__"][HEADER_KEY])


def stored_header(uri: str, rank: int) -> dict:
    return header_of(bytes(ObjectStore(uri).get(contrib_key(0, rank))))


def stored_commit(uri: str) -> dict:
    return json.loads(bytes(ObjectStore(uri).get(commit_key(0))))


def assert_agree_on_mean(out: dict, ranks: list[int]) -> None:
    """No errors, bit-identical across replicas, and equal to the plain mean of ``ranks``."""
    for r, (res, _) in out.items():
        assert not isinstance(res, Exception), f"rank {r}: {res!r}"
    first = next(iter(out.values()))[0]
    for n in SHAPES:
        expected = sum(make_tensors(r, 0)[n] for r in ranks) / len(ranks)
        for res, _ in out.values():
            assert torch.equal(res[n], first[n])
        # both are fp32 k-term means in other groupings (k additions and the division): n = k + 1
        assert_close(first[n], expected, n=len(ranks) + 1)


def blob(rank: int = 2, algo: str | None = None) -> bytes:
    payload, _ = encode_contribution(
        make_tensors(rank, 0),
        rank=rank,
        step=0,
        tokens=1,
        inner_steps=1,
        encoding=Encoding(codec="fp32", checksum=algo),
    )
    return b"".join(payload)


def reheadered_blob(edit) -> bytes:
    """Rank 2's valid contribution with its protocol header passed through ``edit``."""
    payload, contrib = encode_contribution(
        make_tensors(2, 0),
        rank=2,
        step=0,
        tokens=1,
        inner_steps=1,
        encoding=Encoding(codec="fp32", checksum="sha256"),
    )
    h = header_of(b"".join(payload))
    edit(h)
    return st_save(contrib.parts, metadata={HEADER_KEY: json.dumps(h)})


def flip_last_data_byte(b: bytes) -> bytes:
    return b[:-1] + bytes([b[-1] ^ 0xFF])


@pytest.fixture
def no_xxhash(monkeypatch):
    """This process cannot import xxhash (checksums imports it lazily, at each use)."""
    monkeypatch.setitem(sys.modules, "xxhash", None)


def test_all_sha256_replicas_agree_and_headers_say_sha256(tmp_path):
    uri = str(tmp_path / "run")
    out = run_replicas(uri, {0: "sha256", 1: "sha256", 2: "sha256"})
    assert_agree_on_mean(out, [0, 1, 2])
    for r in range(3):
        assert out[r][1].included_ranks == [0, 1, 2]
        h = stored_header(uri, r)
        assert h["checksum"]["algo"] == "sha256"
        assert (
            h["checksum"]
            == decode_contribution(ObjectStore(uri).get(contrib_key(0, r)), step=0, rank=r).checksum
        )
        assert "sha256" not in h  # the old (pre-"checksum") field is gone
    pinned = stored_commit(uri)["checksums"]
    assert {r: c["algo"] for r, c in pinned.items()} == {
        "0": "sha256",
        "1": "sha256",
        "2": "sha256",
    }
    assert all(pinned[str(r)] == stored_header(uri, r)["checksum"] for r in range(3))
    # the checksum only guards the bytes: the mean is the same bits as under the default
    default = run_replicas(str(tmp_path / "default"), {0: None, 1: None, 2: None})
    for n in SHAPES:
        assert torch.equal(out[0][0][n], default[0][0][n])


def test_default_is_xxh3_when_xxhash_imports(tmp_path):
    pytest.importorskip("xxhash")
    assert default_checksum() == "xxh3-128"
    uri = str(tmp_path / "run")
    ar = ObjectStoreAllReduce(uri, 2, 0)
    assert ar.checksum == "xxh3-128"
    out = run_replicas(uri, {0: None, 1: None}, world_size=2)
    assert_agree_on_mean(out, [0, 1])
    assert stored_header(uri, 0)["checksum"]["algo"] == "xxh3-128"
    assert {c["algo"] for c in stored_commit(uri)["checksums"].values()} == {"xxh3-128"}


def test_default_is_sha256_without_xxhash(tmp_path, no_xxhash):
    assert default_checksum() == "sha256"
    assert ObjectStoreAllReduce(str(tmp_path / "run"), 2, 0).checksum == "sha256"
    with pytest.raises(ImportError, match="pip install xxhash"):
        ObjectStoreAllReduce(
            str(tmp_path / "run"), 2, 0, config=AllReduceConfig(checksum="xxh3-128")
        )


def test_mixed_algorithms_agree_bit_identically(tmp_path):
    pytest.importorskip("xxhash")
    uri = str(tmp_path / "run")
    out = run_replicas(uri, {0: "sha256", 1: "xxh3-128", 2: "sha256"})
    assert_agree_on_mean(out, [0, 1, 2])
    assert all(sr.included_ranks == [0, 1, 2] and not sr.rejected for _, sr in out.values())
    algos = {r: stored_header(uri, r)["checksum"]["algo"] for r in range(3)}
    assert algos == {0: "sha256", 1: "xxh3-128", 2: "sha256"}
    pinned = stored_commit(uri)["checksums"]
    assert all(pinned[str(r)] == stored_header(uri, r)["checksum"] for r in range(3))
    # a late reader (rank 1 again, writing sha256 this time) verifies each header's own algo
    late = ObjectStoreAllReduce(uri, 3, 1, config=AllReduceConfig(timeout_s=5, checksum="sha256"))
    res = late.allreduce(make_tensors(1, 0), step=0)
    assert all(torch.equal(res[n], out[0][0][n]) for n in SHAPES)


def test_reader_without_xxhash_rejects_xxh3_contribution(tmp_path, monkeypatch):
    pytest.importorskip("xxhash")
    uri = str(tmp_path / "run")
    assert ObjectStore(uri).put_if_absent(contrib_key(0, 2), blob(2, "xxh3-128"))
    monkeypatch.setitem(sys.modules, "xxhash", None)
    out = run_replicas(uri, {0: "sha256", 1: "sha256"}, min_replicas=2)
    assert_agree_on_mean(out, [0, 1])
    for _, sr in out.values():
        assert sr.included_ranks == [0, 1] and sr.excluded_ranks == [2]
        assert "cannot verify its checksum" in sr.rejected[2]
        assert "pip install xxhash" in sr.rejected[2]
    assert "pip install xxhash" in stored_commit(uri)["excluded"]["2"]


def test_reader_without_xxhash_fails_cleanly_when_min_replicas_unmet(tmp_path, monkeypatch):
    pytest.importorskip("xxhash")
    uri = str(tmp_path / "run")
    ObjectStore(uri).put_if_absent(contrib_key(0, 2), blob(2, "xxh3-128"))
    monkeypatch.setitem(sys.modules, "xxhash", None)
    out = run_replicas(uri, {0: "sha256", 1: "sha256"})  # min_replicas = world_size = 3
    for r in (0, 1):
        err = out[r][0]
        assert isinstance(err, CorruptContributionError), err
        assert "nothing committed" in str(err) and "pip install xxhash" in str(err)
    assert ObjectStore(uri).get(commit_key(0)) is None


@pytest.mark.parametrize("algo", ALGOS)
def test_tampered_data_before_commit_is_rejected(tmp_path, algo):
    if algo == "xxh3-128":
        pytest.importorskip("xxhash")
    uri = str(tmp_path / "run")
    good = blob(2, algo)
    bad = flip_last_data_byte(good)
    assert header_of(bad) == header_of(good)  # only the data section changed
    ObjectStore(uri).put_if_absent(contrib_key(0, 2), bad)
    out = run_replicas(uri, {0: algo, 1: algo}, min_replicas=2)
    assert_agree_on_mean(out, [0, 1])
    for _, sr in out.values():
        assert sr.excluded_ranks == [2]
        assert f"{algo} checksum mismatch" in sr.rejected[2], sr.rejected[2]


@pytest.mark.parametrize("algo", ALGOS)
def test_tampered_data_after_commit_fails_instead_of_diverging(tmp_path, algo):
    if algo == "xxh3-128":
        pytest.importorskip("xxhash")
    uri = str(tmp_path / "run")
    run_replicas(uri, {0: algo, 1: algo, 2: algo})
    path = tmp_path / "run" / contrib_key(0, 1)
    tampered = flip_last_data_byte(path.read_bytes())
    os.unlink(path)  # bypassing put-if-absent, as someone with bucket write access could
    path.write_bytes(tampered)
    late = ObjectStoreAllReduce(uri, 3, 2, config=AllReduceConfig(timeout_s=5, checksum=algo))
    with pytest.raises(CorruptContributionError, match=f"rank 1.*{algo} checksum mismatch"):
        late.allreduce(make_tensors(2, 0), step=0)


def test_unknown_algorithm_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown checksum 'md5'; choose one of"):
        ObjectStoreAllReduce(str(tmp_path / "ctor"), 2, 0, config=AllReduceConfig(checksum="md5"))
    uri = str(tmp_path / "run")
    forged = reheadered_blob(lambda h: h["checksum"].update(algo="md5"))
    with pytest.raises(CorruptContributionError, match="unknown checksum algorithm .md5."):
        decode_contribution(forged, step=0, rank=2)
    ObjectStore(uri).put_if_absent(contrib_key(0, 2), forged)
    out = run_replicas(uri, {0: "sha256", 1: "sha256"}, min_replicas=2)
    assert_agree_on_mean(out, [0, 1])
    for _, sr in out.values():
        assert sr.excluded_ranks == [2]
        assert "unknown checksum algorithm 'md5'" in sr.rejected[2], sr.rejected[2]


def test_old_format_header_is_refused(tmp_path):
    def to_old_format(h: dict) -> None:
        h["sha256"] = h.pop("checksum")["value"]

    old = reheadered_blob(to_old_format)
    with pytest.raises(CorruptContributionError, match="header has no checksum.*older version"):
        decode_contribution(old, step=0, rank=2)
    uri = str(tmp_path / "run")
    ObjectStore(uri).put_if_absent(contrib_key(0, 2), old)
    out = run_replicas(uri, {0: "sha256", 1: "sha256"}, min_replicas=2)
    assert_agree_on_mean(out, [0, 1])
    assert all("older version" in sr.rejected[2] for _, sr in out.values())
