"""Signed Decoupled DiLoCo (``[security] sign = true`` with ``diloco.mode = "decoupled"``):
exchange/push_store.py with keys, through the store's interface.

Who may write what: a push only its learner's key, merge records / later states / heads /
final only the synchronizer's, version 0 and the manifest any learner's, a progress document its
learner's or the driver's. A forged object (unsigned, or signed by the wrong identity) and a
correctly signed object copied to another key (a push re-uploaded under a later name, an old
merge record replayed at the next version) are refused with the reason recorded under
``decoupled/refused/``; a forged merge record squatting the synchronizer's next key decides
nothing and is replaced.
"""

from __future__ import annotations

import json

import pytest
import torch

from composer_replication.config import load_config
from composer_replication.exchange.document_format import encode_state
from composer_replication.exchange.protocol import CorruptContributionError
from composer_replication.exchange.push_store import (
    FINAL_KEY,
    HEADS_KEY,
    DecoupledStore,
    PushId,
    fragment_manifest,
    global_key,
    merge_key,
    progress_key,
)
from composer_replication.exchange.signing import (
    DRIVER,
    KEYS_KEY,
    SYNCHRONIZER,
    RunKeys,
    SignatureError,
    generate_private_key,
    make_key_manifest,
    parse_key_manifest,
    public_key_of,
    rank_identity,
)
from composer_replication.exchange.store import ObjectStore

LEARNERS = 2


class Keys:
    """What the driver sets up: a key per learner, the synchronizer's and its own, and the
    signed key manifest in the store."""

    def __init__(self, store: ObjectStore) -> None:
        self.private = {rank_identity(r): generate_private_key() for r in range(LEARNERS)}
        self.private[SYNCHRONIZER] = generate_private_key()
        self.private[DRIVER] = generate_private_key()
        public = {k: public_key_of(v) for k, v in self.private.items()}
        record = make_key_manifest("run-1", public, self.private[DRIVER])
        store.put_if_absent(KEYS_KEY, json.dumps(record).encode())
        self.public = parse_key_manifest(store.get(KEYS_KEY), public[DRIVER])

    def of(self, identity: str) -> RunKeys:
        return self.public.with_identity(identity, self.private[identity])


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


REF = {"b": ([3], "float32"), "w": ([4, 3], "float32")}
WORK = {"steps": 4, "tokens": 40, "steps_since_push": 4, "step_seconds": 0.1, "learner_step": 4}


def _setup(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    keys = Keys(store)
    learner = {r: DecoupledStore(store, keys=keys.of(rank_identity(r))) for r in range(LEARNERS)}
    sync = DecoupledStore(store, keys=keys.of(SYNCHRONIZER))
    return store, keys, learner, sync


def _refusals(store: ObjectStore) -> dict[str, dict]:
    return DecoupledStore(store).read_rejections()


def _record(version: int, push: PushId, checksum: dict[str, str]) -> dict:
    return {
        "format": 1,
        "kind": "merge",
        "fragment": 0,
        "version": version,
        "base_version": version - 1,
        "inputs": [{"push": push.name, "weight": 4.0, "checksum": checksum}],
        "decisions": {push.name: {"included": True, "weight": 1.0}},
        "consumed": [push.name],
        "merge": "mean",
        "aggregate": "mean",
        "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    }


def test_a_forged_or_replayed_push_is_refused_with_the_reason(tmp_path):
    store, _, learner, sync = _setup(tmp_path)
    pid, _ = learner[0].push(_tensors(0), fragment=0, base=0, learner=0, seq=0, **WORK)
    got, _ = sync.fetch_push(pid, REF)
    assert not isinstance(got, str) and got is not None and got.checksum["algo"] == "sha256"
    assert torch.equal(got.decode()["w"], _tensors(0)["w"])

    # a bucket writer without a key: an unsigned push in learner 1's name
    forged, _ = DecoupledStore(store).push(
        _tensors(1), fragment=0, base=0, learner=1, seq=0, **WORK
    )
    reason, _ = sync.fetch_push(forged, REF)
    assert isinstance(reason, str) and "is not signed" in reason
    # learner 1's key cannot speak for learner 0
    other, _ = learner[1].push(_tensors(2), fragment=0, base=0, learner=0, seq=5, **WORK)
    reason, _ = sync.fetch_push(other, REF)
    assert isinstance(reason, str) and "signed by 'rank-1'" in reason
    # learner 0's genuine push re-uploaded under later names (a later seq, a later base)
    raw = bytes(store.get(pid.key))
    for later in (PushId(0, 0, 0, 7), PushId(0, 3, 0, 0)):
        store.put(later.key, raw)
        reason, _ = sync.fetch_push(later, REF)
        assert isinstance(reason, str), later
        assert "do not describe this push" in reason or "stale or misplaced" in reason
    # with signing off the same genuine push still reads (nothing else changes)
    plain, _ = DecoupledStore(store).fetch_push(pid, REF)
    assert plain is not None and not isinstance(plain, str)


def test_a_forged_or_replayed_merge_record_decides_nothing_and_is_replaced(tmp_path):
    store, _, learner, sync = _setup(tmp_path)
    pid, _ = learner[0].push(_tensors(0), fragment=0, base=0, learner=0, seq=0, **WORK)
    got, _ = sync.fetch_push(pid, REF)
    assert got is not None and not isinstance(got, str)
    assert sync.write_merge(_record(1, pid, got.checksum))
    assert sync.read_merge(0, 1)["signer"] == SYNCHRONIZER
    assert not sync.write_merge(_record(1, pid, got.checksum))  # genuinely decided: stays

    # a forger squats version 2's key with an unsigned record (first writer would win)
    store.put(merge_key(0, 2), json.dumps(_record(2, pid, got.checksum)).encode())
    with pytest.raises(SignatureError, match="is not signed"):
        sync.read_merge(0, 2)
    assert sync.write_merge(_record(2, pid, got.checksum))  # the lease holder replaces it
    assert sync.read_merge(0, 2)["signer"] == SYNCHRONIZER
    # a learner's key may not decide a merge
    store.put(
        merge_key(0, 3), json.dumps(learner[1].keys.sign(_record(3, pid, got.checksum))).encode()
    )
    with pytest.raises(SignatureError, match="signed by 'rank-1'"):
        sync.read_merge(0, 3)
    # version 1's genuine, signed record replayed at version 4
    store.put(merge_key(0, 4), bytes(store.get(merge_key(0, 1))))
    with pytest.raises(CorruptContributionError, match="replayed"):
        sync.read_merge(0, 4)
    refused = {r["object"]: r for r in _refusals(store).values()}
    assert {merge_key(0, v) for v in (2, 3, 4)} <= set(refused)
    assert "is not signed" in refused[merge_key(0, 2)]["reason"]
    assert "replayed" in refused[merge_key(0, 4)]["reason"]
    assert refused[merge_key(0, 2)]["by"] == SYNCHRONIZER


def test_learners_refuse_forged_globals_heads_final_and_progress(tmp_path):
    store, keys, learner, sync = _setup(tmp_path)
    # version 0 (the initial weights) is any learner's; later versions the synchronizer's
    assert learner[1].publish_global(0, 0, _tensors(0))
    assert torch.equal(learner[0].fetch_global(0, 0, REF)["w"], _tensors(0)["w"])
    unsigned = encode_state(_tensors(9), name="f000", round=1, extra={"kind": "global"})
    store.put(global_key(0, 1), unsigned)
    with pytest.raises(SignatureError, match="is not signed"):
        learner[0].fetch_global(0, 1, REF)
    by_learner = encode_state(
        _tensors(9), name="f000", round=2, extra={"kind": "global"}, keys=learner[1].keys
    )
    store.put(global_key(0, 2), by_learner)
    with pytest.raises(SignatureError, match="signed by 'rank-1'"):
        learner[0].fetch_global(0, 2, REF)
    # the synchronizer's own version 1, stored over the forged one, reads back
    sync.repair_global(0, 1, _tensors(3))
    assert torch.equal(learner[0].fetch_global(0, 1, REF)["w"], _tensors(3)["w"])

    sync.write_heads([1])
    assert learner[0].read_heads(1) == [1]
    store.put_json(HEADS_KEY, {"format": 1, "kind": "heads", "versions": [7]})
    assert learner[0].read_heads(1) is None  # a forged hint points nowhere
    sync.write_final([1], {0: 8, 1: 8})
    assert learner[0].read_final(1)["versions"] == [1]
    store.put_json(FINAL_KEY, {"kind": "final", "versions": [0], "learners": {"0": 99}})
    assert learner[0].read_final(1) is None  # a forged end is not taken

    learner[1].write_progress(1, step=8, done=False)
    assert sync.read_progress(1)["step"] == 8
    # a forged "done" for learner 1 (it would end the run early)
    store.put_json(progress_key(1), {"kind": "progress", "learner": 1, "step": 99, "done": True})
    assert sync.read_progress(1) is None
    learner[0].write_progress(1, step=99, done=True)  # another learner's key
    assert sync.read_progress(1) is None
    DecoupledStore(store, keys=keys.of(DRIVER)).write_progress(1, step=8, done=True)
    assert sync.read_progress(1)["done"] is True  # the driver releases a failed learner

    refused = {(r["object"], r["by"]): r["reason"] for r in _refusals(store).values()}
    assert "is not signed" in refused[(global_key(0, 1), "rank-0")]
    assert "signed by 'rank-1'" in refused[(global_key(0, 2), "rank-0")]
    for key in (HEADS_KEY, FINAL_KEY):
        assert "is not signed" in refused[(key, "rank-0")]
    assert "is not signed" in refused[(progress_key(1), SYNCHRONIZER)]


def test_the_manifest_is_signed_by_a_learner(tmp_path):
    store, _, learner, sync = _setup(tmp_path)
    manifest = fragment_manifest([_tensors(0)], n_learners=LEARNERS, codec="fp32")
    stored = learner[0].ensure_manifest(manifest)
    assert stored["signer"] == "rank-0"
    assert learner[1].ensure_manifest(manifest)["n_learners"] == LEARNERS
    store.put_json("decoupled/manifest.json", manifest)  # rewritten without a signature
    with pytest.raises(SignatureError, match="is not signed"):
        sync.read_manifest()


def test_signed_decoupled_runs_are_a_valid_configuration():
    config = load_config(
        overrides=[
            "diloco.mode=decoupled",
            "diloco.sync_every_h=8",
            "train.max_steps=16",
            "security.sign=true",
        ]
    )
    assert config.security.sign and config.diloco.mode == "decoupled"


def test_the_driver_writes_each_refusal_once_as_a_rejected_event(tmp_path):
    from composer_replication.run.metrics import MetricsSink, read_metrics
    from composer_replication.run.supervision import RefusalLog

    store, keys, learner, sync = _setup(tmp_path)
    forged, _ = DecoupledStore(store).push(
        _tensors(1), fragment=0, base=0, learner=1, seq=0, **WORK
    )
    reason, _ = sync.fetch_push(forged, REF)
    assert isinstance(reason, str)
    sync.write_refusal(forged, reason)  # what the synchronizer records for a refused push
    store.put_json(HEADS_KEY, {"format": 1, "kind": "heads", "versions": [3]})
    assert learner[0].read_heads(1) is None  # a learner refuses (and records) a forged head
    # the driver (releasing a failed learner) refuses a forged progress document
    store.put_json(progress_key(1), {"kind": "progress", "learner": 1, "step": 99, "done": True})
    assert DecoupledStore(store, keys=keys.of(DRIVER)).read_progress(1) is None
    # a planted "refusal" without a signature is no refusal
    store.put_json("decoupled/refused/planted.json", {"kind": "refused", "reason": "x"})

    path = tmp_path / "metrics.jsonl"
    driver = keys.public  # the driver verifies with the run's public keys
    sources = (DecoupledStore(store, keys=driver),)
    log = RefusalLog(sources, MetricsSink(path), path, every_s=0)
    log.poll()
    log.poll()
    events = [r for r in read_metrics(path) if r.get("event") == "rejected"]
    assert sorted((e["object"], e["rank"], e["by"]) for e in events) == sorted(
        [(HEADS_KEY, -1, "rank-0"), (forged.key, 1, SYNCHRONIZER), (progress_key(1), -1, DRIVER)]
    )
    assert all("is not signed" in e["reason"] for e in events)
    # a resumed launch's driver does not repeat them
    RefusalLog(sources, MetricsSink(path), path, every_s=0).poll(force=True)
    assert len([r for r in read_metrics(path) if r.get("event") == "rejected"]) == 3


def test_the_synchronizer_refuses_a_forged_push_based_on_a_future_version(tmp_path):
    from composer_replication.diloco.decoupled.synchronizer import Synchronizer, SynchronizerConfig

    store, keys, learner, _ = _setup(tmp_path)
    manifest = fragment_manifest([_tensors(0)], n_learners=LEARNERS, codec="fp32")
    learner[0].ensure_manifest(manifest)
    learner[0].publish_global(0, 0, _tensors(0))
    genuine, _ = learner[1].push(_tensors(1), fragment=0, base=3, learner=1, seq=0, **WORK)
    forged, _ = DecoupledStore(store).push(
        _tensors(2), fragment=0, base=3, learner=0, seq=0, **WORK
    )
    sync = Synchronizer(store, SynchronizerConfig(quorum=2), keys=keys.of(SYNCHRONIZER))
    assert sync.activate()
    try:
        sync.poll_once()
    finally:
        sync.lease.release()
    refused = DecoupledStore(store).read_refusals()
    # a forgery no merge would ever consume is refused at once; a genuine push based on a
    # version not published yet waits (its synchronizer may have lost that version)
    assert set(refused) == {forged.name} and "is not signed" in refused[forged.name]
    assert genuine in sync.inbox.future


def test_the_synchronizer_process_gets_only_its_key_and_refuses_to_run_without_it(
    tmp_path, monkeypatch, capsys
):
    from composer_replication.config import to_dict
    from composer_replication.exchange.signing import DRIVER_KEY_ENV, KEY_ENV
    from composer_replication.run.folder import RunFolder
    from composer_replication.run.security import prepare_signing
    from composer_replication.run.synchronizer_process import main, signing_keys

    config = load_config(
        overrides=[
            "diloco.mode=decoupled",
            "diloco.sync_every_h=8",
            "train.max_steps=16",
            "security.sign=true",
        ]
    )
    folder = RunFolder.at(tmp_path / "run")
    folder.root.mkdir()
    store = ObjectStore(str(tmp_path / "store"))
    doc = json.loads(json.dumps(to_dict(config)))
    store.put_json("run_config.json", doc)
    secrets = prepare_signing(config, folder, store, doc)
    assert secrets is not None
    for name in (DRIVER_KEY_ENV, KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    assert main([str(tmp_path / "store")]) == 2  # signing on, no key: a clear error
    assert f"${DRIVER_KEY_ENV} is not set" in capsys.readouterr().err
    monkeypatch.setenv(DRIVER_KEY_ENV, secrets.env[DRIVER_KEY_ENV])
    monkeypatch.setenv(KEY_ENV, secrets.private["rank-0"])  # a learner's key is not its own
    with pytest.raises(ValueError, match="does not match its public key"):
        signing_keys(config, store)
    monkeypatch.setenv(KEY_ENV, secrets.private[SYNCHRONIZER])
    _, keys = signing_keys(config, store)
    assert keys is not None and keys.identity == SYNCHRONIZER
    store.put_json("run_config.json", {**doc, "security": {"sign": False}})  # rewritten
    with pytest.raises(SignatureError, match="not the configuration the driver signed"):
        signing_keys(config, store)
