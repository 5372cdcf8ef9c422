"""docs/quickstart.md's first run, for real: its short `train` command runs as the doc has it,
the printout the doc shows is the one such a run prints (numbers aside, which vary with the
machine), and the doc's checkpoint snippet then reproduces the run's own last evaluation.

The printout in the doc is written by this test, not pasted:

    COMPOSER_WRITE_DOCS=1 python -m pytest tests/run/test_first_run.py

replaces it with the printout of the run the test just made (paths relative to the folder the
command ran in).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from docblocks import ROOT, doc_block, run_doc_block

from composer_replication.run.report import LOSS_RISE_LINE

DOC = "docs/quickstart.md"
COMMAND = "--name first-run"  # selects the doc's short-run block

pytestmark = [pytest.mark.slow, pytest.mark.long]


def shown_printout(doc_text: str, after_line: int) -> tuple[int, int, str]:
    """(first line index, end index, text) of the first ```text block after line `after_line`
    (1-based) of `doc_text`."""
    lines = doc_text.splitlines()
    start = next(i for i in range(after_line, len(lines)) if lines[i].strip() == "```text") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "```")
    return start, end, "\n".join(lines[start:end]) + "\n"


def final_printout(stdout: str, name: str, cwd: Path) -> str:
    """The lines `train` prints at the end (from `Run NAME:` on), paths relative to `cwd`."""
    lines = stdout.replace(f"{cwd.resolve()}/", "").replace(f"{cwd}/", "").splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith(f"Run {name}: "))
    return "\n".join(lines[first:]) + "\n"


def shape(printout: str) -> list[str]:
    """The printout with what varies from machine to machine taken out: decimal numbers and
    percentages, and the line that says why channels 2/3 rose (printed only when they did)."""
    return [
        re.sub(r"-?\d+(?:\.\d+)?%|-?\d+\.\d+", "<x>", line.rstrip())
        for line in printout.splitlines()
        if line.strip() and line.strip() != LOSS_RISE_LINE
    ]


def test_shape_ignores_the_numbers_but_not_the_lines() -> None:
    a = "Run r: finished after 33.9 s (2 replicas)\n  eval accuracy    first: 0.000   last: 0.051\n"
    b = "Run r: finished after 41.2 s (2 replicas)\n  eval accuracy    first: 0.004   last: -0.5\n"
    assert shape(a) == shape(b)
    assert shape(a) != shape(a.replace("2 replicas", "3 replicas"))
    assert shape(a) != shape(a + "  device           cpu\n")
    assert shape(a + f"  {LOSS_RISE_LINE}\n") == shape(a)
    assert shape(a + "  gate open in 40%\n") == shape(a + "  gate open in 7%\n")


def test_the_first_run_prints_what_the_quickstart_shows(tmp_path: Path) -> None:
    block = doc_block(DOC, COMMAND)
    out = run_doc_block("docs/quickstart.md", "--name first-run", cwd=tmp_path, timeout=280)
    printed = final_printout(out, "first-run", tmp_path)
    assert "Run first-run: finished" in printed, out[-3000:]
    doc_path = ROOT / DOC
    text = doc_path.read_text()
    start, end, shown = shown_printout(text, block.line)
    if os.environ.get("COMPOSER_WRITE_DOCS") == "1":
        lines = text.splitlines()
        lines[start:end] = printed.rstrip("\n").splitlines()
        doc_path.write_text("\n".join(lines) + "\n")
        shown = printed
    assert shape(shown) == shape(printed), (
        f"{DOC}: the first run's printout has changed; rewrite it with "
        "`COMPOSER_WRITE_DOCS=1 python -m pytest tests/run/test_first_run.py`\n"
        f"--- the doc\n{shown}--- a run now\n{printed}"
    )

    # The doc's next step on the same run: the checkpoint, loaded and evaluated as the doc says,
    # gives the run's own last evaluation.
    snippet = run_doc_block("docs/quickstart.md", "apply_chat_template", cwd=tmp_path).split("\n")
    snippet = [line for line in snippet if line]
    m = re.fullmatch(
        r"accuracy (\S+) on (\d+) held-out prompts; the run's last evaluation: (\S+)", snippet[-1]
    )
    assert m is not None, snippet
    assert m.group(1) == m.group(3), snippet[-1]
    assert re.search(rf"eval accuracy .* last: {re.escape(m.group(1))} ", printed), printed
