"""The driver's end-of-run check (the mode's `end_of_run_problem`): a run reports success only when the store
holds its last round; a planted inconsistency (written through the store's interface) fails
the run with the reason in driver.json, `status` and metrics.jsonl."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.config import RunConfig, load_config
from composer_replication.diloco.mode_protocol import OuterLoopMode
from composer_replication.diloco.mode_registry import outer_loop_mode
from composer_replication.exchange.protocol import commit_key
from composer_replication.exchange.push_store import DecoupledStore, fragment_manifest, merge_key
from composer_replication.exchange.store import ObjectStore
from composer_replication.run.metrics import read_metrics


def end_of_run_problem(store: ObjectStore, mode: OuterLoopMode, config: RunConfig) -> str | None:
    return mode.end_of_run_problem(store, config.backend.n_replicas, config.train.max_steps)


def _commit(store: ObjectStore, step: int) -> None:
    store.put(commit_key(step), json.dumps({"step": step}).encode())


def test_sync_the_last_committed_round_must_be_the_runs_last(tmp_path: Path) -> None:
    config = load_config(None, ["train.max_steps=12", "diloco.sync_every_h=4"])  # 3 rounds
    mode = outer_loop_mode(config.diloco)
    store = ObjectStore(str(tmp_path / "store"))
    assert "last committed round is 0" in str(end_of_run_problem(store, mode, config))
    for r in (1, 2):
        _commit(store, r)
    assert "last committed round is 2, the run has 3" in str(
        end_of_run_problem(store, mode, config)
    )
    store.put(commit_key(3), b"not json")
    assert "round (3) is not readable" in str(end_of_run_problem(store, mode, config))
    _commit(store, 3)
    assert end_of_run_problem(store, mode, config) is None
    _commit(store, 4)  # a commit record beyond the run's end
    assert "last committed round is 4, the run has 3" in str(
        end_of_run_problem(store, mode, config)
    )


def test_decoupled_every_final_merge_must_be_on_record(tmp_path: Path) -> None:
    config = load_config(
        None,
        [
            "diloco.mode=decoupled",
            "diloco.fragments=2",
            "train.max_steps=16",
            "diloco.sync_every_h=4",
        ],
    )
    mode = outer_loop_mode(config.diloco)
    store = ObjectStore(str(tmp_path / "store"))
    docs = DecoupledStore(store)
    assert "no final.json" in str(end_of_run_problem(store, mode, config))
    frags = [{"w": torch.zeros(2)}, {"v": torch.zeros(3)}]
    docs.ensure_manifest(fragment_manifest(frags, n_learners=1, codec="fp32", mean_only=[[], []]))
    docs.write_final([0, 0], learners={0: 16})
    assert end_of_run_problem(store, mode, config) is None  # nothing merged: nothing to miss
    store.put(merge_key(1, 1), b"{}")
    problem = str(end_of_run_problem(store, mode, config))
    assert "fragment 1 has a merge record 1 after its final version 0" in problem, problem
    docs.write_final([1, 1], learners={0: 16})  # fragment 0's merge 1 is not on record
    problem = str(end_of_run_problem(store, mode, config))
    assert "fragment 0's final version 1 (final.json) has no merge record" in problem, problem


class Planter(threading.Thread):
    """Once round 1 has committed: a commit record for a round after the run's last, a copy
    of round 1's (what a leftover or forged record looks like), through the store."""

    def __init__(self, store: Path, round_: int) -> None:
        super().__init__(daemon=True)
        self.store, self.round, self.planted = store, round_, False
        self.stop = threading.Event()

    def run(self) -> None:
        while not (self.store / commit_key(1)).is_file():
            if self.stop.wait(0.02):
                return
        bucket = ObjectStore(self.store.as_uri())
        record = json.loads(bytes(bucket.get(commit_key(1)) or b"{}"))
        record["step"] = self.round
        self.planted = bucket.put_if_absent(commit_key(self.round), json.dumps(record).encode())


@pytest.mark.slow
@pytest.mark.heavy
def test_a_run_whose_store_does_not_end_on_its_last_round_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "planted"
    args = [*TINY_RUN, "logging.tensorboard=false", "train.max_steps=12", "diloco.sync_every_h=4"]
    planter = Planter(run / "store", 3 + 1)  # the run has 3 rounds
    planter.start()
    try:
        code = main(["train", *args, "--name", "planted"])
    finally:
        planter.stop.set()
        planter.join(10)
    out = capsys.readouterr().out
    assert planter.planted
    assert code != 0, out
    reason = "end-of-run check: the store's last committed round is 4, the run has 3"
    assert reason in out, out
    driver = json.loads((run / "driver.json").read_text())
    assert driver["status"] == "failed" and reason in driver["error"], driver
    records = read_metrics(run / "metrics.jsonl")
    assert [r["reason"] for r in records if r.get("event") == "incomplete"] == [driver["error"]]
    health = [r for r in records if r["kind"] == "health"]
    assert health[-1]["health/state"] == "critical" and reason in health[-1]["health/reasons"]
    assert main(["status", str(run)]) == 0
    status = capsys.readouterr().out
    assert "health: critical (end-of-run check" in status, status
