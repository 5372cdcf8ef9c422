"""ObjectStore, the package's only fsspec client: what the run's driver and replicas use of it
(JSON documents, folders as copies, walk, the writability probe, local_path) on file://,
memory:// and the two real S3 servers."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from composer_replication.exchange.faulty_store import Fault, FaultyStore
from composer_replication.exchange.store import ObjectStore, probe_writable


@pytest.fixture(
    params=[
        "file",
        "memory",
        pytest.param("seaweedfs_server", marks=[pytest.mark.server, pytest.mark.slow]),
        pytest.param("moto_server", marks=[pytest.mark.server, pytest.mark.slow]),
    ]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return ObjectStore(str(tmp_path / "store"))
    if request.param == "memory":
        return ObjectStore(f"memory://store-{uuid.uuid4().hex}")
    _, bucket, options = request.getfixturevalue(request.param)
    return ObjectStore(f"s3://{bucket}/store-{uuid.uuid4().hex}", options)


def test_json_documents_overwrite_exclusive_and_refuse_garbage(store: ObjectStore) -> None:
    assert store.get_json("a/doc.json") is None
    assert store.put_json("a/doc.json", {"x": [1, 2.5, None], "s": "é"})
    assert store.get_json("a/doc.json") == {"x": [1, 2.5, None], "s": "é"}
    store.put_json("a/doc.json", {"x": 2})  # overwrite (status documents)
    assert store.get_json("a/doc.json") == {"x": 2}
    assert not store.put_json("a/doc.json", {"x": 3}, exclusive=True)  # put-if-absent lost
    assert store.get_json("a/doc.json") == {"x": 2}
    assert store.put_json("a/new.json", [1], exclusive=True)
    store.put("a/bad.json", b"\x80{not json")
    with pytest.raises(ValueError, match="a/bad.json is not a JSON document"):
        store.get_json("a/bad.json")
    assert store.list("a") == store.list("a/") == ["bad.json", "doc.json", "new.json"]


def test_folders_round_trip_as_copies(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub" / "deeper").mkdir(parents=True)
    files = {"a.bin": os.urandom(3000), "sub/b.txt": b"bee", "sub/deeper/c": b""}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    store.put_dir(src, "ck/round-1")
    assert store.walk("ck/round-1") == sorted(files)
    assert store.walk("ck/missing") == []
    dst = tmp_path / "dst"
    store.get_dir("ck/round-1", dst)
    for rel, data in files.items():
        got = dst / rel
        assert got.read_bytes() == data
        assert got.stat().st_nlink == 1  # a copy, never a hard link into the store
    if store.local_path is not None:
        stored = store.local_path / "ck" / "round-1" / "a.bin"
        assert stored.stat().st_ino != (dst / "a.bin").stat().st_ino
    store.put("ck/round-1/a.bin", b"rewritten in the store")
    assert (dst / "a.bin").read_bytes() == files["a.bin"]  # the copy is unaffected
    store.delete_prefix("ck/round-1")
    assert store.walk("ck/round-1") == [] and (dst / "sub" / "b.txt").read_bytes() == b"bee"


def test_run_prefix_exists_and_delete_everything(store: ObjectStore) -> None:
    store.put_json("run_config.json", {"a": 1})
    store.put("replicas/0/metrics/00000000.jsonl", b"{}\n")
    assert store.exists("") and store.exists("run_config.json") and store.exists("replicas")
    store.delete_prefix("")
    # no object is left (SeaweedFS may keep emptied folders as entries: look for objects)
    assert store.get_json("run_config.json") is None and store.walk("") == []


def test_probe_writable_passes_and_leaves_nothing(store: ObjectStore) -> None:
    store.probe_writable()
    assert not [n for n in store.list("") if n.startswith("_probe-")]


def test_probe_writable_reports_a_store_that_reads_back_differently(tmp_path: Path) -> None:
    rot = Fault("get", "_probe-*", "corrupt")
    store = FaultyStore(ObjectStore(str(tmp_path / "s")), [rot])
    with pytest.raises(OSError, match="read back differently"):
        probe_writable(store)
    assert rot.hits == 1
    assert not [n for n in os.listdir(tmp_path / "s") if n.startswith("_probe-")]


def test_uri_forms_and_local_path(tmp_path: Path) -> None:
    local = ObjectStore(str(tmp_path / "x" / "y"))
    assert local.uri == f"file://{tmp_path}/x/y/" and local.is_local
    assert local.local_path == tmp_path / "x" / "y"
    assert local.child_uri("/diloco/") == f"file://{tmp_path}/x/y/diloco/"
    remote = ObjectStore("s3://bucket/runs/a", {"endpoint_url": "http://127.0.0.1:1"})
    assert remote.uri == "s3://bucket/runs/a/" and remote.local_path is None
    assert not remote.is_local and remote.storage_options == {"endpoint_url": "http://127.0.0.1:1"}
    with pytest.raises(ValueError, match="names no bucket"):
        ObjectStore("s3://")
