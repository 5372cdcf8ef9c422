"""docs/tasks.md's arithmetic reward table states the weights the task uses (its snippets'
outputs are checked by tests/test_doc_blocks.py)."""

from __future__ import annotations

from pathlib import Path

from composer_replication.tasks import arithmetic as a

DOC = (Path(__file__).resolve().parents[2] / "docs" / "tasks.md").read_text()


def test_arithmetic_reward_rows_are_the_task_weights() -> None:
    rows = [
        f"| | bare integer, wrong | `{a.WRONG_BASE} + {a.WRONG_CLOSE}*closeness` "
        f"({a.WRONG_BASE}..<{a.WRONG_BASE + a.WRONG_CLOSE:.1f}) |",
        f"| | integer inside other text | `({a.MALFORMED_BASE} + {a.MALFORMED_CLOSE}*closeness) "
        f"* brevity` (< {a.MALFORMED_BASE + a.MALFORMED_CLOSE:.2f}) |",
        f"| | no integer / empty | `{a.NO_NUMBER} * brevity` / 0 |",
    ]
    for row in rows:
        assert row in DOC, row
