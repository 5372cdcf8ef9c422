"""Count the `Any` and `object` annotations of composer_replication, per package and per 1,000 lines.

What is counted as `Any`: every use of `typing.Any` in the code as Python parses it (`ast`): a
name `Any` or an attribute `typing.Any` / `t.Any` anywhere in an expression, i.e. in
annotations, aliases, casts and subscripts such as `dict[str, Any]`.

What is counted as `object`: the name `object` used as a type: in an annotation (a parameter's,
a return's, a variable's), or inside a subscript anywhere (`dict[str, object]` in an alias or a
cast), or as `cast`'s first argument. Not counted: `object` as a base class
(`class X(object)`), as a value (`isinstance(x, object)`, `object()`, `object.__setattr__`).

String annotations (`"dict[str, Any]"`) are parsed and counted for both. Not counted: the
import itself (`from typing import Any`), comments, docstrings and other strings that are not
annotations. Lines are physical lines of the `.py` files (blank lines and comments included),
as `wc -l`.

    python scripts/count_any.py            # table per package, then the total
    python scripts/count_any.py --json     # {package: {any, object, combined, lines, per_1000}}

A package is a first-level folder of composer_replication/; top-level modules count as "(root)".
tests/test_types.py holds the ratchet: the combined total may only go down.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1] / "composer_replication"


class Counts(NamedTuple):
    """One module's or package's figures."""

    any: int
    object: int
    lines: int

    @property
    def combined(self) -> int:
        return self.any + self.object

    def plus(self, other: Counts) -> Counts:
        return Counts(self.any + other.any, self.object + other.object, self.lines + other.lines)


def _annotations(tree: ast.AST) -> list[ast.expr]:
    """Every annotation expression of the module (parameters, returns, annotated names)."""
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.AnnAssign, ast.arg)):
            if node.annotation is not None:
                found.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.returns is not None:
                found.append(node.returns)
    return found


def _annotation_strings(tree: ast.AST) -> list[str]:
    """The string constants used as annotations (`x: "dict[str, Any]"`, `-> "Any"`)."""
    return [
        sub.value
        for ann in _annotations(tree)
        for sub in ast.walk(ann)
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str)
    ]


def _count_any(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "Any":
            count += 1
        elif isinstance(node, ast.Attribute) and node.attr == "Any":
            count += 1
    return count


def _is_object(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "object"


def _count_object(tree: ast.AST, *, whole_is_type: bool = False) -> int:
    """`object` used as a type in `tree` (see the module docstring); `whole_is_type` when
    `tree` is itself a type expression (a parsed string annotation)."""
    typed: set[int] = set()
    roots: list[ast.AST] = [tree] if whole_is_type else []
    roots += _annotations(tree) if not whole_is_type else []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            roots.append(node.slice)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and (
                (isinstance(node.func, ast.Name) and node.func.id == "cast")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "cast")
            )
        ):
            roots.append(node.args[0])
    for root in roots:
        for sub in ast.walk(root):
            if _is_object(sub):
                typed.add(id(sub))
    return len(typed)


def count_source(source: str) -> int:
    """The number of `Any` uses in one module's source (see the module docstring)."""
    return count_module(source).any


def count_object_source(source: str) -> int:
    """The number of `object` uses as a type in one module's source (see the module docstring)."""
    return count_module(source).object


def count_module(source: str) -> Counts:
    """One module's `Any` and `object` uses and its lines."""
    tree = ast.parse(source)
    uses_any = _count_any(tree)
    uses_object = _count_object(tree)
    for text in _annotation_strings(tree):
        try:
            expr = ast.parse(text, mode="eval")
        except SyntaxError:  # a string that is not a type expression
            continue
        uses_any += _count_any(expr)
        uses_object += _count_object(expr.body, whole_is_type=True)
    return Counts(uses_any, uses_object, len(source.splitlines()))


def count_package(root: Path = ROOT) -> dict[str, Counts]:
    """{package: Counts} over every .py file under `root`."""
    counts: dict[str, Counts] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        package = rel.parts[0] if len(rel.parts) > 1 else "(root)"
        source = path.read_text(encoding="utf-8")
        counts[package] = counts.get(package, Counts(0, 0, 0)).plus(count_module(source))
    return counts


def total(counts: dict[str, Counts]) -> Counts:
    """The figures summed over the packages."""
    out = Counts(0, 0, 0)
    for c in counts.values():
        out = out.plus(c)
    return out


def _per_1000(uses: int, lines: int) -> float:
    return 1000 * uses / max(lines, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    counts = count_package()
    rows = {**counts, "total": total(counts)}
    if args.json:
        out = {
            k: {
                "any": c.any,
                "object": c.object,
                "combined": c.combined,
                "lines": c.lines,
                "per_1000": round(_per_1000(c.combined, c.lines), 1),
            }
            for k, c in rows.items()
        }
        print(json.dumps(out))
        return 0
    print(f"{'package':<12} {'Any':>5} {'object':>6} {'both':>5} {'lines':>7} {'per 1,000':>9}")
    for name, c in rows.items():
        print(
            f"{name:<12} {c.any:>5} {c.object:>6} {c.combined:>5} {c.lines:>7} "
            f"{_per_1000(c.combined, c.lines):>9.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
