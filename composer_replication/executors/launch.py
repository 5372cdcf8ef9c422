"""Run a "pkg.mod:function" entrypoint as a process: `python -m ...launch pkg.mod:function ARGS`.

Executors start every replica as a command line (`build_command`), so a function entrypoint
needs a small trampoline: import the module, call `function(argv)` with the remaining
arguments, and exit with what it returns, as `sys.exit` would (None -> 0, an int -> that code).
An exception propagates, so Python prints the traceback and exits with 1, like a script would.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import TypeAlias, cast

# A function entrypoint: called with the arguments after it; returns what `sys.exit` takes.
EntryPoint: TypeAlias = Callable[[list[str]], int | str | None]


def resolve(target: str) -> EntryPoint:
    """Import "pkg.mod:function" and return the function; ValueError saying what is wrong."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'pkg.mod:function', got {target!r}")
    module = importlib.import_module(module_name)
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"{module_name!r} has no attribute {attr!r} (from {target!r})"
            ) from None
    if not callable(obj):
        raise ValueError(f"{target!r} is not callable (it is a {type(obj).__name__})")
    return cast(EntryPoint, obj)  # the contract of an entrypoint: it is called as one


def main(argv: Sequence[str] | None = None) -> int | str | None:
    """Call the target with the rest of argv; return its result (for `sys.exit`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(
            "usage: python -m composer_replication.executors.launch pkg.mod:function [ARGS...]",
            file=sys.stderr,
        )
        return 2
    function = resolve(args[0])
    # Make sys.argv look like the function's own program so that argparse inside it (when it
    # parses sys.argv rather than its argument) sees the same arguments and a sensible prog name.
    sys.argv = [args[0], *args[1:]]
    return function(args[1:])


if __name__ == "__main__":
    sys.exit(main())
