"""Types at the joints (issue 21 item 6, issue 38 item 5): the `Any` + `object` count of
composer_replication only goes down.

scripts/count_any.py counts every `Any` the parser sees (annotations, aliases, casts,
subscripts, string annotations), not the import, comments or docstrings; and every `object`
used as a type (annotations, subscripts, casts), not `object` as a base class or a value.
`COMBINED_BOUND` is the ratchet: the figure the package stood at when it was last lowered.
Lower it when you remove `Any`s or `object`s; raising it needs a reason a reviewer accepts (a
third-party object without stubs, a value that is really opaque).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import count_any  # noqa: E402

# `Any` + `object` in annotations (issue 38: goal <= 8 per 1,000 lines); lower it as they go.
COMBINED_BOUND = 335


def test_any_and_object_count_never_rises() -> None:
    counts = count_any.total(count_any.count_package())
    per_1000 = 1000 * counts.combined / counts.lines
    assert counts.combined <= COMBINED_BOUND, (
        f"composer_replication has {counts.any} `Any` and {counts.object} `object` in annotations "
        f"({per_1000:.1f} per 1,000 lines), above the ratchet {COMBINED_BOUND}: type the new "
        "joint (a Protocol, a TypedDict, the config dataclass, `JSONValue`) instead; run "
        "scripts/count_any.py to see which package rose"
    )


def test_counts_code_not_comments_or_docstrings() -> None:
    source = '''
"""A docstring that says Any."""
from typing import Any
import typing

# a comment with Any
X: dict[str, Any] = {}

def f(a: Any, b: "list[Any]") -> typing.Any:
    """Any here is prose."""
    return cast(Any, a), "Any in a plain string"
'''
    # dict[str, Any], a: Any, "list[Any]", typing.Any, cast(Any, ...)
    assert count_any.count_source(source) == 5


def test_counts_object_as_a_type_not_as_a_base_or_value() -> None:
    source = '''
"""A docstring that says object."""
from typing import Any, cast

class Old(object):  # a base class: not counted
    pass

X: dict[str, object] = {}
Y = list[object]

def f(a: object, b: "tuple[object, ...]") -> object:
    """object here is prose."""
    if isinstance(a, object) and a is not object():
        return cast(object, b)
    return object.__new__(Old)

def g(c: Any) -> Any:
    return c
'''
    # X: dict[str, object], list[object], a: object, "tuple[object, ...]", -> object, cast(object)
    counts = count_any.count_module(source)
    assert count_any.count_object_source(source) == counts.object == 6
    assert count_any.count_source(source) == counts.any == 2
    assert counts.combined == 8


def test_script_prints_packages_and_total() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "count_any.py")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    header, *lines = out.splitlines()
    assert header.split()[:4] == ["package", "Any", "object", "both"]
    rows = {line.split()[0]: [int(x) for x in line.split()[1:4]] for line in lines}
    assert {"trainer", "exchange", "loss", "total"} <= set(rows)
    for column in range(3):
        assert rows["total"][column] == sum(v[column] for k, v in rows.items() if k != "total")
    assert all(any_ + obj == both for any_, obj, both in rows.values())


def test_registry_names_are_the_registries() -> None:
    # A setting that names a registry entry (`diloco.codec`, `diloco.aggregate`, `backend.kind`)
    # is `Annotated[str, OneOf(<the registry's names>)]`: one list, the registry's, which the
    # loader checks a value against (so registering an entry is the one step; ARCHITECTURE.md,
    # "Where to add").
    import typing

    from composer_replication.exchange import codecs, rules
    from composer_replication.exchange.settings import ExchangeConfig
    from composer_replication.executors import registry
    from composer_replication.fields import OneOf

    def one_of(cls: type, key: str) -> OneOf:
        hint = typing.get_type_hints(cls, include_extras=True)[key]
        base, meta = typing.get_args(hint)
        assert base is str and isinstance(meta, OneOf)
        return meta

    assert one_of(ExchangeConfig, "codec").choices() == codecs.names() == tuple(codecs._REGISTRY)
    assert one_of(ExchangeConfig, "aggregate").choices() == rules.names()
    assert rules.names() == tuple(rules._REGISTRY)
    assert codecs.CODECS == codecs.names()
    assert all(codecs.is_codec_name(name) for name in codecs.CODECS)
    assert not codecs.is_codec_name("fp16") and not codecs.is_codec_name(None)
    from composer_replication.config.schema import BackendConfig

    assert one_of(BackendConfig, "kind").choices() == registry.names() == tuple(registry.BACKENDS)


# The flags `mypy --strict` turns on that mypy does not take per module (strict itself too).
GLOBAL_ONLY = {"warn_redundant_casts", "warn_unused_configs"}
STRICT_PACKAGES = ("loss", "exchange", "diloco")


def strict_flags() -> dict[str, bool]:
    """{config option: value} for each flag `mypy --strict` enables, read from `mypy --help`
    (so a flag a new mypy adds to --strict shows up here): `--no-implicit-reexport` is
    `implicit_reexport = false`, the others `<name> = true`."""
    help_text = subprocess.run(
        [sys.executable, "-m", "mypy", "--help"], check=True, capture_output=True, text=True
    ).stdout
    block = help_text.split("--strict ", 1)[1].split("enables the following flags:", 1)[1]
    block = block.split("\n  -", 1)[0]
    names = re.findall(r"--([a-z-]+)", re.sub(r"-\s+", "-", block))
    flags: dict[str, bool] = {}
    for name in names:
        key = name.replace("-", "_")
        if key.startswith("no_"):
            flags[key[3:]] = False
        else:
            flags[key] = True
    return flags


def test_mypy_checks_loss_exchange_diloco_strictly() -> None:
    # Issue 21: `mypy composer_replication` (the one mypy run of .ci/run) checks these three
    # packages as --strict does, so a new untyped def there fails CI.
    flags = strict_flags()
    assert {"disallow_untyped_defs", "warn_return_any", "implicit_reexport"} <= set(flags)
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    for flag in GLOBAL_ONLY & set(flags):
        assert mypy.get(flag) is flags[flag], f"[tool.mypy] needs {flag} = true (--strict)"
    per_module = {k: v for k, v in flags.items() if k not in GLOBAL_ONLY}
    covered: set[str] = set()
    for override in mypy.get("overrides", []):
        modules = override["module"]
        modules = [modules] if isinstance(modules, str) else modules
        inside = [
            m
            for m in modules
            if any(m.startswith(f"composer_replication.{p}") for p in STRICT_PACKAGES)
        ]
        loosened = [k for k, v in per_module.items() if k in override and override[k] is not v]
        assert not (inside and loosened), f"an override loosens {loosened} for {inside}"
        if all(override.get(k) is v for k, v in per_module.items()):
            covered.update(modules)
    missing = [p for p in STRICT_PACKAGES if f"composer_replication.{p}.*" not in covered]
    assert missing == [], (
        f"pyproject.toml's [[tool.mypy.overrides]] lack --strict's flags {per_module} for {missing}"
    )
