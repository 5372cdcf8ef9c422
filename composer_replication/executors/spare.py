"""A warm spare: a Python process started before a replica needs it, that then becomes one.

``python -m composer_replication.executors.spare --ready-fd N [--preload MODULE ...]`` imports
the preload modules (e.g. ``torch``), writes ``ready`` on fd N, then blocks on stdin for ONE
assignment, a line of JSON::

    {"argv": ["path/x.py", ARGS...] | ["-m", "pkg.mod", ARGS...],
     "env": {NAME: VALUE, ...}, "cwd": "/dir" | null, "log": "/abs/replica-0-ab12.log"}

It checks the assignment (never unpickles anything), points its stdout and stderr at ``log``
(appended, as a cold launch does) and its stdin at /dev/null, changes to ``cwd``, replaces its
environment with ``env``, and runs the entrypoint as ``python ARGV`` would: a script through
``runpy.run_path(script, run_name="__main__")`` (``sys.path[0]`` its directory), a module through
``runpy.run_module(module, run_name="__main__")`` (``sys.path[0]`` the working directory). From
then on it is the replica: same pid, process group and parent-death signal as the spare, exit
code the entrypoint's.

What a spare cannot change after it started: the variables the interpreter reads at startup.
An assignment whose ``PYTHON*`` or ``LD_*`` variables differ from the spare's own is refused
(`startup_vars`), as is any assignment that is not the shape above; a refusal is printed (to
``log`` when the assignment names a usable one) and the spare exits with code 2. A spare whose
stdin closes without an assignment (the executor shut down, the driver died) exits 0.

The executor side (starting spares, handing a restart to a ready one) is
`LocalProcessExecutor`'s (``warm_spares``, executors/local.py); `assignment_line` and
`spare_command` are what it writes and runs. Only stdlib imports here: the spare's own start
must not cost what it saves.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import runpy
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the spare's own start imports nothing of the project's
    from composer_replication.json_types import JSONValue

__all__ = [
    "Assignment",
    "SPARE_MODULE",
    "assignment_line",
    "is_module_name",
    "main",
    "parse_assignment",
    "runnable_argv",
    "spare_command",
    "startup_vars",
]

SPARE_MODULE = "composer_replication.executors.spare"
REFUSED_EXIT = 2  # a bad assignment
PRELOAD_FAILED_EXIT = 3  # a preload module did not import: the spare never becomes ready

_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_module_name(name: str) -> bool:
    """A dotted Python module name (``pkg.mod``), as ``python -m`` and ``import`` take it."""
    return _MODULE_RE.match(name) is not None


_KEYS = {"argv", "env", "cwd", "log"}
_STARTUP_PREFIXES = ("PYTHON", "LD_")


@dataclass(frozen=True)
class Assignment:
    """What one spare is to run: the command line after the interpreter, its environment,
    working directory (None: the spare's) and log file (absolute)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    log: str


def startup_vars(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of env that an interpreter reads when it starts (``PYTHON*``, ``LD_*``):
    a spare already started cannot take a launch whose values differ."""
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)}


def runnable_argv(command: Sequence[str], python: str) -> list[str] | None:
    """The argv after the interpreter when a spare can run ``command`` (``[python, script,
    ...]`` or ``[python, -m, module, ...]``), else None (another program, interpreter options)."""
    if len(command) < 2 or command[0] != python:
        return None
    rest = list(command[1:])
    if rest[0] == "-m":
        return rest if len(rest) >= 2 and is_module_name(rest[1]) else None
    return None if rest[0].startswith("-") else rest


def spare_command(python: str, ready_fd: int, preload: Sequence[str]) -> list[str]:
    """The command line of a spare that signals readiness on ``ready_fd``."""
    command = [python, "-m", SPARE_MODULE, "--ready-fd", str(ready_fd)]
    for name in preload:
        command += ["--preload", name]
    return command


def assignment_line(assignment: Assignment) -> bytes:
    """The assignment as the spare reads it: one line of JSON."""
    doc = {
        "argv": assignment.argv,
        "env": assignment.env,
        "cwd": assignment.cwd,
        "log": assignment.log,
    }
    return json.dumps(doc).encode() + b"\n"


def _refuse(why: str) -> ValueError:
    return ValueError(f"spare assignment refused: {why}")


def _check_log(log: JSONValue) -> str:
    if not isinstance(log, str) or not os.path.isabs(log) or "\0" in log:
        raise _refuse(f"'log' must be an absolute path, got {log!r}")
    return log


def _check_argv(argv: JSONValue) -> list[str]:
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise _refuse(f"'argv' must be a non-empty list of strings, got {argv!r}")
    if any("\0" in a for a in argv):
        raise _refuse("'argv' holds a NUL byte")
    if argv[0] == "-m":
        if len(argv) < 2 or not is_module_name(argv[1]):
            raise _refuse(f"'-m' needs a module name, got {argv[1:2]!r}")
    elif argv[0].startswith("-"):
        raise _refuse(f"interpreter options are not taken (argv[0] is {argv[0]!r})")
    return list(argv)


def _check_env(env: JSONValue) -> dict[str, str]:
    if not isinstance(env, dict):
        raise _refuse(f"'env' must be an object, got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(v, str) or not k or "=" in k or "\0" in k or "\0" in v:
            raise _refuse(f"'env' entry {k!r} is not NAME (no '=', no NUL) -> string")
    return dict(env)


def parse_assignment(line: bytes, spare_env: Mapping[str, str] | None = None) -> Assignment:
    """The assignment in ``line``, checked; ValueError saying what is wrong. With ``spare_env``
    (the spare's environment at its start), also refuse differing startup variables."""
    try:
        doc = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _refuse(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or set(doc) != _KEYS:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise _refuse(f"expected an object with keys {sorted(_KEYS)}, got {got}")
    log = _check_log(doc["log"])
    argv = _check_argv(doc["argv"])
    env = _check_env(doc["env"])
    cwd = doc["cwd"]
    if cwd is not None and (not isinstance(cwd, str) or not os.path.isdir(cwd)):
        raise _refuse(f"'cwd' must be null or a directory, got {cwd!r}")
    if spare_env is not None:
        mine, theirs = startup_vars(spare_env), startup_vars(env)
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if differ:
            raise _refuse(
                f"startup variables {differ} differ from the spare's (it started with them "
                "already read); launch this one cold"
            )
    return Assignment(argv, env, cwd, log)


def _output_to(log: str) -> None:
    """stdout and stderr appended to log, stdin from /dev/null: a cold launch's fds."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def _log_of(line: bytes) -> str | None:
    """The assignment's log path when it names a usable one (for a refusal to land there)."""
    try:
        doc = json.loads(line)
        return _check_log(doc["log"]) if isinstance(doc, dict) else None
    except (ValueError, KeyError, UnicodeDecodeError):
        return None


def run(assignment: Assignment) -> None:
    """Become the replica: fds, working directory, environment, argv; run the entrypoint."""
    _output_to(assignment.log)
    if assignment.cwd is not None:
        os.chdir(assignment.cwd)
    os.environ.clear()
    os.environ.update(assignment.env)
    argv = assignment.argv
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file in argv[0]
        if not sys.flags.safe_path:
            sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(argv[0])  # __file__ absolute, as for `python script.py`
    sys.argv = [script, *argv[1:]]
    if not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    """Preload, signal readiness, wait for one assignment, run it (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=f"python -m {SPARE_MODULE}")
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--preload", action="append", default=[])
    args = parser.parse_args(argv)
    spare_env = dict(os.environ)
    for name in args.preload:
        try:
            importlib.import_module(name)
        except Exception as e:  # reported in the spare's log; the executor launches cold
            print(f"spare {os.getpid()}: preload {name!r} failed: {e!r}", file=sys.stderr)
            return PRELOAD_FAILED_EXIT
    os.write(args.ready_fd, b"ready\n")
    os.close(args.ready_fd)
    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    try:
        assignment = parse_assignment(line, spare_env)
    except ValueError as e:
        log = _log_of(line)
        if log is not None:
            _output_to(log)
        print(f"spare {os.getpid()}: {e}", file=sys.stderr)
        return REFUSED_EXIT
    run(assignment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
