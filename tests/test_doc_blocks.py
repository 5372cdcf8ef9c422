"""Every fenced ```python, ```bash and ```toml block in README.md and docs/ is a test case.

A false sentence in the docs must fail CI. Each block (id ``file:line`` of its opening fence):

- toml: parses (tomllib); a block with run-config sections ([run], [task], [diloco], ...) also
  resolves with ``load_config``.
- python: compiles, then runs in a fresh interpreter in a temporary working directory.
- bash: every ``composer-replication`` / ``python -m composer_replication`` command names a real
  subcommand with real options, and the config of ``train`` / ``config show`` /
  ``config validate`` (file relative to the repo root, plus key=value overrides) resolves.
  Other lines (pip, git, export, python -m pytest, ...) are not run.

An HTML comment on one of the two lines above the fence changes what is done with a block:

    <!-- doc-test: skip REASON -->             not run (still parsed/compiled); pytest shows REASON
    <!-- doc-test: covered-by tests/x.py -->   another test runs it; that file must exist and
                                               name the doc, e.g. docs/cli.md (so the pointer
                                               cannot rot)
    <!-- doc-test: slow -->                    runs, but the case is marked slow
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "recipes").glob("*.md")),
]
LANGUAGES = ("python", "bash", "toml")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"<!--\s*doc-test:\s*(?P<kind>skip|covered-by|slow)\b\s*(?P<arg>.*?)\s*-->")
PYTHON_TIMEOUT_S = 180


@dataclass(frozen=True)
class Block:
    doc: str  # path relative to the repo root, e.g. "docs/cli.md"
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None = None  # the reason
    covered_by: str | None = None
    slow: bool = False

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


def collect_blocks(path: Path, doc: str | None = None) -> list[Block]:
    """The python/bash/toml blocks of one markdown file, with their markers."""
    doc = doc or path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group("fence"), m.group("lang")
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if end == len(lines):
            raise ValueError(f"{doc}:{i + 1}: the fence opened here is never closed")
        if lang in LANGUAGES:
            marks = _markers(lines, i, doc)
            blocks.append(
                Block(
                    doc=doc,
                    line=i + 1,
                    lang=lang,
                    code=textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n",
                    skip=marks.get("skip"),
                    covered_by=marks.get("covered-by"),
                    slow="slow" in marks,
                )
            )
        i = end + 1
    return blocks


BLOCKS = [b for path in DOC_FILES for b in collect_blocks(path)]


def _params(lang: str) -> list:
    return [
        pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])
        for b in BLOCKS
        if b.lang == lang
    ]


def _check_markers(block: Block) -> bool:
    """True when a marker settles the block: a covered-by pointer that holds (else the test
    fails) or a skip (pytest.skip with the doc's reason). False: the block is to be run."""
    if block.covered_by:
        test = ROOT / block.covered_by
        assert test.is_file(), (
            f"{block.id}: covered-by points at {block.covered_by}, which does not exist"
        )
        assert block.doc in test.read_text(), (
            f"{block.id}: {block.covered_by} does not mention {block.doc}; the test that runs "
            "this block must name the doc it checks"
        )
        return True
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    return False


# ----------------------------------------------------------------------------- toml


def _run_config_sections() -> set[str]:
    from composer_replication.config import RunConfig

    return {f.name for f in dataclasses.fields(RunConfig)}


@pytest.mark.parametrize("block", _params("toml"))
def test_toml_block(block: Block, tmp_path: Path) -> None:
    try:
        tree = tomllib.loads(block.code)
    except tomllib.TOMLDecodeError as exc:
        pytest.fail(f"{block.id}: not valid TOML: {exc}")
    if _check_markers(block):
        return
    if not set(tree) & _run_config_sections():
        return  # another program's TOML (e.g. a PRIME-RL config): parsing is the check
    from composer_replication.config import ConfigError, load_config

    config_file = tmp_path / "block.toml"
    config_file.write_text(block.code)
    try:
        load_config(config_file)
    except ConfigError as exc:
        pytest.fail(f"{block.id}: the run config does not resolve: {exc}")


# ----------------------------------------------------------------------------- python


@pytest.mark.parametrize("block", _params("python"))
def test_python_block(block: Block, tmp_path: Path) -> None:
    try:
        compile(block.code, block.id, "exec")
    except SyntaxError as exc:
        pytest.fail(f"{block.id}: does not compile: {exc}")
    if _check_markers(block):
        return
    script = tmp_path / "doc_block.py"
    script.write_text(block.code)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=PYTHON_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # The block may have started processes of its own (an executor's replicas, in their
        # own sessions): kill the whole tree, or they outlive the test.
        for pid in [*_descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{block.id}: still running after {PYTHON_TIMEOUT_S} s:\n{stderr[-3000:]}")
    assert proc.returncode == 0, (
        f"{block.id} exited {proc.returncode}:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    )


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


# ----------------------------------------------------------------------------- bash

CLI_NAMES = ("composer-replication", ".venv/bin/composer-replication")
RESOLVING = {("train",), ("config", "show"), ("config", "validate"), ("bake-traces",)}


def _commands(code: str) -> list[list[str]]:
    """The simple commands of a bash block: continuations joined, comments dropped, split at
    ;, &&, ||, | and &; leading VAR=value assignments removed."""
    text = code.replace("\\\n", " ")
    commands: list[list[str]] = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    out = []
    for words in commands:
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


def _cli_args(words: list[str]) -> list[str] | None:
    """The arguments after the program when `words` invokes composer-replication, else None."""
    if words[0] in CLI_NAMES or words[0].endswith("/composer-replication"):
        return words[1:]
    is_python = re.fullmatch(r"(.*/)?python(3(\.\d+)?)?", words[0]) is not None
    if is_python and words[1:3] == ["-m", "composer_replication"]:
        return words[3:]
    return None


def cli_invocations(code: str) -> list[list[str]]:
    return [args for words in _commands(code) if (args := _cli_args(words)) is not None]


def python_scripts(code: str) -> list[str]:
    """The relative script paths a bash block runs with python (`python examples/x.py ...`)."""
    return [
        words[1]
        for words in _commands(code)
        if len(words) > 1
        and re.fullmatch(r"(.*/)?python(3(\.\d+)?)?", words[0])
        and words[1].endswith(".py")
        and not words[1].startswith("/")
    ]


def _check_invocation(block: Block, args: list[str]) -> None:
    from composer_replication.cli import build_parser
    from composer_replication.config import ConfigError, load_config

    shown = "composer-replication " + " ".join(shlex.quote(a) for a in args)
    parser = build_parser()
    parser.exit_on_error = False
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            ns, extra = parser.parse_known_args(args)
    except (SystemExit, Exception) as exc:  # argparse exits on a bad subcommand/option
        why = said.getvalue().strip().splitlines()[-1:] or [str(exc)]
        pytest.fail(f"{block.id}: `{shown}` is not a valid command line: {why[0]}")
    positional = [*getattr(ns, "args", []), *extra]
    bad = [a for a in extra if a.startswith("-") or "args" not in vars(ns)]
    assert not bad, f"{block.id}: `{shown}`: unrecognized arguments {bad}"
    command = tuple(a for a in args if not a.startswith("-"))[:2]
    if command[:1] != ("config",):
        command = command[:1]
    if command not in RESOLVING:
        return
    path = None
    if positional and "=" not in positional[0]:
        path = positional.pop(0)
    loose = [a for a in positional if "=" not in a]
    assert not loose, f"{block.id}: `{shown}`: {loose[0]!r} is neither a config nor key=value"
    if path is not None:
        assert not getattr(ns, "resume", None), (
            f"{block.id}: `{shown}`: --resume takes no config file"
        )
        assert (ROOT / path).is_file(), f"{block.id}: `{shown}`: {path} is not a file in the repo"
        path = str(ROOT / path)
    try:
        # With --resume the run's stored config is used; the overrides must still be real keys.
        load_config(path, positional)
    except ConfigError as exc:
        pytest.fail(f"{block.id}: `{shown}`: the config does not resolve: {exc}")


@pytest.mark.parametrize("block", _params("bash"))
def test_bash_block(block: Block) -> None:
    try:
        invocations = cli_invocations(block.code)
    except ValueError as exc:  # shlex: unbalanced quotes
        pytest.fail(f"{block.id}: cannot split into commands: {exc}")
    if _check_markers(block):
        return
    for script in python_scripts(block.code):
        assert (ROOT / script).is_file(), f"{block.id}: `python {script}`: no such file in the repo"
    for args in invocations:
        _check_invocation(block, args)


# ----------------------------------------------------------------------------- the collector

# Aliases of the checked languages: a block fenced ```sh would escape the checks above.
ALIASES = {"py": "python", "python3": "python", "sh": "bash", "shell": "bash", "console": "bash",
           "zsh": "bash"}  # fmt: skip


def test_no_block_hides_behind_an_alias() -> None:
    hidden = []
    for path in DOC_FILES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            m = FENCE.match(line)
            if m and m.group("lang").lower() in ALIASES:
                where = f"{path.relative_to(ROOT)}:{number}"
                hidden.append(f"{where}: fence it ```{ALIASES[m.group('lang').lower()]}")
    assert not hidden, "blocks the doc tests would not check:\n" + "\n".join(hidden)


def test_collector_finds_blocks_and_markers(tmp_path: Path) -> None:
    """The collector itself: fences, languages, indentation, markers and bash splitting."""
    doc = tmp_path / "selftest.md"
    text = (
        "# t\n\n<!-- doc-test: skip needs a GPU -->\n```python\nx = 1\n```\n\n"
        "- item\n\n  ```toml\n  [run]\n  name = 'a'\n  ```\n\n"
        "<!-- doc-test: covered-by tests/test_readme.py -->\n\n```bash\necho hi\n```\n"
        "```text\nnot collected\n```\n"
    )
    doc.write_text(text)
    blocks = collect_blocks(doc, "docs/selftest.md")
    assert [(b.line, b.lang) for b in blocks] == [(4, "python"), (10, "toml"), (17, "bash")]
    assert blocks[0].skip == "needs a GPU" and blocks[0].code == "x = 1\n"
    assert blocks[1].code == "[run]\nname = 'a'\n" and blocks[1].skip is None
    assert blocks[2].covered_by == "tests/test_readme.py"
    assert cli_invocations(
        "FOO=1 .venv/bin/composer-replication train a.toml x.y=1 && echo ok  # c\n"
        "python -m composer_replication config show \\\n  --json | head\n"
        "python -m pytest -q\npip install -e .\n"
    ) == [["train", "a.toml", "x.y=1"], ["config", "show", "--json"]]
    assert python_scripts("python examples/a.py --x 1 &\npython -m pytest\npython /abs.py\n") == [
        "examples/a.py"
    ]
