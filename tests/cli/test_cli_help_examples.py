"""Every example a `--help` text shows keeps its word: each one is found in the help texts
themselves (not only in cli.EXAMPLES) and run. `config` examples run as they are; a `train`
example runs `train`'s own checks before it writes anything (as `config validate`, with its
options turned into the overrides they stand for; the hub check is left out, `--offline`: it
asks the network, not the example); a `bake-traces` example runs for real in a temporary
folder."""

from __future__ import annotations

import argparse
import glob
import re
import shlex
from pathlib import Path

import pytest

from composer_replication.cli import EXAMPLES, PROG, build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def help_texts() -> dict[str, str]:
    """`--help` of the program and of every (sub)command, by command name."""
    texts: dict[str, str] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        texts[name] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}".strip())

    walk(build_parser(), "")
    return texts


def shown_examples() -> set[str]:
    """The argument strings of every `composer-replication ...` command line a help text
    shows: the lines under "examples:" and the back-quoted commands in the prose."""
    found = set()
    for text in help_texts().values():
        found |= {m.strip() for m in re.findall(rf"^\s+{PROG} (.+)$", text, re.M)}
        flat = " ".join(text.split())  # argparse wraps prose lines
        found |= {m.strip() for m in re.findall(rf"`{PROG} ([^`]+)`", flat)}
    return found


def test_the_examples_shown_are_the_ones_listed() -> None:
    listed = {e for examples in EXAMPLES.values() for e in examples}
    assert shown_examples() == listed | {"train"}, (
        "a --help text shows a command that cli.EXAMPLES does not list (or the other way round)"
    )
    assert any("=" in e for e in listed) and len(listed) >= 6


def test_no_help_text_shows_an_override_outside_its_examples() -> None:
    """An override written into prose ("e.g. train.max_steps=20") would go unrun."""
    for name, text in help_texts().items():
        prose = "\n".join(line for line in text.splitlines() if not line.strip().startswith(PROG))
        # (the usage's placeholder `section.key=value` and `run.name=...` are no examples)
        loose = re.findall(r"\b(?!section\.key=)[a-z_]+\.[a-z_]+=(?!\.\.\.)[^\s\])]+", prose)
        assert not loose, f"`{PROG} {name} --help` shows {loose} outside its examples"


def _args(example: str) -> list[str]:
    out: list[str] = []
    for word in shlex.split(example):
        if "*" in word:  # the shell would expand it, from the repo root
            matches = sorted(glob.glob(word, root_dir=ROOT))
            assert matches, f"{example!r}: {word} matches nothing"
            out += matches
        else:
            out.append(word)
    return out


def _as_validate(args: list[str]) -> list[str]:
    """A `train` example as the `config validate` that runs train's checks on it."""
    assert args[0] == "train"
    rest, out = args[1:], ["config", "validate"]
    while rest:
        word = rest.pop(0)
        if word == "--name":
            out.append(f"run.name={rest.pop(0)}")
        else:
            assert not word.startswith("-"), f"train example with option {word}: map it here"
            out.append(word)
    return [*out, "--offline"]


EVERY = sorted({e for examples in EXAMPLES.values() for e in examples})


@pytest.mark.parametrize("example", EVERY)
def test_help_example_runs(
    example: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    args = _args(example)
    if args[0] == "train":
        monkeypatch.chdir(ROOT)
        code = main(_as_validate(args))
    elif args[0] == "bake-traces":
        monkeypatch.chdir(tmp_path)
        code = main(args)
        assert Path(args[args.index("--out") + 1]).is_file()
    else:
        monkeypatch.chdir(ROOT)
        code = main(args)
    captured = capsys.readouterr()
    assert code == 0, f"`{PROG} {example}` exited {code}: {captured.err}"


def test_help_names_every_exit_code_train_returns(capsys: pytest.CaptureFixture) -> None:
    from composer_replication.run.supervision import EXIT_RUN_NO_QUORUM

    for command in ([], ["train"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for code in (0, 1, 2, EXIT_RUN_NO_QUORUM, 130):
            assert re.search(rf"\b{code} [a-z]", text), (command, code, text)
