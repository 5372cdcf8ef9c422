"""A store that refuses writes for a while costs no restart and no round: `train` on a real S3
server (SeaweedFS) behind the chaos proxy, which answers every write with 403 AccessDenied for
``duration_s`` (the `read_only` chaos action, a bucket whose write permission was taken away and
given back). Training-state writes (contributions, owner records, resume states, checkpoints)
ride it out with backoff; metrics and status writes are retried, then skipped and written
later. Every round commits, both replicas end on the same weights, exit 0."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.server]

STEPS, H = 60, 4


@pytest.mark.parametrize("seconds", [20.0, 45.0])
def test_a_read_only_store_costs_no_restart_and_no_round(
    seconds: float,
    seaweedfs_server: tuple[str, str, dict],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    _, bucket, options = seaweedfs_server
    monkeypatch.chdir(tmp_path)
    inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    code = main(
        [
            "train",
            *TINY_RUN,
            f"train.max_steps={STEPS}",
            f"diloco.sync_every_h={H}",
            "logging.tensorboard=false",
            f"store.uri=s3://{bucket}/{uuid.uuid4().hex}/",
            f"store.storage_options={{{inner}}}",
            f"chaos.events=[{{action='read_only', at_s=2.0, duration_s={seconds}}}]",
            "--name",
            "ro",
        ]
    )
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "ro"
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((run / "logs").glob("*.log")))
    assert code == 0, out + logs
    events = json.loads((run / "chaos.json").read_text())["events"]
    assert [e["outcome"] for e in events] == ["read-only", "writable"], events
    assert events[1]["refused"] > 0, events  # the run did write while the store refused it
    driver = json.loads((run / "driver.json").read_text())
    assert [r["restarts"] for r in driver["replicas"]] == [0, 0], out + logs
    records = read_metrics(run / "metrics.jsonl")
    committed = {r["round"] for r in records if r["kind"] == "round" and r["round/committed"]}
    assert committed == set(range(1, STEPS // H + 1)), sorted(committed)
    digests = {r["replica"]: r["sha256"] for r in records if r.get("event") == "global_weights"}
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1, digests
    assert "AccessDenied" in logs or "Access Denied" in logs  # the spell was seen, and named
