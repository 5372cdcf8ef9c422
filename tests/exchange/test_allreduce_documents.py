"""Run manifest, state snapshots and JSON documents of ObjectStoreAllReduce (file:// and memory://)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from composer_replication.exchange.allreduce import (
    AllReduceConfig,
    CorruptContributionError,
    ModelMismatchError,
    ObjectStoreAllReduce,
    StoreTimeoutError,
    model_fingerprint,
)
from composer_replication.exchange.document_format import state_key
from composer_replication.exchange.store import ObjectStore, normalize_uri


def tiny_model(hidden: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Linear(hidden, 2))


def test_model_fingerprint_lists_names_shapes_dtypes():
    fp = model_fingerprint(tiny_model())
    assert fp["parameters"]["0.weight"] == [[4, 3], "float32"]
    assert fp["num_parameters"] == 4 * 3 + 4 + 2 * 4 + 2
    assert model_fingerprint(dict(tiny_model().named_parameters())) == fp
    with pytest.raises(ValueError):
        model_fingerprint([1, 2])


def test_manifest_first_writer_wins_and_mismatch_is_refused(tmp_path):
    uri = str(tmp_path)
    ObjectStoreAllReduce(uri, 2, 0).ensure_manifest(model_fingerprint(tiny_model()))
    ObjectStoreAllReduce(uri, 2, 1).ensure_manifest(model_fingerprint(tiny_model()))  # same: ok
    with pytest.raises(ModelMismatchError, match=r"0.weight: stored \[\[4, 3\], 'float32'\]"):
        ObjectStoreAllReduce(uri, 2, 1).ensure_manifest(model_fingerprint(tiny_model(hidden=5)))
    with pytest.raises(ModelMismatchError, match="world_size: stored 2, this replica 3"):
        ObjectStoreAllReduce(uri, 3, 1).ensure_manifest(model_fingerprint(tiny_model()))
    with pytest.raises(ModelMismatchError, match="codec: stored 'fp32', this replica 'int8'"):
        ObjectStoreAllReduce(uri, 2, 1, config=AllReduceConfig(codec="int8")).ensure_manifest(
            model_fingerprint(tiny_model())
        )


def test_manifest_race_between_threads_has_one_winner(tmp_path):
    errors = []

    def go(hidden):
        try:
            ObjectStoreAllReduce(str(tmp_path), 2, 0).ensure_manifest(
                model_fingerprint(tiny_model(hidden))
            )
        except ModelMismatchError as e:
            errors.append(e)

    threads = [threading.Thread(target=go, args=(h,)) for h in (4, 5, 6, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 3  # exactly one model got to define the run


SLOT = b"m" * 32


@pytest.mark.parametrize(
    "planted",
    [b'{"format": 1, "kind": "manifest", "world_size": 99, "codec": "fp32"}', b"{not json"],
    ids=["another-run", "garbage"],
)
def test_a_planted_manifest_does_not_stop_the_run(tmp_path, planted):
    """With the run's slot secret the manifest carries a MAC: one planted before the first
    replica starts (a bucket writer) is refused, recorded and replaced, so the replicas start;
    a real mismatch (a MACed manifest of another model) is still refused."""
    uri = str(tmp_path)
    ObjectStore(uri).put("manifest.json", planted)
    first = ObjectStoreAllReduce(uri, 2, 0, slot_secret=SLOT)
    first.ensure_manifest(model_fingerprint(tiny_model()))
    assert first.refusals and first.refusals[0][0] == "manifest.json"
    assert "MAC" in first.refusals[0][1] or "not JSON" in first.refusals[0][1]
    ObjectStoreAllReduce(uri, 2, 1, slot_secret=SLOT).ensure_manifest(
        model_fingerprint(tiny_model())
    )
    with pytest.raises(ModelMismatchError, match="0.weight"):
        ObjectStoreAllReduce(uri, 2, 1, slot_secret=SLOT).ensure_manifest(
            model_fingerprint(tiny_model(hidden=5))
        )


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_publish_and_fetch_state(tmp_path, scheme):
    uri = f"file://{tmp_path}" if scheme == "file" else f"memory://{uuid.uuid4().hex}"
    driver = ObjectStoreAllReduce(uri, world_size=2, config=AllReduceConfig(keep_rounds=2))
    assert driver.fetch_state() is None
    model = torch.nn.Embedding(5, 3)
    sd = {"emb": model.weight.data, "tied": model.weight.data, "step": torch.tensor(7)}
    sd_bf16 = {"w": torch.randn(2, 2).bfloat16()}
    assert driver.publish_state(sd, round=0, extra={"outer_lr": 0.7})
    assert not driver.publish_state({"emb": torch.zeros(5, 3)}, round=0)  # immutable
    replica = ObjectStoreAllReduce(uri, world_size=2, rank=1)
    rnd, got, extra = replica.fetch_state()
    assert rnd == 0 and extra == {"outer_lr": 0.7}
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    for r in (1, 2, 3):
        assert driver.publish_state(sd_bf16, round=r, name="global")
    rnd, got, _ = replica.fetch_state()
    assert rnd == 3 and got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], sd_bf16["w"])
    assert replica.fetch_state(round=0) is None  # garbage-collected (keep_rounds=2)
    assert replica.fetch_state(round=2)[0] == 2
    assert replica.fetch_state(name="ema") is None
    with pytest.raises(ValueError, match="state name"):
        replica.fetch_state(name="../x")


def test_corrupted_state_is_refused(tmp_path):
    ar = ObjectStoreAllReduce(str(tmp_path), 2)
    ar.publish_state({"w": torch.randn(4)}, round=0)
    path = tmp_path / state_key("global", 0)
    blob = path.read_bytes()
    path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(CorruptContributionError, match="checksum"):
        ar.fetch_state()


def test_json_documents(tmp_path):
    ar = ObjectStoreAllReduce(str(tmp_path), 2)
    assert ar.get_json("config.json") is None
    assert ar.put_json("config.json", {"lr": 1e-3, "names": ["a"]})
    assert not ar.put_json("config.json", {"lr": 2})  # exclusive by default
    assert ar.get_json("config.json") == {"lr": 1e-3, "names": ["a"]}
    assert ar.put_json("config.json", {"lr": 2}, exclusive=False)
    assert ar.get_json("config.json") == {"lr": 2}
    assert ar.put_json("control/latest.json", [1, 2])
    assert ar.wait_for_json("control/latest.json", 1.0) == [1, 2]
    with pytest.raises(StoreTimeoutError, match="did not appear"):
        ar.wait_for_json("never.json", 0.2)
    for bad in ("../x.json", "/abs.json", "steps/0/commit.json", "manifest.json", ""):
        with pytest.raises(ValueError):
            ar.put_json(bad, {})
    (tmp_path / "broken.json").write_bytes(b"{nope")
    with pytest.raises(CorruptContributionError, match="not JSON"):
        ar.get_json("broken.json")


def test_uri_normalisation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert normalize_uri("runs/a") == f"file://{tmp_path}/runs/a/"
    assert normalize_uri("s3://bucket/runs/x") == "s3://bucket/runs/x/"
    assert normalize_uri("memory://abc/") == "memory://abc/"
    with pytest.raises(ValueError):
        normalize_uri("s3://")
    assert ObjectStore("runs/b").uri.startswith("file:///")


def test_latest_committed_step(tmp_path):
    uri = str(tmp_path)
    ar = ObjectStoreAllReduce(uri, 2, 0, config=AllReduceConfig(timeout_s=5, poll_interval_s=0.01))
    assert ar.latest_committed_step() is None
    peer = ObjectStoreAllReduce(
        uri, 2, 1, config=AllReduceConfig(timeout_s=5, poll_interval_s=0.01)
    )
    for step in (0, 1):
        t = threading.Thread(
            target=peer.allreduce, args=({"x": torch.ones(3)},), kwargs={"step": step}
        )
        t.start()
        ar.allreduce({"x": torch.zeros(3)}, step=step)
        t.join()
    assert ar.latest_committed_step() == 1 and peer.latest_committed_step() == 1
    assert torch.equal(ar.allreduce({"x": torch.zeros(3)}, step=1)["x"], torch.full((3,), 0.5))
