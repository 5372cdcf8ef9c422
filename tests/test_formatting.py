"""The formatter's rules hold everywhere (issue 21, item 8): at most a few aligned tables may
opt out of `ruff format` with a skip or off marker, across the package, tests, benchmarks,
examples and scripts. `.ci/run` runs `ruff format --check`; this bounds the opt-outs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("composer_replication", "tests", "benchmarks", "examples", "scripts")
MARKERS = tuple("# fmt: " + word for word in ("skip", "off"))  # spelled so this file has none
MAX_OPT_OUTS = 20


def opt_outs(root: Path = ROOT) -> list[str]:
    """`path:line` of every formatter opt-out marker in the project's Python files."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if any(marker in line for marker in MARKERS):
                    found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_formatter_opt_outs_stay_few() -> None:
    found = opt_outs()
    assert len(found) <= MAX_OPT_OUTS, (
        f"{len(found)} formatter opt-outs (at most {MAX_OPT_OUTS}, for aligned tables only): "
        + ", ".join(found[:30])
    )


def test_the_count_sees_a_planted_marker(tmp_path: Path) -> None:
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "tests" / "t.py").write_text("x = [1,2]  " + MARKERS[0] + "\ny = 1\n")
    assert opt_outs(tmp_path) == ["tests/t.py:1"]
