"""No template token is left in the README or the docs: a figure that was never filled in must
fail CI, not reach a reader (issue 23: `SEAWEEDFS_BEFORE_2` sat in a table of
docs/benchmarks.md).

A template token is an all-caps name ending in ``_<digits>`` (``SEAWEEDFS_BEFORE_2``), a
``{{ name }}`` slot, a ``<fill ...>`` / ``<TBD>`` marker, or one of the words TODO, TBD, FIXME,
XXX standing alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
TEMPLATE = re.compile(
    r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*_\d+\b"  # SEAWEEDFS_BEFORE_2
    r"|\{\{\s*[A-Za-z_][\w.]*\s*\}\}"  # {{ name }}
    r"|<\s*(?:fill|tbd|todo)[^>]*>"  # <fill in>, <TBD>
    r"|\b(?:TODO|TBD|FIXME|XXX)\b",
    re.IGNORECASE,
)
# An all-caps name with a trailing number that is a real name, not a slot (none so far).
ALLOWED: set[str] = set()


def template_tokens(text: str) -> list[tuple[int, str]]:
    """(line number, token) of every template token in `text`."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in TEMPLATE.finditer(line):
            token = m.group()
            # names and words count in ALL CAPS only ("sm_90", "a todo list" are prose)
            if (token.isupper() or not token[0].isalpha()) and token not in ALLOWED:
                out.append((n, token))
    return out


def test_the_scanner_catches_planted_tokens() -> None:
    planted = (
        "| before #2 | 16.52 | SEAWEEDFS_BEFORE_2 |\n"
        "held-out accuracy {{ heldout_acc }}\n"
        "measured on <fill in the date>\n"
        "TODO: rerun quiet\n"
    )
    assert [t for _, t in template_tokens(planted)] == [
        "SEAWEEDFS_BEFORE_2",
        "{{ heldout_acc }}",
        "<fill in the date>",
        "TODO",
    ]
    clean = "`COMPOSER_STORAGE_OPTIONS`, H100_x1? no: `sm_90`, 2x_faster, a todo list, {'a': {}}"
    assert template_tokens(clean) == []


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_no_template_token_is_left_in_the_docs(path: Path) -> None:
    found = template_tokens(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)}: unfilled template tokens (line, token): {found}"
