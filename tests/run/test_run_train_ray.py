"""`composer-replication train` on the Ray backend (a private local Ray cluster started by the
executor), in both DiLoCo modes: the replicas are Ray tasks that meet only in the store, exactly
as on a laptop's local processes; decoupled mode adds nothing but the driver's synchronizer, so
it runs wherever sync mode runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.run.metrics import read_metrics

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

SMALL = [
    *TINY_RUN,
    "logging.tensorboard=false",
    "backend.kind=ray",
    # a private local Ray with room for both replicas (each asks for one CPU)
    "backend.options={init_num_cpus = 2, grace_period = 1.0, poll_interval = 0.1}",
]


@pytest.mark.long
@pytest.mark.parametrize("mode", ["sync", "decoupled"])
def test_train_on_ray(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import ray

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a private local Ray needs no token in ~
    extra = (
        ["diloco.mode=decoupled", "diloco.fragments=2", "model.num_layers=2"]
        if mode == "decoupled"
        else []
    )
    code = main(
        ["train", *SMALL, *extra, "train.max_steps=8", "diloco.sync_every_h=4", "--name", mode]
    )
    out = capsys.readouterr().out
    run = tmp_path / "runs" / mode
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((run / "logs").glob("*.log")))
    assert code == 0, out + logs
    assert not ray.is_initialized()  # the executor started its Ray and stopped it
    driver = json.loads((run / "driver.json").read_text())
    assert [(r["backend"], r["status"]) for r in driver["replicas"]] == [("ray", "succeeded")] * 2
    records = read_metrics(run / "metrics.jsonl")
    digests = {
        r["replica"]: r["sha256"]
        for r in records
        if r["kind"] == "event" and r.get("event") == "global_weights"
    }
    # both replicas trained to the end and hold the same global model
    assert sorted(digests) == [0, 1] and len(set(digests.values())) == 1
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()
