"""The command line: --help everywhere, and configuration errors that exit 2 and write nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_replication.cli import build_parser, main

SUBCOMMANDS = [
    ["train"],
    ["report"],
    ["status"],
    ["config"],
    ["config", "show"],
    ["config", "validate"],
    ["bake-traces"],
    ["replica"],
    ["synchronizer"],
]


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=lambda c: " ".join(c))
def test_help_for_every_subcommand(command: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: composer-replication {' '.join(command)}")
    assert len(out.splitlines()) > 4


def test_every_subcommand_is_covered_by_the_help_test() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted({c[0] for c in SUBCOMMANDS})


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "composer_replication", "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 0 and "train" in proc.stdout and "bake-traces" in proc.stdout


def test_usage_error_exits_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["train.max_stepz=3"],
            "train.max_stepz: unknown key in section [train] (did you mean 'max_steps'?)",
        ),
        (["train.max_steps=abc"], "train.max_steps: expected an integer, got string 'abc'"),
        (
            ["model.name=./no/such/model"],
            "model.name: local model folder './no/such/model' does not exist",
        ),
        (
            ["task.name=arithmetc"],
            "task.name: unknown task 'arithmetc' (did you mean 'arithmetic'?)",
        ),
        (
            ["backend.resources={num_cpus = 1}"],
            "backend.resources: the local backend takes no resources",
        ),
        (
            ["store.uri=file:///dev/null/store/"],
            "store.uri: file:///dev/null/store/ is not writable: '/dev/null' is a file",
        ),
        (["missing.toml"], "config file 'missing.toml' not found"),
        (["train.max_steps=3", "stray"], "unexpected argument 'stray'"),
    ],
)
def test_train_config_errors_exit_2_and_write_nothing(
    args: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("composer-replication: error: ") and message in err, err
    assert _tree(tmp_path) == before  # nothing written, not even runs/


def test_store_that_is_a_file_is_not_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    before = _tree(tmp_path)
    uri = (tmp_path / "afile" / "store").as_uri()
    assert main(["train", f"store.uri={uri}"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_existing_run_folder_is_never_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    existing = tmp_path / "runs" / "mine"
    existing.mkdir(parents=True)
    (existing / "notes.txt").write_text("precious")
    before = _tree(tmp_path)
    assert main(["train", "--name", "mine"]) == 2
    err = capsys.readouterr().err
    assert "run folder" in err and "already exists" in err and "--resume" in err
    assert main(["train", "run.name=mine"]) == 2
    assert main(["train", "--resume", "mine", "--overwrite"]) == 2
    assert main(["train", "--resume", "mine"]) == 2  # not a run folder (no config.json)
    assert "is not a run folder" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_config_show_and_validate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["config", "show", "train.max_steps=100"]) == 0
    shown = capsys.readouterr().out
    assert "max_steps = 100" in shown
    path = tmp_path / "shown.toml"
    path.write_text(shown)
    assert main(["config", "validate", str(path)]) == 0
    assert capsys.readouterr().out.startswith("ok: 2 x local replicas, model tiny")
    assert main(["config", "validate", str(path), "backend.n_replicas=0"]) == 2
    assert "backend.n_replicas: 0 must be >= 1" in capsys.readouterr().err
    assert main(["config", "validate", "model.name=not a model id"]) == 2
    assert "neither 'tiny', an existing folder, nor a hub id" in capsys.readouterr().err
    # get_task's "reasoning_gym:DATASET" shorthand is a valid task name in a config too.
    assert main(["config", "validate", "task.name=reasoning_gym:chain_sum"]) == 0
    assert "task reasoning_gym:chain_sum" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()


def test_config_validate_takes_several_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`config validate a.toml b.toml ... overrides`: each file checked, the overrides applied
    to each, one line per file; any failure exits 2 naming its file, after the others ran."""
    good = tmp_path / "good.toml"
    good.write_text("[train]\nmax_steps = 100\n")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nmax_step = 100\n")
    assert main(["config", "validate", str(good), str(good), "diloco.sync_every_h=25"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        out
        == [
            f"{good}: ok: 2 x local replicas, model tiny, task arithmetic, 100 inner "
            "steps, 4 outer rounds"
        ]
        * 2
    )
    assert main(["config", "validate", str(bad), str(good), str(tmp_path / "none.toml")]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{good}: ok:")
    assert f"error: {bad}: train.max_step: unknown key" in captured.err
    assert f"error: {tmp_path / 'none.toml'}:" in captured.err
    assert "2 of 3 configs failed" in captured.err
    assert main(["config", "validate", str(good), "x.y=1", "stray"]) == 2
    assert "only section.key=value overrides" in capsys.readouterr().err


def test_examples_validate(capsys: pytest.CaptureFixture) -> None:
    """Every shipped example config parses and passes the checks that need no cloud SDK."""
    examples = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))
    assert len(examples) >= 6
    for example in examples:
        code = main(["config", "show", str(example)])
        assert code == 0, (example, capsys.readouterr().err)
    capsys.readouterr()


def test_bake_traces_with_the_oracle_resumes_and_repairs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A re-run fills the gaps (asks only for prompts without a trace and appends them), after
    cutting off a line torn by a crash; --overwrite starts afresh."""
    from composer_replication.data.traces import iter_trace_file

    out = tmp_path / "traces.jsonl"
    cfg = ["task.n_train=12", "task.n_eval=4", "task.shard=shared"]
    assert main(["bake-traces", *cfg, "--out", str(out), "--limit", "5"]) == 0
    assert "wrote 5 new traces" in capsys.readouterr().out
    first = out.read_text()
    with out.open("a") as fh:  # a crash in the middle of an append
        fh.write('{"prompt_key": "abc", "comple')
    assert main(["bake-traces", *cfg, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "resuming" in printed and "wrote 7 new traces" in printed
    text = out.read_text()
    assert text.startswith(first)  # the five paid-for traces are kept as they were
    records = list(iter_trace_file(out))
    assert len(records) == 12 and len({r.prompt_key for r in records}) == 12
    assert all(r.teacher == "oracle" and r.reward == 1.0 for r in records)
    assert main(["bake-traces", *cfg, "--out", str(out)]) == 0  # nothing left to ask
    assert "wrote 0 new traces" in capsys.readouterr().out and out.read_text() == text
    assert main(["bake-traces", *cfg, "--out", str(out), "--overwrite", "--limit", "3"]) == 0
    assert len(list(iter_trace_file(out))) == 3


def test_replica_without_rank_or_store_exits_2(capsys: pytest.CaptureFixture) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REPLICA_RANK", "DILOCO_RENDEZVOUS")}
    proc = subprocess.run(
        [sys.executable, "-m", "composer_replication.run.replica"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2 and "no replica rank" in proc.stderr


def test_resume_refuses_a_run_that_is_still_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import json
    import socket

    from composer_replication.config import load_config, to_dict

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "busy"
    run.mkdir(parents=True)
    config = load_config(overrides=["run.name=busy", f"store.uri={(run / 'store').as_uri()}/"])
    (run / "config.json").write_text(json.dumps(to_dict(config)))
    driver = {"status": "running", "pid": os.getpid(), "host": socket.gethostname()}
    (run / "driver.json").write_text(json.dumps(driver))
    before = _tree(tmp_path)
    assert main(["train", "--resume", "busy"]) == 2
    assert "is still running (driver pid" in capsys.readouterr().err
    assert _tree(tmp_path) == before
    (run / "driver.json").write_text(json.dumps({**driver, "pid": 2**22 + 12345}))  # gone
    before = _tree(tmp_path)
    assert main(["train", "--resume", "busy", "run.name=other"]) == 2
    assert "run.name cannot change on resume" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_resume_of_a_finished_run_says_so_and_launches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`train --resume` of a finished run: exit 0 with a message, nothing written (its wall
    time stays); with a larger train.max_steps it trains on."""
    import json

    from composer_replication.config import load_config, to_dict
    from composer_replication.run.driver import finished_already

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "done"
    run.mkdir(parents=True)
    config = load_config(overrides=["run.name=done", f"store.uri={(run / 'store').as_uri()}/"])
    (run / "config.json").write_text(json.dumps(to_dict(config)))
    driver = {
        "status": "finished",
        "attempt": 1,
        "started": 1000.0,
        "ended": 1616.2,
        "wall_seconds": 616.2,
    }
    (run / "driver.json").write_text(json.dumps(driver))
    before = _tree(tmp_path)
    assert main(["train", "--resume", "done"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Run done has already finished (1200 inner steps, 616.2 s): nothing to")
    assert "train.max_steps=N (N > 1200)" in out
    assert main(["train", "--resume", "done", "train.max_steps=1200"]) == 0
    assert _tree(tmp_path) == before
    # More steps: the run trains on (the resume is not stopped here).
    assert finished_already("done", ["train.max_steps=1500"]) is None
    assert finished_already("done", []) is not None


def test_docs_command_table_lists_every_command() -> None:
    """docs/cli.md's command table names every subcommand (and config's actions)."""
    import re

    doc = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    table = doc.split("| command | what it does |", 1)[1].split("\n\n", 1)[0]
    listed = {" ".join(m.group(1).split()[:2]) for m in re.finditer(r"^\| `([^`]+)`", table, re.M)}
    listed = {c if c.startswith("config ") else c.split()[0] for c in listed}
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    expected = {c for c in sub.choices if c != "config"} | {"config show", "config validate"}
    assert expected <= listed, sorted(expected - listed)
