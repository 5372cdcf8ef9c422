"""The head hint (``steps/head.json``) cannot stop a run: one object planted by anyone who can
write the bucket used to make every later round fail with "the run is already at step 999".
A replica now believes a hint only when it is signed (signing on) or carries the MAC of the
run's slot secret, and when the commit record of the hinted step and its predecessor hold up;
otherwise it records the refusal (a "rejected" event of rank -1) and lists instead."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from composer_replication.exchange import AllReduceConfig, ObjectStoreAllReduce, ObjectStoreManager
from composer_replication.exchange.protocol import HEAD_KEY, commit_key, make_commit
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.vocabulary import Contribution

SECRET = b"s" * 32


def _manager(uri: str, rank: int, slot_secret: bytes | None = SECRET) -> ObjectStoreManager:
    exchange = ObjectStoreAllReduce(
        uri,
        2,
        rank,
        config=AllReduceConfig(timeout_s=20.0, poll_interval_s=0.01),
        slot_secret=slot_secret,
    )
    return ObjectStoreManager(exchange)


def _round(m: ObjectStoreManager, value: float, out: dict[int, bool]) -> None:
    t = torch.full((4,), value)
    m.start_quorum()
    m.allreduce(t).wait()
    out[m.rank] = m.should_commit()


def _both(managers: list[ObjectStoreManager], value: float) -> dict[int, bool]:
    out: dict[int, bool] = {}
    ts = [threading.Thread(target=_round, args=(m, value + m.rank, out)) for m in managers]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


def _forged_commit(step: int) -> bytes:
    """A well-formed commit record of ``step`` (nobody uploaded what it lists)."""
    fake = Contribution(
        rank=0,
        step=step,
        tokens=None,
        inner_steps=None,
        codec="fp32",
        names=["p000000"],
        shapes=[[4]],
        dtypes=["float32"],
        digest="0" * 64,
        parts={},
        nbytes=0,
        checksum_algo="sha256",
        extra={},
    )
    record = make_commit(
        step=step, world_size=2, included=[fake], weighting="equal", committed_by=0, excluded={}
    )
    return json.dumps(record).encode()


PLANTS = {
    "ahead": {HEAD_KEY: json.dumps({"kind": "head", "step": 999}).encode()},
    "malformed": {HEAD_KEY: b'{"kind": "head", "st'},
    "not a step": {HEAD_KEY: json.dumps({"kind": "head", "step": "999"}).encode()},
    "pointing back": {HEAD_KEY: json.dumps({"kind": "head", "step": 1}).encode()},
    "no such step": {HEAD_KEY: json.dumps({"kind": "head", "step": 0}).encode()},
    # a commit record planted far ahead, and a hint pointing at it: no chain behind it
    "ahead with a commit": {
        HEAD_KEY: json.dumps({"kind": "head", "step": 999}).encode(),
        commit_key(999): _forged_commit(999),
    },
}


@pytest.mark.parametrize("case", sorted(PLANTS))
@pytest.mark.parametrize("slot_secret", [SECRET, None], ids=["slot-secret", "plain-keys"])
def test_a_planted_head_hint_does_not_stop_the_run(
    tmp_path: Path, case: str, slot_secret: bytes | None
) -> None:
    uri = "file://" + str(tmp_path / "run")
    managers = [_manager(uri, r, slot_secret) for r in range(2)]
    store = ObjectStore(uri)
    for value in (1.0, 1.1, 0.9):
        assert _both(managers, value) == {0: True, 1: True}
    for key, body in PLANTS[case].items():
        store.put(key, body)  # the forger's objects, planted once
    for value in (1.05, 0.95, 1.0, 1.1):
        assert _both(managers, value) == {0: True, 1: True}, [
            m.history[-1]["error"] for m in managers
        ]
    assert [m.current_step() for m in managers] == [7, 7]
    refused = {k: v for m in managers for r in m.history for k, v in r["objects_refused"].items()}
    if case == "pointing back" and slot_secret is None:
        assert refused == {}  # a lagging hint is legitimate (a lower bound)
    else:
        assert set(refused) == {HEAD_KEY}, refused
        assert "head hint refused" in refused[HEAD_KEY]


def test_an_honest_hint_is_believed_without_a_listing(tmp_path: Path) -> None:
    uri = "file://" + str(tmp_path / "run")
    managers = [_manager(uri, r) for r in range(2)]
    for value in (1.0, 1.1, 0.9):
        assert _both(managers, value) == {0: True, 1: True}
    exchange = managers[0].exchange
    before = exchange.store.requests.snapshot()
    assert exchange.head_step() == 3
    assert exchange.store.requests.since(before).get("list", 0) == 0
    assert exchange.refusals == []
    body = json.loads(bytes(exchange.store.get(HEAD_KEY) or b""))
    assert body["step"] == 3 and isinstance(body["mac"], str)
    # the same step with another step's MAC (a replay of an older hint, edited) is refused
    store = ObjectStore(uri)
    store.put(HEAD_KEY, json.dumps({**body, "step": 2}).encode())
    assert exchange.head_step() == 3  # from the listing
    assert exchange.refusals and "MAC" in exchange.refusals[0][1]
