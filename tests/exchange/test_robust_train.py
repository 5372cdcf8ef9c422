"""`composer-replication train` with `[diloco] screen = "loss"`: the run's loss probe
(assembly/screening.py) scores every contribution on held-out prompts, and the commit records it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from composer_replication.exchange.store import ObjectStore


def test_status_lists_the_latest_rounds_rejections_with_rank_and_reason(tmp_path):
    import json

    from composer_replication.config.loader import to_dict
    from composer_replication.config.schema import RunConfig
    from composer_replication.run.folder import RunFolder
    from composer_replication.run.metrics import ReplicaMetricsWriter
    from composer_replication.run.status import run_status, status_text

    folder = RunFolder.at(tmp_path / "run")
    folder.root.mkdir()
    config = to_dict(RunConfig())
    config["store"]["uri"] = (tmp_path / "store").as_uri()
    folder.config_json.write_text(json.dumps(config))
    store = ObjectStore(config["store"]["uri"])
    for rank, rnd in ((0, 3), (1, 2)):
        w = ReplicaMetricsWriter(store, rank)
        why = f"screened out: non-finite values (seen by rank {rank})"
        w.status(
            state="training", round=rnd, rejections={"round": rnd, "ranks": {"1": why}}, force=True
        )
    info = run_status(folder)
    assert info["rejections"]["round"] == 3
    text = status_text(info)
    assert "rejected in round 3:" in text
    assert "rank 1: screened out: non-finite values (seen by rank 0)" in text


@pytest.mark.long
@pytest.mark.slow
def test_train_with_the_loss_screen_records_each_contributions_loss_change(
    tmp_path, monkeypatch, capsys
):
    sys.path.insert(0, str(Path(__file__).parents[1] / "run"))
    from test_run_train_e2e import SMALL

    from composer_replication.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "train",
            *SMALL,
            "train.max_steps=4",
            "diloco.sync_every_h=2",
            "diloco.screen=loss",
            "diloco.aggregate=trimmed_mean",
            "--name",
            "screened",
        ]
    )
    run = tmp_path / "runs" / "screened"
    out = capsys.readouterr().out
    assert code == 0, out + "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    store = ObjectStore(str(run / "store"))
    for step in (1, 2):
        commit = store.get_json(f"steps/{step:010d}/commit.json")
        assert commit["aggregate"] == "trimmed_mean" and commit["included_ranks"] == [0, 1]
        deltas = [d["loss_delta"] for d in commit["decisions"].values()]
        assert len(deltas) == 2 and all(isinstance(x, float) for x in deltas)
        # honest early-training contributions do not raise the held-out loss by 5%
        assert all(d["included"] for d in commit["decisions"].values())
