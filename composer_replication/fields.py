"""The helpers every component config uses: a documented setting, a checked rule, a composed part.

A component's config is a frozen dataclass beside the component (torchtitan's way); the run
schema (`config/schema.py`) composes them into the TOML sections. Each field is a `setting`:
its default and its ``metadata["help"]``, from which the config reference in docs/cli.md is
generated. `require` raises the ``ValueError`` a config's ``__post_init__`` raises, worded
``"<key>: <what is wrong>"`` with the key exactly as the user writes it in the TOML section
(the loader prefixes the section: ``diloco.outer_lr: must be > 0``). A setting that names
one entry of a registry is annotated ``Annotated[str, OneOf(names, what)]``: the loader checks
the value against the registry's names when it reads the TOML (with a did-you-mean), so a name
added to the registry is a valid value without a second list.

A section composes its components' configs as fields, not as base classes: ``component(cls)``
is such a field, whose keys the TOML writes flat in the section (``[diloco] outer_lr``, held by
``DilocoConfig.outer``). The loader (`config/loader.py`) reads that marker, `FLATTEN`, in one
place: loading, `to_dict`, the TOML dump, the did-you-mean and the docs/cli.md reference all go
through its `section_keys`.

Imports nothing of ours, like `lazy`: every layer may use it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["FLATTEN", "OneOf", "component", "require", "setting"]

FLATTEN = "flatten"

T = TypeVar("T")


@dataclass(frozen=True)
class OneOf:
    """``Annotated[str, OneOf(names, what)]``: a string that ``names()`` lists (a registry's
    names, read when the value is checked); ``what`` says what it names, for messages."""

    names: Callable[[], Iterable[str]]
    what: str

    def choices(self) -> tuple[str, ...]:
        return tuple(self.names())


def setting(default: T, help: str) -> T:
    """A dataclass field with a default and a help string (dicts/lists get a factory)."""
    if isinstance(default, dict | list):
        return field(default_factory=lambda: copy.copy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def component(cls: Callable[[], T]) -> T:
    """A field holding a component's config (``cls()`` by default) whose keys sit flat in the
    section that composes it: the TOML writes ``outer_lr``, not ``outer.outer_lr``."""
    return field(default_factory=cls, metadata={FLATTEN: True})


def require(cond: bool, key: str, message: str) -> None:
    """``ValueError("<key>: <message>")`` unless ``cond``."""
    if not cond:
        raise ValueError(f"{key}: {message}")
