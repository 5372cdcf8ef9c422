"""Issue 22, item 1: one planted object must neither stop training nor pass for success.

A round that truly cannot commit (an insider who knows the run's slot secret takes rank 1's
real key, and ``diloco.min_replicas = 2`` leaves no room for a refusal) stops the run with exit
3: ``status`` says ``critical`` naming the round and the refusal, which is also a ``rejected``
event in metrics.jsonl and a line of the run summary.

The attacker has write access to the bucket and plants one finite, normal-looking object (a
copy of rank 0's round-1 contribution) where rank 1's round-3 contribution would go, at every
key it can derive from what the store shows (the name rank 1 used for round 1, and the
plain ``contrib/<rank>`` name), before rank 1 writes. The plant is scheduled by an event (round
1's commit record appears), not by a sleep. Each rank's upload goes to a key only its writer
uses, so the planted object is never read and every round commits with both replicas.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.protocol import contrib_key
from composer_replication.exchange.store import ObjectStore
from composer_replication.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

SMALL = [
    *TINY_RUN,
    "logging.tensorboard=false",
    "train.max_steps=24",
    "diloco.sync_every_h=4",  # 6 rounds
    "backend.max_restarts=0",
]


def _round_dir(store: Path, step: int) -> Path:
    return store / "steps" / f"{step:010d}"


class Planter(threading.Thread):
    """Wait for round ``after``'s commit record, then plant a copy of rank 0's contribution of
    that round in rank ``victim``'s slot of round ``target``, at every key it can derive."""

    def __init__(
        self, store: Path, *, after: int, target: int, victim: int = 1, insider: bool = False
    ) -> None:
        super().__init__(daemon=True)
        self.store, self.after, self.target, self.victim = store, after, target, victim
        self.insider = insider  # knows the run's slot secret: takes the victim's real key
        self.planted: dict[str, bool] = {}
        self.done = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        commit = _round_dir(self.store, self.after) / "commit.json"
        while not commit.is_file():  # the event: round `after` committed
            if self.stop.wait(0.02):
                return
        contrib = _round_dir(self.store, self.after) / "contrib"
        names = sorted(p.name for p in contrib.iterdir() if p.is_file())
        donor = next(n for n in names if n.startswith("00000"))
        victim = f"{self.victim:05d}"
        keys = {n for n in names if n.startswith(victim)} | {f"{victim}.safetensors"}
        planted = sorted(f"steps/{self.target:010d}/contrib/{name}" for name in keys)
        if self.insider:
            slot = self._slot()
            key = contrib_key(self.target, self.victim, slot) if slot else None
            planted = [key or contrib_key(self.target, self.victim)]
        body = (contrib / donor).read_bytes()
        bucket = ObjectStore(self.store.as_uri())
        for key in planted:
            self.planted[key] = bucket.put_if_absent(key, body)
        self.done.set()

    def _slot(self) -> str:
        """The victim's per-writer key part (plain keys when the run has no slot secret)."""
        doc = json.loads((self.store.parent / "writer-secrets.json").read_text())
        secret = doc["secrets"].get("slot")
        if secret is None:
            return ""
        reader = ObjectStoreAllReduce(self.store.as_uri(), 2, slot_secret=bytes.fromhex(secret))
        return reader.slot(self.target, self.victim)


def _train(tmp_path: Path, name: str, extra: list[str], **planter: Any) -> tuple:
    run = tmp_path / "runs" / name
    planter_thread = Planter(run / "store", **planter)
    planter_thread.start()
    try:
        code = main(["train", *SMALL, *extra, "--name", name])
    finally:
        planter_thread.stop.set()
        planter_thread.join(10)
    return code, run, planter_thread


def test_a_planted_object_in_a_ranks_slot_is_ignored_and_every_round_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    code, run, planter = _train(tmp_path, "planted", [], after=1, target=3)
    out = capsys.readouterr().out
    assert planter.done.is_set(), "round 1 never committed"
    assert planter.planted and all(planter.planted.values()), planter.planted  # before rank 1
    assert code == 0, out
    records = read_metrics(run / "metrics.jsonl")
    for replica in (0, 1):
        rounds = {
            r["round"]: r for r in records if r["kind"] == "round" and r["replica"] == replica
        }
        assert sorted(rounds) == [1, 2, 3, 4, 5, 6], rounds
        assert all(r["round/committed"] for r in rounds.values()), rounds
        # the honest contribution counts: both replicas in every round, rank 1's included
        assert [r["round/included"] for r in rounds.values()] == [2] * 6, rounds
    assert not [r for r in records if r.get("event") == "rejected"]
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()
    assert time.monotonic() - t0 < 590  # nobody waited diloco.timeout_s (600 s by default)


def test_a_round_that_cannot_commit_stops_the_run_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    strict = ["diloco.min_replicas=2", "diloco.timeout_s=120"]
    code, run, planter = _train(tmp_path, "stuck", strict, after=1, target=3, insider=True)
    out = capsys.readouterr().out
    assert planter.planted and all(planter.planted.values()), planter.planted
    assert code == 3, out  # not "finished" with exit 0
    assert "round 3 cannot commit" in out, out
    assert "refused          round 3 rank 1:" in out, out  # the run summary lists it
    driver = json.loads((run / "driver.json").read_text())
    assert driver["status"] == "failed", driver
    assert driver["no_quorum"]["round"] == 3 and list(driver["no_quorum"]["rejected"]) == ["1"]
    records = read_metrics(run / "metrics.jsonl")
    refused = [r for r in records if r.get("event") == "rejected"]
    assert refused and {(r["round"], r["rank"]) for r in refused} == {(3, 1)}, refused
    health = [r for r in records if r["kind"] == "health"]
    assert health[-1]["health/state"] == "critical", health[-1]
    assert "round 3 cannot commit" in health[-1]["health/reasons"]
    rounds = [r for r in records if r["kind"] == "round" and r["replica"] == 0]
    assert max(r["round"] for r in rounds if r["round/committed"]) == 2  # nothing after it
    assert main(["status", str(run)]) == 0
    status = capsys.readouterr().out
    assert "health: critical (round 3 cannot commit" in status, status
    assert "rejected in round 3:" in status and "rank 1:" in status, status
