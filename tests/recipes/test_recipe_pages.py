"""Every recipe page follows the seeds' seven-part template and the README links it; their
snippets are tests themselves (tests/test_doc_blocks.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "recipes").glob("*.md"))
PARTS = [
    "What it is",
    "Install",
    "Minimal example",
    "Config keys",
    "How the channels map",
    "Limits",
    "Troubleshooting",
]


def test_the_seeds_recipes_all_have_a_page() -> None:
    # Recipes 1-5 of the seeds (TRL, VeRL, PRIME-RL, serverless DiLoCo, Monarch) and OpenEnv
    names = {p.stem for p in PAGES}
    assert {"trl", "verl", "prime_rl", "serverless", "monarch", "openenv"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_seven_parts_in_order_and_linked_from_the_readme(page: Path) -> None:
    titles = re.findall(r"^## \d\. (.+)$", page.read_text(), flags=re.M)
    # a part may name its section in parentheses: "Config keys (`[task]`)"
    assert [t.split(" (", 1)[0] for t in titles] == PARTS, page.name
    assert f"(docs/recipes/{page.name})" in (ROOT / "README.md").read_text()
