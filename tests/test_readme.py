"""The README must keep working as written: its two commands exist and its example runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docblocks import run_doc_block

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block is not None and README.index("```bash") < README.index("## What it is")
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    commands = [c for c in commands if c]
    assert commands == [
        "bash scripts/setup.sh && .venv/bin/composer-replication train",
        "bash scripts/test.sh",
    ]
    for script in ("scripts/setup.sh", "scripts/test.sh"):
        assert (ROOT / script).is_file()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci, ".ci/run must run the README's test command"
    # the README's command leaves the `long` tests out: CI must run them in a step of its own
    assert "bash scripts/test.sh --long" in ci, ".ci/run must run the long tests too"
    assert '-m "not long"' in (ROOT / "scripts" / "test.sh").read_text()


@pytest.mark.slow
def test_readme_example_trains_on_a_fresh_store(tmp_path: Path) -> None:
    """The README's own text, with a shorter budget: it trains from scratch in a new store of
    its own under the temporary folder (a fixed store path made a second run continue the
    first), committing its two rounds there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run_doc_block(
        "README.md",
        "make_diloco_outer_loop(",
        cwd=tmp_path,
        timeout=280,
        replace={"max_steps=40": "max_steps=2", "sync_every_h=10": "sync_every_h=1"},
        env={"WORLD_SIZE": "1", "REPLICA_RANK": "0", "TMPDIR": str(tmp)},
    )
    (store,) = tmp.glob("composer-run-*")
    states = sorted(p.name for p in (store / "states" / "global").glob("*.safetensors"))
    assert states == [f"{k:010d}.safetensors" for k in range(3)]  # initial state + 2 rounds
    assert (tmp_path / "runs" / "example").is_dir()


def test_readme_quotes_the_measured_figures_the_run_prints() -> None:
    """The README's demo figures are run/expected.py's (what `train` prints when it starts the
    embedded default): ranges over seeds and machines, wall time with its load."""
    from composer_replication.run.expected import readme_sentence

    assert " ".join(readme_sentence().split()) in " ".join(README.split())
