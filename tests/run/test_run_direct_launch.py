"""The replica module launched directly, without `composer-replication train` (what an executor
call, a cluster job or the seeds' recipe snippets do): the first replica publishes the run
config from its own arguments, every replica trains with the stored one, and they end on the
same global model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.exchange.store import ObjectStore
from composer_replication.executors import LocalProcessExecutor

pytestmark = pytest.mark.slow

OVERRIDES = [
    *TINY_RUN,
    "train.max_steps=4",
    "diloco.sync_every_h=2",
]


@pytest.mark.long
def test_two_replicas_launched_directly_train_one_model(tmp_path: Path) -> None:
    uri = (tmp_path / "store").as_uri()
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs")
    args = ["--rendezvous", uri, *OVERRIDES]
    handles = ex.launch_replicas(
        2, "composer_replication.run.replica", args, env={"WORLD_SIZE": "2"}
    )
    done = ex.collect(handles, timeout=600)
    logs = "\n".join(ex.logs(h, tail=30) for h in done)
    assert [h.exit_code for h in done] == [0, 0], logs
    assert logs.count("published the run config") == 1  # one winner of the put-if-absent
    store = ObjectStore(uri)
    config = store.get_json("run_config.json")
    assert config["backend"]["n_replicas"] == 2 and config["train"]["max_steps"] == 4
    assert config["model"]["hidden_size"] == 32
    from composer_replication.run.metrics import chunk_dir

    records = [
        json.loads(line)
        for rank in (0, 1)
        for name in sorted(store.list(chunk_dir(rank)))
        for line in bytes(store.get(f"{chunk_dir(rank)}/{name}")).decode().splitlines()
        if line.strip()
    ]
    digests = {
        r["replica"]: r["sha256"]
        for r in records
        if r["kind"] == "event" and r.get("event") == "global_weights"
    }
    assert sorted(digests) == [0, 1] and len(set(digests.values())) == 1


def test_a_bad_override_is_exit_2_naming_the_key(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer_replication.run.replica",
            "--rank",
            "0",
            "--rendezvous",
            (tmp_path / "s").as_uri(),
            "train.max_step=3",
        ],
        capture_output=True,
        text=True,
        timeout=600,  # a safety net for a hung child, not a time limit (importing torch on a loaded 2-core machine took over 120 s)
    )
    assert proc.returncode == 2
    assert "train.max_step: unknown key" in proc.stderr and "Traceback" not in proc.stderr
