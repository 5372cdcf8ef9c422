"""Count the `Any` annotations of composer_replication, per package and per 1,000 lines.

What is counted: every use of `typing.Any` in the code as Python parses it (`ast`): a name
`Any` or an attribute `typing.Any` / `t.Any` anywhere in an expression, i.e. in annotations,
aliases, casts and subscripts such as `dict[str, Any]`. String annotations
(`"dict[str, Any]"`) are parsed and counted too. Not counted: the import itself
(`from typing import Any`), comments, docstrings and other strings that are not annotations.
Lines are physical lines of the `.py` files (blank lines and comments included), as `wc -l`.

    python scripts/count_any.py            # table per package, then the total
    python scripts/count_any.py --json     # one JSON object: {package: {any, lines, per_1000}}

A package is a first-level folder of composer_replication/; top-level modules count as "(root)".
tests/test_types.py holds the ratchet: the total may only go down.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "composer_replication"


def _annotation_strings(tree: ast.AST) -> list[str]:
    """The string constants used as annotations (`x: "dict[str, Any]"`, `-> "Any"`)."""
    found: list[str] = []
    for node in ast.walk(tree):
        annotations: list[ast.expr | None] = []
        if isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        elif isinstance(node, ast.arg):
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations.append(node.returns)
        for ann in annotations:
            for sub in ast.walk(ann) if ann is not None else ():
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    found.append(sub.value)
    return found


def _count_in(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "Any":
            count += 1
        elif isinstance(node, ast.Attribute) and node.attr == "Any":
            count += 1
    return count


def count_source(source: str) -> int:
    """The number of `Any` uses in one module's source (see the module docstring)."""
    tree = ast.parse(source)
    total = _count_in(tree)
    for text in _annotation_strings(tree):
        try:
            total += _count_in(ast.parse(text, mode="eval"))
        except SyntaxError:  # a string that is not a type expression
            continue
    return total


def count_package(root: Path = ROOT) -> dict[str, tuple[int, int]]:
    """{package: (Any uses, lines)} over every .py file under `root`."""
    counts: dict[str, tuple[int, int]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        package = rel.parts[0] if len(rel.parts) > 1 else "(root)"
        source = path.read_text(encoding="utf-8")
        uses, lines = counts.get(package, (0, 0))
        counts[package] = (uses + count_source(source), lines + len(source.splitlines()))
    return counts


def total(counts: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """(Any uses, lines) summed over the packages."""
    return sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    counts = count_package()
    uses, lines = total(counts)
    rows = {**counts, "total": (uses, lines)}
    if args.json:
        out = {
            k: {"any": a, "lines": n, "per_1000": round(1000 * a / max(n, 1), 1)}
            for k, (a, n) in rows.items()
        }
        print(json.dumps(out))
        return 0
    print(f"{'package':<12} {'Any':>5} {'lines':>7} {'per 1,000':>9}")
    for name, (a, n) in rows.items():
        print(f"{name:<12} {a:>5} {n:>7} {1000 * a / max(n, 1):>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
