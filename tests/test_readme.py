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


def _first_paragraph() -> str:
    """The paragraph right after the two commands (the README's first screen)."""
    after = README.split("```bash", 1)[1].split("```", 1)[1]
    return after.strip().split("\n\n", 1)[0]


def test_readme_first_screen_says_what_it_is_then_a_short_paragraph() -> None:
    """A tagline before the commands; then at most ~100 words with at most two headline
    numbers (the conditions go to a footnote), the demo's headline being run/expected.py's."""
    from composer_replication.run.expected import DEMO

    head = README.split("```bash", 1)[0]
    tagline = [line for line in head.splitlines()[1:] if line.strip()]
    assert tagline and tagline[0].startswith("**"), "a one-sentence tagline before the commands"
    paragraph = _first_paragraph()
    words = re.findall(r"[A-Za-z0-9][\w'./:-]*", re.sub(r"\[\^\w+\]", "", paragraph))
    assert len(words) <= 100, f"the first paragraph has {len(words)} words (at most ~100)"
    numbers = re.findall(r"(?<![\w.])\d+\.\d+|(?<![\w.])\d+(?=\s+seeds)", paragraph)
    assert len(numbers) <= 3, numbers  # the headline figure, its baseline and its seed count
    assert DEMO.accuracy_median is not None
    assert f"median of {DEMO.accuracy_median:.3f}" in paragraph


def test_readme_keeps_unmet_goals_in_its_status_section() -> None:
    status = README.split("\n## Status\n", 1)[1].split("\n## ", 1)[0]
    elsewhere = README.replace(status, "")
    assert "not met" not in elsewhere.lower(), "unmet goals belong in the Status section"
    assert status.count("not met") >= 6
    assert "[Status](#status)" in _first_paragraph()


def test_no_internal_issue_numbers_in_user_docs() -> None:
    """User docs speak of features and dates, not of this project's issue numbers (the lab
    notebook, docs/benchmarks-notebook.md, is kept as it was written)."""
    docs = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    found = []
    for path in docs:
        if path.name == "benchmarks-notebook.md":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bissues? #?\d+", line, re.I):
                found.append(f"{path.relative_to(ROOT)}:{n}")
    assert not found, found


def test_docs_form_a_path_from_the_index() -> None:
    """docs/README.md links every page of docs/ (and ARCHITECTURE.md for contributors), in the
    order quickstart -> concepts -> reference -> recipes; the README links the index."""
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    linked = set(re.findall(r"\]\(([\w/.-]+\.md)(?:#[\w-]+)?\)", index))
    assert pages - {"README.md"} <= linked, sorted(pages - {"README.md"} - linked)
    assert "(../ARCHITECTURE.md)" in index
    order = [index.index(h) for h in ("**Start**", "**Concepts**", "**Reference**", "**Recipes**")]
    assert order == sorted(order)
    assert "(docs/README.md)" in README and "(ARCHITECTURE.md)" in README
    for target in linked:
        assert (ROOT / "docs" / target).is_file(), target


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of a markdown file (lower case, punctuation dropped,
    spaces to hyphens; fenced blocks skipped)."""
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_every_relative_link_of_the_docs_resolves() -> None:
    """Links between the README, ARCHITECTURE.md and docs/ point at files that exist and, with
    a #fragment, at a heading they have (sections moved between pages must take their links)."""
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").rglob("*.md")]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s):, mailto:
            file, _, fragment = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_benchmarks_page_opens_with_one_short_headline_table() -> None:
    """docs/benchmarks.md: one table first, a short row per headline result (benchmark, key,
    value, goal, met, date), and a link to the lab notebook that holds the rest."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    tables = re.findall(r"(?:^\|.*\|\n)+", page, re.M)
    assert len(tables) == 1, "one headline table"
    header, rule, *rows = tables[0].splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "benchmark",
        "key",
        "value",
        "goal",
        "met",
        "date",
    ]
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(row) <= 140, f"a long row: {row}"
        assert cells[4] in ("yes", "no") and re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells[5]), row
    assert "(benchmarks-notebook.md)" in page.split(tables[0])[0], "the notebook is linked first"
