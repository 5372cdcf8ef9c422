"""`composer-replication train` on an OpenEnv environment (`task.name = "openenv:URL"`): the
command of docs/recipes/openenv.md runs to the end against examples/openenv/sum_env.py, with its
rewards and channel-2 feedback from the environment server; a URL where nothing listens, or a
loss screen without reference answers, fails in the preflight, before any replica starts."""

from __future__ import annotations

import re
import shlex
import socket
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.config import ConfigError, load_config
from composer_replication.run import preflight
from composer_replication.run.metrics import read_metrics

DOC = (Path(__file__).resolve().parents[2] / "docs" / "recipes" / "openenv.md").read_text()

pytest.importorskip("openenv", reason="needs the `openenv` extra (openenv-core)")

# tests/run/test_run_train_e2e.py's small settings, one round of two inner steps
SMALL = [
    *TINY_RUN,
    "train.max_steps=2",
    "diloco.sync_every_h=2",
    "logging.tensorboard=false",
    "logging.report=false",
]


@pytest.mark.slow
@pytest.mark.heavy
def test_train_on_an_openenv_server_runs_to_the_end(
    openenv_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    (bash,) = re.findall(r"```bash\n(python examples.*?)```", DOC, flags=re.S)
    server_line, train_line = bash.strip().splitlines()
    assert server_line == "python examples/openenv/sum_env.py --port 8000 &"
    argv = shlex.split(train_line.replace("http://127.0.0.1:8000", openenv_server))
    assert argv[:2] == ["composer-replication", "train"]
    monkeypatch.chdir(tmp_path)
    code = main([*argv[1:], *SMALL, "--name", "oe"])  # the doc's command, tiny settings
    run = tmp_path / "runs" / "oe"
    out = capsys.readouterr().out
    assert code == 0, out + "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "Run oe: finished" in out
    records = read_metrics(run / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert {r["replica"] for r in train} == {0, 1} and {r["step"] for r in train} == {1, 2}
    # rewards are the environment's, mapped from [-1, 1]: a random tiny model's answers are
    # mostly not numbers (-1 -> 0.0) or wrong numbers (-0.5 -> 0.25)
    assert all(0.0 <= r["reward"] <= 1.0 for r in train)
    # every wrong answer came back with the environment's feedback, which channel 2 used
    assert all(r["sdpo/frac_with_feedback"] > 0 for r in train)
    # its teacher was measured on those hints, and channel 2 acted only where its gate let it
    # (a random model reading a hint is rarely better than without one: docs/trainer.md)
    assert all("sdpo/teacher_advantage" in r for r in train)
    assert all(r["sdpo/active"] <= r["sdpo/gate_open"] for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)


def test_unreachable_openenv_url_fails_before_any_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    monkeypatch.chdir(tmp_path)
    code = main(["train", *SMALL, f"task.name=openenv:http://127.0.0.1:{port}", "--name", "oe"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"task.name: 'openenv:http://127.0.0.1:{port}': cannot reach the OpenEnv server" in err
    assert "start the environment server" in err
    assert not (tmp_path / "runs" / "oe").exists()  # nothing written, no replica launched


def test_loss_screen_without_reference_answers_fails_in_preflight(openenv_server: str) -> None:
    config = load_config(
        overrides=[f"task.name=openenv:{openenv_server}", "task.n_eval=4", "diloco.screen=loss"]
    )
    with pytest.raises(ConfigError, match="diloco.screen: 'loss' scores the task's reference"):
        preflight.check_task(config)
    preflight.check_task(load_config(overrides=[f"task.name=openenv:{openenv_server}"]))
    answered = 'task.options={answer_field = "answer", reset_kwargs = {reveal = true}}'
    preflight.check_task(
        load_config(
            overrides=[f"task.name=openenv:{openenv_server}", "diloco.screen=loss", answered]
        )
    )
