"""A planted head hint through the CLI: a real `composer-replication train` (sync mode, unsigned,
2 replicas, 8 rounds) whose bucket a forger writes once, after round 3 commits,
``steps/head.json`` saying ``{"kind": "head", "step": 999}``. It used to make every later round
fail with "the run is already at step 999" (rounds 4-8 never committed, exit 1). Now every
round commits, the run exits 0, and the refusal is a "rejected" event naming the object. The
exchange-level cases (malformed, pointing back, at a planted record) are
tests/exchange/test_head_hint.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.exchange.protocol import HEAD_KEY, commit_key
from composer_replication.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

ROUNDS = 8
ARGS = [
    *TINY_RUN,
    "logging.tensorboard=false",
    f"train.max_steps={4 * ROUNDS}",
    "diloco.sync_every_h=4",
    "backend.max_restarts=0",
]


class Planter(threading.Thread):
    def __init__(self, store: Path) -> None:
        super().__init__(daemon=True)
        self.store = store
        self.planted = False
        self.stop = threading.Event()

    def run(self) -> None:
        while not (self.store / commit_key(3)).is_file():  # the event: round 3 committed
            if self.stop.wait(0.01):
                return
        (self.store / HEAD_KEY).write_text(json.dumps({"kind": "head", "step": 999}))
        self.planted = True


def test_a_planted_head_hint_leaves_every_round_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "planted"
    planter = Planter(run / "store")
    planter.start()
    try:
        code = main(["train", *ARGS, "--name", "planted"])
    finally:
        planter.stop.set()
        planter.join(10)
    out = capsys.readouterr().out
    assert planter.planted
    assert code == 0, out
    records = read_metrics(run / "metrics.jsonl")
    committed = {r["round"] for r in records if r["kind"] == "round" and r["round/committed"]}
    assert committed == set(range(1, ROUNDS + 1)), sorted(committed)
    refused = [r for r in records if r.get("event") == "rejected" and r.get("rank") == -1]
    assert refused and {r["object"] for r in refused} == {HEAD_KEY}, refused
    assert all("head hint refused" in r["reason"] for r in refused), refused
