"""Every fenced ```python, ```bash and ```toml block in README.md and docs/ is a test case.

A false sentence in the docs must fail CI. Each block (id ``file:line`` of its opening fence):

- toml: parses (tomllib); a block with run-config sections ([run], [task], [diloco], ...) also
  resolves with ``load_config``.
- python: compiles, then runs in a fresh interpreter in a temporary working directory.
- bash: every ``composer-replication`` / ``python -m composer_replication`` command names a real
  subcommand with real options, and the config of ``train`` / ``config show`` /
  ``config validate`` (file relative to the repo root, plus key=value overrides) resolves. A
  cheap block (only ``config show`` / ``config validate`` / ``--help`` / ``--version`` and text
  tools such as ``head`` or ``grep``, no redirection) then runs for real, from the repo root;
  the others (``train``, ``pip``, ``python examples/...``) are parsed, not run.
- a python or bash block followed by a fenced ```output block must print that output
  (tests/docblocks.py: trailing spaces aside, ``...`` matches any text). A block followed by an
  unlabelled fence fails: label it ```output (checked) or ```text (shown as is).

An HTML comment on one of the two lines above the fence changes what is done with a block:

    <!-- doc-test: skip REASON -->             not run (still parsed/compiled); pytest shows REASON
    <!-- doc-test: covered-by tests/x.py -->   another test runs it: that file must call
                                               ``run_doc_block("docs/cli.md", "<text of the
                                               block>", ...)`` (or ``exec_doc_block``) with
                                               arguments that select this block: it runs the
                                               block's text as the doc has it and checks its
                                               output
    <!-- doc-test: slow -->                    runs, but the case is marked slow
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from docblocks import (
    DOC_FILES,
    FENCE,
    OUTPUT,
    ROOT,
    Block,
    all_blocks,
    collect_blocks,
    doc_block,
    output_matches,
    run_block,
)

BLOCKS = all_blocks()


def _params(lang: str) -> list:
    return [
        pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])
        for b in BLOCKS
        if b.lang == lang
    ]


def runs_doc_block(test_source: str, block: Block) -> bool:
    """True when `test_source` calls ``run_doc_block(doc, contains, ...)`` or
    ``exec_doc_block(doc, contains, ...)`` with literal arguments that select `block`."""
    for node in ast.walk(ast.parse(test_source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name not in ("run_doc_block", "exec_doc_block"):
            continue
        args = list(node.args[:2])
        keywords = {k.arg: k.value for k in node.keywords}
        args += [keywords[k] for k in ("doc", "contains")[len(args) :] if k in keywords]
        if len(args) != 2 or not all(
            isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args
        ):
            continue
        doc, contains = (a.value for a in args)  # type: ignore[attr-defined]
        if doc != block.doc:
            continue
        with contextlib.suppress(LookupError):
            if doc_block(doc, contains).line == block.line:
                return True
    return False


def _check_markers(block: Block) -> bool:
    """True when a marker settles the block: a covered-by pointer that holds (else the test
    fails) or a skip (pytest.skip with the doc's reason). False: the block is to be run."""
    if block.covered_by:
        test = ROOT / block.covered_by
        assert test.is_file(), (
            f"{block.id}: covered-by points at {block.covered_by}, which does not exist"
        )
        assert runs_doc_block(test.read_text(), block), (
            f"{block.id}: covered-by names {block.covered_by}, which never runs this block: a "
            f"test there must call run_doc_block({block.doc!r}, <text found only in this "
            "block>, cwd=...) or exec_doc_block(...) (tests/docblocks.py), which run the doc's "
            "own text"
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
    run_block(block, cwd=tmp_path)


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
    paths: list[str | None] = []
    # `config validate` takes any number of files; the others one at most.
    while (
        positional and "=" not in positional[0] and (command == ("config", "validate") or not paths)
    ):
        paths.append(positional.pop(0))
    loose = [a for a in positional if "=" not in a]
    assert not loose, f"{block.id}: `{shown}`: {loose[0]!r} is neither a config nor key=value"
    for i, path in enumerate(paths):
        assert not getattr(ns, "resume", None), (
            f"{block.id}: `{shown}`: --resume takes no config file"
        )
        assert (ROOT / str(path)).is_file(), (
            f"{block.id}: `{shown}`: {path} is not a file in the repo"
        )
        paths[i] = str(ROOT / str(path))
    for path in paths or [None]:
        try:
            # With --resume the run's stored config is used; the overrides must still be real
            # keys.
            load_config(path, positional)
        except ConfigError as exc:
            pytest.fail(f"{block.id}: `{shown}`: the config does not resolve: {exc}")


CHEAP_PROGRAMS = {"echo", "cat", "head", "tail", "grep", "wc", "sort", "ls", "true"}
CHEAP_CLI = {("config", "show"), ("config", "validate")}


def expensive_command(code: str) -> str | None:
    """The first command of a bash block that is not cheap to run (None: all are): cheap are
    `config show`, `config validate` (without --check-store or --check-backend, which reach a
    store or a backend's credentials), `--help`, `--version` and text
    tools; a redirection is not (it would write into the repo)."""
    for words in _commands(code):
        if any(w.startswith((">", "<")) or w[:1].isdigit() and ">" in w for w in words):
            return " ".join(words)
        args = _cli_args(words)
        if args is None:
            if Path(words[0]).name not in CHEAP_PROGRAMS:
                return " ".join(words)
            continue
        if "--help" in args or "-h" in args or "--version" in args:
            continue
        command = tuple(a for a in args if not a.startswith("-"))[:2]
        if command not in CHEAP_CLI or "--check-store" in args or "--check-backend" in args:
            return " ".join(words)
    return None


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
    expensive = expensive_command(block.code)
    assert expensive is None or block.expected is None, (
        f"{block.id}: shows an output but is not run (`{expensive}` is not cheap); run it from "
        "a test with run_doc_block and a covered-by marker, or label the output ```text"
    )
    if expensive is None:
        run_block(block, cwd=ROOT)


# ----------------------------------------------------------------------------- the collector

# Aliases of the checked languages: a block fenced ```sh would escape the checks above.
ALIASES = {
    "py": "python",
    "python3": "python",
    "sh": "bash",
    "shell": "bash",
    "console": "bash",
    "zsh": "bash",
}


def test_no_block_hides_behind_an_alias() -> None:
    hidden = []
    for path in DOC_FILES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            m = FENCE.match(line)
            if m and m.group("lang").lower() in ALIASES:
                where = f"{path.relative_to(ROOT)}:{number}"
                hidden.append(f"{where}: fence it ```{ALIASES[m.group('lang').lower()]}")
    assert not hidden, "blocks the doc tests would not check:\n" + "\n".join(hidden)


def test_every_shown_output_is_checked() -> None:
    """An unlabelled fence right after a python/bash block reads as its output but would go
    unchecked (docs/tasks.md's went stale that way); an ```output block must follow a block."""
    loose = [
        f"{b.doc}:{b.bare_after}: after {b.id}: label it ```{OUTPUT} (checked) or ```text"
        for b in BLOCKS
        if b.bare_after is not None and b.lang in ("python", "bash")
    ]
    attached = {(b.doc, b.expected_line) for b in BLOCKS if b.expected_line is not None}
    for path in DOC_FILES:
        doc = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            m = FENCE.match(line)
            if m and m.group("lang") == OUTPUT and (doc, number) not in attached:
                loose.append(
                    f"{doc}:{number}: an ```{OUTPUT} block right after no python/bash "
                    "block; nothing checks it"
                )
    assert not loose, "\n".join(loose)


def test_output_comparison() -> None:
    assert output_matches("a 1\nb\n", "a 1   \nb\n\n")
    assert not output_matches("a 1\n", "a 2\n")
    assert output_matches("took ... s\nlandlock_abi: ...\n", "took 3.2 s\nlandlock_abi: 7\n")
    assert output_matches("start\n...\nend\n", "start\nx\ny\nend\n")
    assert not output_matches("start\n...\nend\n", "start\nx\n")


def test_covered_by_needs_a_test_that_runs_the_block(tmp_path: Path) -> None:
    """The pointer holds only for a run_doc_block call whose literal arguments select the
    block: naming the doc in a comment or a docstring, or selecting another block, does not."""
    doc = "docs/tasks.md"
    block = next(b for b in BLOCKS if b.doc == doc and "ParityTask" in b.code)
    other = next(b for b in BLOCKS if b.doc == doc and "chain_sum" in b.code)
    assert runs_doc_block(f"run_doc_block({doc!r}, 'class ParityTask', cwd=tmp)\n", block)
    assert runs_doc_block(f"docblocks.run_doc_block(doc={doc!r}, contains='ParityTask')", block)
    assert not runs_doc_block(f"# {doc} runs ParityTask\nx = {doc!r}\n", block)
    assert not runs_doc_block(f"run_doc_block({doc!r}, 'chain_sum', cwd=tmp)\n", block)
    assert runs_doc_block(f"run_doc_block({doc!r}, 'chain_sum', cwd=tmp)\n", other)
    assert not runs_doc_block(f"run_doc_block({doc!r}, 'get_task', cwd=tmp)\n", block)  # many
    assert runs_doc_block(f"exec_doc_block({doc!r}, 'ParityTask', {{}})\n", block)


def test_cheap_bash_blocks_are_told_apart() -> None:
    assert expensive_command("composer-replication config show | head -n 3\n") is None
    assert (
        expensive_command(".venv/bin/composer-replication config validate a.toml b.toml\n") is None
    )
    assert expensive_command("composer-replication train --help\n") is None
    assert expensive_command("composer-replication train\n") == "composer-replication train"
    assert expensive_command("composer-replication config validate x.toml --check-store\n")
    assert expensive_command("composer-replication config validate x.toml --check-backend\n")
    assert expensive_command("pip install -e .\n") == "pip install -e ."
    assert expensive_command("composer-replication config show > out.toml\n")


def test_collector_finds_blocks_and_markers(tmp_path: Path) -> None:
    """The collector itself: fences, languages, indentation, markers and bash splitting."""
    doc = tmp_path / "selftest.md"
    text = (
        "# t\n\n<!-- doc-test: skip needs a GPU -->\n```python\nx = 1\n```\n\n"
        "- item\n\n  ```toml\n  [run]\n  name = 'a'\n  ```\n\n"
        "<!-- doc-test: covered-by tests/test_readme.py -->\n\n```bash\necho hi\n```\n"
        "```text\nnot collected\n```\n"
        "```python\nprint(1)\n```\n\n```output\n1\n```\n```bash\necho 2\n```\n```\n2\n```\n"
    )
    doc.write_text(text)
    blocks = collect_blocks(doc, "docs/selftest.md")
    assert [(b.line, b.lang) for b in blocks] == [
        (4, "python"),
        (10, "toml"),
        (17, "bash"),
        (23, "python"),
        (30, "bash"),
    ]
    assert blocks[0].skip == "needs a GPU" and blocks[0].code == "x = 1\n"
    assert blocks[1].code == "[run]\nname = 'a'\n" and blocks[1].skip is None
    assert blocks[2].covered_by == "tests/test_readme.py" and blocks[2].expected is None
    assert (blocks[3].line, blocks[3].expected, blocks[3].bare_after) == (23, "1\n", None)
    assert (blocks[4].expected, blocks[4].bare_after) == (None, 33)
    assert cli_invocations(
        "FOO=1 .venv/bin/composer-replication train a.toml x.y=1 && echo ok  # c\n"
        "python -m composer_replication config show \\\n  --json | head\n"
        "python -m pytest -q\npip install -e .\n"
    ) == [["train", "a.toml", "x.y=1"], ["config", "show", "--json"]]
    assert python_scripts("python examples/a.py --x 1 &\npython -m pytest\npython /abs.py\n") == [
        "examples/a.py"
    ]
