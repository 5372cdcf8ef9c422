"""docs/api.md states the loss keywords' defaults; they must be ComposeConfig's (one source)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from composer_replication.loss import TAID_T_END, TAID_T_START, ComposeConfig, TAIDScheduler

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def table_defaults(text: str, header: str) -> dict[str, object]:
    """``{name: default}`` of a markdown table whose header row starts with ``header``: the
    first column names one or more keywords in backticks, the second their comma-separated
    python literals (one value for all names, or one each)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    out: dict[str, object] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`(\w+)`", cells[0])
        raw = [v.strip().strip("`") for v in cells[1].split(",")]
        try:
            values = [ast.literal_eval(v) for v in raw]
        except (ValueError, SyntaxError):
            continue  # prose, not a literal (e.g. "SDPO wording")
        if len(values) == 1:
            values = values * len(names)
        assert len(values) == len(names), line
        out.update(zip(names, values))
    return out


def test_api_keyword_table_is_compose_config():
    documented = table_defaults(DOC.read_text(), "| keyword | default |")
    defaults = {f.name: f.default for f in dataclasses.fields(ComposeConfig)}
    assert documented == defaults


def test_taid_schedule_ends_are_written_once():
    text = DOC.read_text()
    assert f"`TAID_T_START = {TAID_T_START}`, `TAID_T_END = {TAID_T_END}`" in text
    sched = TAIDScheduler()
    assert (sched.t_start, sched.t_end) == (TAID_T_START, TAID_T_END)


def test_table_reader_sees_a_wrong_default():
    text = "| keyword | default | meaning |\n|---|---|---|\n| `alpha_sdpo`, `x` | 0.2, None | w |\n"
    assert table_defaults(text, "| keyword | default |") == {"alpha_sdpo": 0.2, "x": None}
