"""Every snippet of docs/recipes/openenv.md runs as written (against the example server of its
section 3, started by the `openenv_server` fixture) or is checked against what it names; the
train command itself runs in tests/run/test_run_train_openenv.py."""

from __future__ import annotations

import inspect
import re
import socket
import tomllib
from pathlib import Path

import pytest
from docblocks import exec_doc_block

from composer_replication.assembly.build import build_task
from composer_replication.config import ConfigError, load_config
from composer_replication.run import preflight
from composer_replication.tasks import get_task
from composer_replication.tasks.openenv import OpenEnvTask, OpenEnvUnavailable

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "recipes" / "openenv.md").read_text()
SOURCES = (ROOT / "composer_replication" / "tasks" / "openenv.py").read_text()
DOC_URL = "http://127.0.0.1:8000"

pytest.importorskip("openenv", reason="needs the `openenv` extra (openenv-core)")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, flags=re.S)


def test_seven_part_template() -> None:
    headings = re.findall(r"^## (\d)\. (.+)$", DOC, flags=re.M)
    assert [title for _, title in headings] == [
        "What it is",
        "Install",
        "Minimal example",
        "Config keys (`[task]`)",
        "How the channels map",
        "Limits",
        "Troubleshooting",
    ]


def test_install_snippet_names_the_extra() -> None:
    install, _run = blocks("bash")
    assert install.strip() == 'pip install -e ".[openenv]"'
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["openenv"] == ["openenv-core==0.3.0"]
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "openenv" in setup.split("\nALL_EXTRAS=")[1].split()[0]  # `setup.sh --all` has it


def test_python_snippet_prints_what_the_doc_shows(openenv_server: str, capsys) -> None:
    (expected,) = blocks("text")
    exec_doc_block(
        "docs/recipes/openenv.md", "task.check_ready()", replace={DOC_URL: openenv_server}
    )
    assert capsys.readouterr().out == expected


def test_toml_snippet_builds_the_task(openenv_server: str, tmp_path: Path) -> None:
    (snippet,) = blocks("toml")
    path = tmp_path / "run.toml"
    path.write_text(snippet.replace(DOC_URL, openenv_server))
    config = load_config(path)
    task = build_task(config)
    assert isinstance(task, OpenEnvTask)
    assert task.env == openenv_server and task.reward_range == (-1.0, 1.0)
    assert (task.n_train, task.n_eval) == (256, 32)
    preflight.check_task(config)  # reachable, fields found


def test_config_table_lists_every_option_with_its_default() -> None:
    table = DOC.split("## 4.")[1].split("## 5.")[0]
    params = inspect.signature(OpenEnvTask.__init__).parameters
    for name, param in params.items():
        if name in ("self", "seed", "n_train", "n_eval"):
            continue
        row = next((line for line in table.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, name
        if name == "env":
            continue
        default = param.default
        shown = {
            None: "`None`",
            (0.0, 1.0): "`[0.0, 1.0]`",
        }.get(default, f'`"{default}"`' if isinstance(default, str) else f"`{default!r}`")
        if name == "reset_kwargs":
            shown = "`{}`"
        assert row.split("|")[2].strip() == shown, name


def test_troubleshooting_messages_are_the_real_ones(
    openenv_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each symptom's quoted text (its parts around "...") is in a message produced here or, for
    those this server cannot provoke, in the adapter's source."""
    messages = [SOURCES]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(ConfigError) as unreachable:
        preflight.check_task(
            load_config(overrides=[f"task.name=openenv:http://127.0.0.1:{closed}"])
        )
    messages.append(str(unreachable.value))
    with pytest.raises(ValueError) as no_scheme:
        get_task("openenv:127.0.0.1:8000")
    messages.append(str(no_scheme.value))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(OpenEnvUnavailable) as no_docker:
        get_task("openenv:echo-env:latest").check_ready()
    messages.append(str(no_docker.value))
    monkeypatch.undo()
    task = get_task(f"openenv:{openenv_server}", n_train=2, n_eval=1)
    ex = task.train_examples()[0]
    messages.append(str(task.verify(ex, "9" * 99).feedback))
    drifted = get_task(f"openenv:{openenv_server}", n_train=2, n_eval=1, reset_kwargs={"offset": 1})
    with pytest.raises(ValueError) as drift:
        drifted.verify(ex, "1")
    messages.append(str(drift.value))
    task.close()
    drifted.close()

    table = DOC.split("## 7.")[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 8
    corpus = "\n".join(messages)
    for row in rows:
        symptom = row.split("|")[1].strip()
        quoted = re.match(r"`([^`]+)`", symptom)
        assert quoted is not None, row
        for part in quoted.group(1).split("..."):
            part = part.strip().removeprefix("ImportError: ")
            assert part in corpus, (part, row)
