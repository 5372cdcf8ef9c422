"""Issue 22, item 4 through the CLI: "A planted commit record plus an honest contribution x1000
was applied" in an unsigned run. Now a real `composer-replication train` (sync mode, unsigned,
2 replicas) whose bucket a forger writes to: once round 4 has committed (the event), it holds
rank 1 back (SIGSTOP, a real stall), waits for rank 0's round-5 contribution and commits it
alone, scaled x1000, with a well-formed commit record (checksum and all) before any honest
committer can. The record's scale (1000 for a mean, which allows only 1) is off the run's
merge rule, which every replica recomputes: no replica applies it, the run exits non-zero (3), `status` says critical naming round 5 and
metrics.jsonl has the event. The exchange-level test is
tests/exchange/test_manager_update_screen.py."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.exchange.protocol import (
    commit_key,
    decode_contribution,
    make_commit,
    parse_contrib_name,
    step_prefix,
)
from composer_replication.exchange.store import ObjectStore
from composer_replication.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

TARGET = 5  # rounds 1-4 are honest: the recent norms the screen judges the update against
ARGS = [
    *TINY_RUN,
    "logging.tensorboard=false",
    "train.max_steps=32",
    "diloco.sync_every_h=4",  # 8 rounds
    "backend.max_restarts=0",
]


def _replica_pid(rank: int) -> int | None:
    """This process's child that runs replica `rank` (its REPLICA_RANK)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if int(fields[1]) == me and f"REPLICA_RANK={rank}\0".encode() in environ:
            return int(entry)
    return None


class Forger(threading.Thread):
    def __init__(self, store: Path) -> None:
        super().__init__(daemon=True)
        self.store = store
        self.forged = False
        self.error = ""
        self.stop = threading.Event()

    def run(self) -> None:
        stopped = None
        try:
            while not (self.store / commit_key(TARGET - 1)).is_file():  # the event
                if self.stop.wait(0.01):
                    return
            stopped = _replica_pid(1)
            assert stopped is not None, "no replica 1 process"
            os.kill(stopped, signal.SIGSTOP)
            bucket = ObjectStore(self.store.as_uri())
            prefix = step_prefix(TARGET) + "contrib/"
            names: list[str] = []
            while not names:  # rank 0's honest upload of round TARGET
                if self.stop.wait(0.01):
                    return
                names = [n for n in bucket.list(prefix) if parse_contrib_name(n) == 0]
            raw = bucket.get(prefix + names[0])
            assert raw is not None
            c = decode_contribution(raw, step=TARGET, rank=0)
            record = make_commit(
                step=TARGET,
                world_size=2,
                included=[c],
                weighting="equal",
                committed_by=0,
                excluded={},
            )
            record["scales"] = {"0": 1000.0}  # the honest update x1000
            self.forged = bucket.put_if_absent(commit_key(TARGET), json.dumps(record).encode())
        except Exception as exc:  # reported by the test
            self.error = repr(exc)
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)


def test_a_forged_x1000_commit_is_not_applied_and_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "forged"
    forger = Forger(run / "store")
    forger.start()
    try:
        code = main(["train", *ARGS, "--name", "forged"])
    finally:
        forger.stop.set()
        forger.join(10)
    out = capsys.readouterr().out
    assert forger.forged, forger.error or "the forged commit record lost the race"
    assert code == 3, out  # not "finished" with exit 0
    assert f"round {TARGET} is not applied" in out, out
    driver = json.loads((run / "driver.json").read_text())
    assert driver["status"] == "failed", driver
    records = read_metrics(run / "metrics.jsonl")
    refused = [r for r in records if r.get("event") == "refused"]
    assert refused and {r["round"] for r in refused} == {TARGET}, refused
    # the record scales the update x1000: off the run's merge rule, refused before any norm
    reasons = [r["reason"] for r in refused]
    assert all("rank 0's scale is 1000.0" in why for why in reasons), reasons
    health = [r for r in records if r["kind"] == "health"]
    assert health[-1]["health/state"] == "critical", health[-1]
    assert f"round {TARGET} is not applied" in health[-1]["health/reasons"]
    committed = [r["round"] for r in records if r["kind"] == "round" and r["round/committed"]]
    assert max(committed) == TARGET - 1  # nothing after the forged round
    assert main(["status", str(run)]) == 0
    status = capsys.readouterr().out
    assert f"health: critical (round {TARGET} is not applied" in status, status
