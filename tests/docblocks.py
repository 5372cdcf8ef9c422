"""The fenced blocks of README.md and docs/: how they are found, run, and checked against the
output they show. tests/test_doc_blocks.py runs every block through this; a test that a block's
`<!-- doc-test: covered-by tests/x.py -->` marker names runs it with `run_doc_block`, which takes
the block's text from the doc at run time (never a copy that could drift from it), or with
`exec_doc_block` to run it in its own process and inspect what it built.

A block carries its expected output in a fenced ```output block right after it (blank lines in
between allowed). The output the block prints must equal it, compared line by line with trailing
spaces and trailing blank lines ignored; `...` matches any text, on one line or across lines (as
doctest's ELLIPSIS), for what varies between machines or runs.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "recipes").glob("*.md")),
]
LANGUAGES = ("python", "bash", "toml")
OUTPUT = "output"
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"<!--\s*doc-test:\s*(?P<kind>skip|covered-by|slow)\b\s*(?P<arg>.*?)\s*-->")
TIMEOUT_S = 180


@dataclass(frozen=True)
class Block:
    doc: str  # path relative to the repo root, e.g. "docs/cli.md"
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None = None  # the reason
    covered_by: str | None = None
    slow: bool = False
    expected: str | None = None  # the ```output block after it
    expected_line: int | None = None  # that block's opening fence
    bare_after: int | None = None  # line of an unlabelled fence right after it (output-like)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _markers(lines: list[str], fence_index: int, doc: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for text in lines[max(0, fence_index - 2) : fence_index]:
        for m in MARKER.finditer(text):
            kind, arg = m.group("kind"), m.group("arg")
            if kind in ("skip", "covered-by") and not arg:
                raise ValueError(
                    f"{doc}:{fence_index + 1}: '<!-- doc-test: {kind} -->' needs "
                    + ("a reason" if kind == "skip" else "a test file path")
                )
            found[kind] = arg
    return found


def _fences(lines: list[str], doc: str) -> list[tuple[int, int, str]]:
    """(opening index, closing index, language) of every fenced block, in order."""
    out = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence = m.group("fence")
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if end == len(lines):
            raise ValueError(f"{doc}:{i + 1}: the fence opened here is never closed")
        out.append((i, end, m.group("lang")))
        i = end + 1
    return out


def collect_blocks(path: Path, doc: str | None = None) -> list[Block]:
    """The python/bash/toml blocks of one markdown file, with their markers and outputs."""
    doc = doc or path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    fences = _fences(lines, doc)
    blocks: list[Block] = []
    for k, (start, end, lang) in enumerate(fences):
        if lang not in LANGUAGES:
            continue
        expected = expected_line = bare = None
        if k + 1 < len(fences):
            nxt_start, nxt_end, nxt_lang = fences[k + 1]
            adjacent = all(not line.strip() for line in lines[end + 1 : nxt_start])
            if adjacent and nxt_lang == OUTPUT:
                expected = textwrap.dedent("\n".join(lines[nxt_start + 1 : nxt_end])) + "\n"
                expected_line = nxt_start + 1
            elif adjacent and nxt_lang == "":
                bare = nxt_start + 1
        marks = _markers(lines, start, doc)
        blocks.append(
            Block(
                doc=doc,
                line=start + 1,
                lang=lang,
                code=textwrap.dedent("\n".join(lines[start + 1 : end])) + "\n",
                skip=marks.get("skip"),
                covered_by=marks.get("covered-by"),
                slow="slow" in marks,
                expected=expected,
                expected_line=expected_line,
                bare_after=bare,
            )
        )
    return blocks


def all_blocks() -> list[Block]:
    return [b for path in DOC_FILES for b in collect_blocks(path)]


def doc_block(doc: str, contains: str) -> Block:
    """The one python/bash block of `doc` whose text contains `contains`."""
    found = [b for b in collect_blocks(ROOT / doc, doc) if b.lang != "toml" and contains in b.code]
    if len(found) != 1:
        where = ", ".join(b.id for b in found) or "none"
        raise LookupError(f"{doc}: {len(found)} blocks contain {contains!r} ({where}); need one")
    return found[0]


# ----------------------------------------------------------------------------- outputs


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines()) + "\n"


def output_matches(expected: str, actual: str) -> bool:
    """`actual` equals `expected` (trailing spaces and blank lines aside), `...` matching any
    text."""
    checker = doctest.OutputChecker()
    return checker.check_output(_normalise(expected), _normalise(actual), doctest.ELLIPSIS)


def check_output(block: Block, actual: str) -> None:
    if block.expected is None:
        return
    assert output_matches(block.expected, actual), (
        f"{block.id}: the output shown after the block is not what it prints.\n"
        f"--- shown in {block.doc}\n{block.expected}--- printed\n{actual}"
    )


# ----------------------------------------------------------------------------- running


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc), children first found first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def run_code(
    lang: str,
    code: str,
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
    name: str = "doc block",
) -> subprocess.CompletedProcess[str]:
    """Run python code in a fresh interpreter, or bash code with `set -eo pipefail`, in `cwd`
    (the repo and the interpreter's bin folder come first on PYTHONPATH / PATH)."""
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "COLUMNS": "100",
        **(env or {}),
    }
    if lang == "python":
        script = cwd / ".doc_block.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    elif lang == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        raise ValueError(f"{name}: cannot run a {lang} block")
    proc = subprocess.Popen(
        argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The block may have started processes of its own (an executor's replicas, in their
        # own sessions): kill the whole tree, or they outlive the test.
        for pid in [*_descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{name}: still running after {timeout} s:\n{stderr[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def run_block(
    block: Block,
    *,
    cwd: Path,
    replace: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
) -> str:
    """Run `block` (with `replace`'s substitutions, each of which must occur in it), check that
    it exits 0 and prints its ```output block, if it has one; return what it printed."""
    code = block.code
    for old, new in (replace or {}).items():
        assert old in code, f"{block.id}: the text to replace, {old!r}, is not in the block"
        code = code.replace(old, new)
    proc = run_code(block.lang, code, cwd=cwd, env=env, timeout=timeout, name=block.id)
    assert proc.returncode == 0, (
        f"{block.id} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    check_output(block, proc.stdout)
    return proc.stdout


def run_doc_block(
    doc: str,
    contains: str,
    *,
    cwd: Path,
    replace: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
) -> str:
    """Run the block of `doc` that contains `contains`, as `run_block` does. A test named by a
    block's covered-by marker calls this (tests/test_doc_blocks.py checks that it does, with
    arguments that select that block)."""
    return run_block(doc_block(doc, contains), cwd=cwd, replace=replace, env=env, timeout=timeout)


def exec_doc_block(
    doc: str,
    contains: str,
    namespace: dict[str, object] | None = None,
    *,
    replace: dict[str, str] | None = None,
) -> dict[str, object]:
    """Execute the python block of `doc` that contains `contains` in this process, in
    `namespace` (for a test that inspects the objects it builds, or hands it stand-ins of what
    the doc assumes); check its ```output block, if any; return the namespace. What it prints
    is passed on to sys.stdout as well (pytest's capsys sees it)."""
    block = doc_block(doc, contains)
    assert block.lang == "python", f"{block.id} is a {block.lang} block"
    code = block.code
    for old, new in (replace or {}).items():
        assert old in code, f"{block.id}: the text to replace, {old!r}, is not in the block"
        code = code.replace(old, new)
    namespace = {} if namespace is None else namespace
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, block.id, "exec"), namespace)
    sys.stdout.write(printed.getvalue())
    check_output(block, printed.getvalue())
    return namespace


# ----------------------------------------------------------------------------- regenerating


def write_outputs(doc: str, *, cwd: Path) -> list[str]:
    """Rewrite every ```output block of `doc` whose block now prints something else with what
    it prints (blocks whose output still matches, `...` included, are left alone); return the
    ids rewritten. `python tests/docblocks.py docs/tasks.md` runs it."""
    path = ROOT / doc
    lines = path.read_text().splitlines()
    changed = []
    # From the bottom up, so earlier line numbers stay valid.
    for block in reversed(collect_blocks(path, doc)):
        if block.expected_line is None or block.skip or block.covered_by:
            continue
        proc = run_code(
            block.lang, block.code, cwd=cwd if block.lang == "python" else ROOT, name=block.id
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{block.id} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        if output_matches(block.expected or "", proc.stdout):
            continue
        start = block.expected_line  # index of the first output line (1-based fence line)
        end = start
        while not lines[end].strip().startswith("```"):
            end += 1
        indent = re.match(r"\s*", lines[start - 1]).group(0)  # type: ignore[union-attr]
        body = [indent + line if line else "" for line in _normalise(proc.stdout).splitlines()]
        lines[start:end] = body
        changed.append(block.id)
    path.write_text("\n".join(lines) + "\n")
    return changed


if __name__ == "__main__":
    import tempfile

    for name in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            print(name, "rewrote:", ", ".join(write_outputs(name, cwd=Path(tmp))) or "nothing")
