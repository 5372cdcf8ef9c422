"""Metrics through the store, the run folder's JSONL/TensorBoard, progress, report and status."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest

from composer_replication.exchange.store import ObjectStore
from composer_replication.run.folder import RunFolder
from composer_replication.run.metrics import (
    MetricsCollector,
    MetricsSink,
    ReplicaMetricsWriter,
    mark_resume,
    read_metrics,
)
from composer_replication.run.progress import Progress, ReplicaRow, choose_mode
from composer_replication.run.report import summarize, write_report
from composer_replication.run.status import run_status, status_text


def _fake_run(tmp_path: Path, n_steps: int = 20) -> tuple[RunFolder, ObjectStore]:
    """A run folder whose store holds two replicas' metric chunks (reward rising)."""
    folder = RunFolder.at(tmp_path / "runs" / "demo")
    folder.create()
    store = ObjectStore(str(folder.store))
    config = {
        "backend": {"n_replicas": 2, "kind": "local"},
        "store": {"uri": store.uri, "storage_options": {}},
        "model": {"name": "tiny"},
        "task": {"name": "arithmetic"},
        "loss": {"alpha_sdpo": 0.1, "beta_replay": 0.05, "dpo_variant": "simpo"},
    }
    folder.config_json.write_text(json.dumps(config))
    for rank in range(2):
        writer = ReplicaMetricsWriter(store, rank, flush_every_s=1e9)
        for step in range(1, n_steps + 1):
            writer.log(
                "train",
                step=step,
                round=step // 5,
                reward=step / n_steps + 0.01 * rank,
                **{"loss/grpo": 1.0 / step, "loss/replay": 0.4 + step / 100, "loss/total": 1.0},
            )
            if step % 5 == 0:
                writer.log(
                    "round",
                    step=step,
                    round=step // 5,
                    **{"round/seconds": 0.1, "round/bytes_up": 1000, "round/bytes_down": 2000},
                )
                if rank == 0:
                    writer.log("eval", step=step, round=step // 5, **{"eval/accuracy": step / 40})
            if step % 7 == 0:
                writer.flush()  # several chunks per replica
        writer.status(state="done", step=n_steps, max_steps=n_steps, round=n_steps // 5)
        writer.flush()
    return folder, store


def test_metrics_flow_from_store_chunks_to_jsonl_and_tensorboard(tmp_path: Path) -> None:
    folder, store = _fake_run(tmp_path)
    sink = MetricsSink(folder.metrics, folder.tensorboard)
    collector = MetricsCollector(store, 2, sink, consumed=None)
    first = collector.poll()
    assert len(first) == 2 * (20 + 4) + 4  # train + round per replica, eval from rank 0
    assert collector.poll() == []  # each chunk is read exactly once
    # a new chunk after a restart of rank 1 continues the numbering
    writer = ReplicaMetricsWriter(store, 1, flush_every_s=1e9)
    writer.log("event", step=20, round=4, event="resumed")
    writer.flush()
    again = collector.poll()
    assert [r["event"] for r in again] == ["resumed"]
    sink.close()
    records = read_metrics(folder.metrics)
    assert len(records) == len(first) + 1
    assert {r["replica"] for r in records} == {0, 1}
    assert sorted(p.name for p in folder.tensorboard.iterdir()) == ["replica-0", "replica-1"]
    assert any(folder.tensorboard.glob("replica-0/events.out.tfevents.*"))
    statuses = collector.statuses()
    assert statuses[0]["state"] == "done" and statuses[1]["step"] == 20


def test_a_driver_killed_before_saving_its_chunk_count_appends_no_record_twice(
    tmp_path: Path,
) -> None:
    """The driver appends a chunk's records, then saves how many chunks it read (driver.json);
    killed in between, its successor starts from the older count and reads those chunks again.
    The file keeps one copy of each record, also when the resume has flagged some of them."""
    folder, store = _fake_run(tmp_path)
    first = MetricsCollector(store, 2, MetricsSink(folder.metrics, None), consumed=None).poll()
    saved = {0: 1, 1: 0}  # the crashed driver had saved only rank 0's first chunk
    mark_resume(
        folder.metrics,
        MetricsSink(folder.metrics, None),
        resumed_round=2,
        redo_after_step=10,
        n_replicas=2,
    )
    writer = ReplicaMetricsWriter(store, 0, flush_every_s=1e9)  # the resumed launch's first chunk
    writer.log("train", step=11, round=2, reward=0.5)
    writer.flush()
    collector = MetricsCollector(store, 2, MetricsSink(folder.metrics, None), consumed=saved)
    again = collector.poll()
    assert [(r["replica"], r["step"]) for r in again] == [(0, 11)]  # the new record alone
    assert collector.consumed == {0: 4, 1: 3}
    lines = [json.loads(line) for line in folder.metrics.read_text().splitlines()]
    steps = [r for r in lines if r["kind"] != "event"]
    assert len(steps) == len(first) + 1
    kept = [(r["kind"], r["replica"], r["step"]) for r in steps if not r.get("superseded")]
    assert len(kept) == len(set(kept))


def test_a_torn_last_line_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"kind": "train", "replica": 0, "step": 1}) + "\n" + '{"kind": "tr')
    MetricsSink(path, None).write([{"kind": "train", "replica": 0, "step": 2}])
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_report_draws_plots_and_summary(tmp_path: Path) -> None:
    folder, store = _fake_run(tmp_path)
    MetricsCollector(store, 2, MetricsSink(folder.metrics, None), None).poll()
    summary, plots = write_report(folder)
    names = sorted(p.name for p in plots)
    assert names == [
        "eval_accuracy.png",
        "loss_grpo.png",
        "loss_replay.png",
        "loss_total.png",
        "outer_rounds.png",
        "reward.png",
    ]
    for plot in plots:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # first 10% of 20 steps = steps 1-2, last 10% = steps 19-20 (pooled over replicas)
    assert summary["reward_first10"] == pytest.approx((0.05 + 0.1 + 0.06 + 0.11) / 4)
    assert summary["reward_last10"] == pytest.approx((0.95 + 1.0 + 0.96 + 1.01) / 4)
    assert summary["eval_accuracy_first"] == 0.125 and summary["eval_accuracy_last"] == 0.5
    assert summary["rounds"] == 4 and summary["round_bytes_total"] == 8 * 3000
    text = folder.summary.read_text()
    assert "| mean reward, last 10% of steps | 0.980 |" in text
    assert "![reward](plots/reward.png)" in text


def test_summarize_handles_an_empty_run() -> None:
    assert summarize([]) == {"replicas": []}


def test_plain_progress_prints_lines_on_changes_only() -> None:
    out = io.StringIO()
    assert choose_mode("auto", out) == "plain"  # not a terminal
    progress = Progress("plain", title="t", n_rounds=3, stream=out, plain_every_s=1e9)
    rows = [ReplicaRow(rank=0, state="training", step=3, max_steps=30, round=0, reward=0.25)]
    progress.update(rows)
    progress.update(rows)  # nothing changed: no new line
    rows[0].round = 1
    progress.update(rows)
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "round 1/3" in lines[1] and "r0 training step 3/30 reward 0.25" in lines[1]


def test_a_start_up_prints_one_starting_line() -> None:
    """Replicas starting for 37 s: one line, not one every plain_every_s; once the steps move,
    a line every plain_every_s; a stall repeats its line only every quiet_every_s."""
    now = [0.0]
    out = io.StringIO()
    progress = Progress(
        "plain",
        title="t",
        n_rounds=3,
        stream=out,
        plain_every_s=15,
        quiet_every_s=120,
        clock=lambda: now[0],
    )
    rows = [ReplicaRow(rank=r, state="starting", max_steps=60) for r in (0, 1)]
    for now[0] in range(0, 38):
        progress.update(rows)
    assert [line.count("starting step 0/60") for line in out.getvalue().splitlines()] == [2]
    for row in rows:
        row.state = "training"
    for now[0] in range(38, 80):
        for row in rows:
            row.step = int(now[0]) - 37
        progress.update(rows)
    lines = out.getvalue().splitlines()
    assert [line[:9] for line in lines] == ["[   0.0s]", "[  38.0s]", "[  53.0s]", "[  68.0s]"]
    for now[0] in range(80, 300):  # stalled at step 42: its line once, then every 120 s
        progress.update(rows)
    stalled = out.getvalue().splitlines()[len(lines) :]
    assert [line[:9] for line in stalled] == ["[  83.0s]", "[ 203.0s]"]
    assert all("training step 42/60" in line for line in stalled)
    progress.close()


def test_progress_without_a_round_count_shows_the_version_alone() -> None:
    """Decoupled mode: the synchronizer's global versions have no fixed total (a run of 20
    H-step rounds printed "round 22/20")."""
    out = io.StringIO()
    progress = Progress("plain", title="t", n_rounds=None, stream=out, plain_every_s=1e9)
    progress.update([ReplicaRow(rank=0, state="training", step=3, max_steps=30, round=22)])
    progress.close()
    line = out.getvalue().splitlines()[0]
    assert "round 22 |" in line and "/" not in line.split("|")[0]


def test_live_progress_renders_a_table() -> None:
    out = io.StringIO()
    progress = Progress("live", title="run x", n_rounds=2, stream=out)
    progress.update([ReplicaRow(rank=1, state="syncing", step=5, max_steps=10, round=1)])
    progress.close()
    assert "syncing" in out.getvalue() and "5/10" in out.getvalue()


def test_status_reports_replicas_round_lag_and_health(tmp_path: Path) -> None:
    folder, store = _fake_run(tmp_path)
    folder.update_driver(
        status="running",
        replicas=[
            {"replica_id": 0, "status": "running", "exit_code": None},
            {"replica_id": 1, "status": "failed", "exit_code": 1, "error": "exit code 1; boom"},
        ],
    )
    store.put_json(
        "replicas/0/status.json",
        {"state": "training", "step": 9, "max_steps": 20, "round": 1, "updated": time.time()},
    )
    info = run_status(folder)
    r0, r1 = info["replicas"]
    assert info["round"] == 4 and info["status"] == "running"
    assert r0["round_lag"] == 3 and r0["health"] == "behind"
    assert r1["health"] == "failed" and "boom" in r1["error"]
    text = status_text(info)
    assert "behind" in text and "boom" in text


def test_a_run_whose_replicas_have_not_reported_yet_is_starting(tmp_path: Path) -> None:
    """Just launched, no heartbeat yet: status says "starting" (not "critical"), and so does
    the report's health row; the same silence 10 minutes after the launch is critical."""
    from composer_replication.run.report import health_summary

    folder, _ = _fake_run(tmp_path)
    folder.update_driver(status="running", started=time.time())
    info = run_status(folder)
    assert info["health"]["state"] == "starting" and info["health"]["level"] == -1
    assert (
        "health: starting (0 of 2 replicas up; waiting for the first heartbeat of replica "
        "0, 1)" in status_text(info)
    )
    folder.update_driver(started=time.time() - 600)
    assert run_status(folder)["health"]["state"] == "critical"
    records = [
        {"kind": "health", "time": t, "health/level": level, "health/state": state}
        for t, level, state in ((0.0, -1, "starting"), (20.0, 0, "healthy"), (500.0, 0, "healthy"))
    ]
    assert health_summary(records)["health_seconds"] == {
        "starting": 20.0,
        "healthy": 480.0,
        "degraded": 0.0,
        "critical": 0.0,
    }


def test_report_prints_the_headline_numbers_and_labels_the_global_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`report RUN` prints what `train` printed at the end (reward, held-out accuracy with its
    interval, losses, and why channel 3 rising is expected); the accuracy plot's line is the
    global model's."""
    from composer_replication.cli import main
    from composer_replication.run import report

    folder, store = _fake_run(tmp_path)
    MetricsCollector(store, 2, MetricsSink(folder.metrics, None), None).poll()
    figures: list = []
    original = report._figure

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        fig, axes = original(*args, **kwargs)
        figures.append(axes)
        return fig, axes

    monkeypatch.setattr(report, "_figure", recording)
    assert main(["report", str(folder.root)]) == 0
    out = capsys.readouterr().out
    assert "  mean reward      first 10%: 0.080   last 10%: 0.980" in out
    assert "  eval accuracy    first: 0.125   last: 0.500" in out
    assert "  loss ch3 replay  first 10%:" in out and report.LOSS_RISE_LINE in out
    assert report.LOSS_RISE_NOTE in folder.summary.read_text()
    (eval_axes,) = [a for a in figures if a[0].get_title() == "eval accuracy of the global model"]
    legend = [t.get_text() for t in eval_axes[0].get_legend().get_texts()]
    assert legend == ["global model (evaluated by replica 0)"]


def test_progress_shows_a_bar_steps_per_second_and_the_time_left() -> None:
    """Two replicas of 100 steps each, one step per replica every 2 s after a 30 s start-up:
    0.50 steps/s each, and the time left at that rate; the start-up does not count."""
    now = [0.0]
    out = io.StringIO()
    progress = Progress(
        "plain", title="t", n_rounds=4, stream=out, plain_every_s=15, clock=lambda: now[0]
    )
    rows = [ReplicaRow(rank=r, state="starting", max_steps=100) for r in (0, 1)]
    for now[0] in range(0, 30):
        progress.update(rows)
    assert out.getvalue().splitlines()[0].endswith("[....................]   0%  - steps/s  ETA -")
    for row in rows:
        row.state = "training"
    for now[0] in range(30, 131):
        for row in rows:
            row.step = (int(now[0]) - 30) // 2
        progress.update(rows)
    # 50 of 100 steps each at 130 s: half done, 0.5 steps/s, 50 steps left each = 100 s
    assert progress.overall(rows) == "[##########..........]  50%  0.50 steps/s  ETA 0:01:40"
    assert out.getvalue().splitlines()[-1].split(" | ")[-1].startswith("[#########")
    progress.close()


def test_live_progress_shows_the_bar_under_the_table() -> None:
    out = io.StringIO()
    progress = Progress("live", title="run x", n_rounds=2, stream=out)
    progress.update([ReplicaRow(rank=0, state="training", step=5, max_steps=10, round=1)])
    progress.close()
    assert "[##########..........]  50%" in out.getvalue()


def test_status_and_report_warn_that_the_secrets_must_not_be_shared(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A run folder holds writer-secrets.json (and signing-keys.json with signing): `status` and
    `report` say not to share them, and how to copy the folder without them; a folder without
    them gets no warning."""
    from composer_replication.cli import main
    from composer_replication.run.security import KEYS_FILE, WRITER_SECRETS_FILE

    folder, store = _fake_run(tmp_path)
    MetricsCollector(store, 2, MetricsSink(folder.metrics, None), None).poll()
    assert run_status(folder)["secrets"] == []
    assert "do not share" not in status_text(run_status(folder))
    assert main(["report", str(folder.root)]) == 0
    assert "do not share" not in capsys.readouterr().err

    (folder.root / WRITER_SECRETS_FILE).write_text("{}")
    info = run_status(folder)
    assert info["secrets"] == [WRITER_SECRETS_FILE]
    line = status_text(info).splitlines()[-1]
    assert line.startswith(f"  do not share {WRITER_SECRETS_FILE}: holds this run's per-rank")
    assert f"rsync -a --exclude {WRITER_SECRETS_FILE} {folder.root}/ DEST/" in line

    (folder.root / KEYS_FILE).write_text("{}")
    assert main(["report", str(folder.root)]) == 0
    err = capsys.readouterr().err
    assert f"warning: do not share {WRITER_SECRETS_FILE} and {KEYS_FILE}: hold" in err
    assert f"--exclude {WRITER_SECRETS_FILE} --exclude {KEYS_FILE}" in err
