"""Load, override, check and print the run configuration.

- `load_config(path=None, overrides=())`: the embedded default (`default.toml`) when `path` is
  None, else that TOML file on top of the schema defaults; then `section.key=value` overrides.
- Unknown sections/keys and wrong types raise `ConfigError` with the key path and a hint
  (did-you-mean for misspellings, the allowed values for a choice).
- Every float setting must be finite: `inf`, `-inf` and `nan` are refused here, once, for every
  key the schema types as float (`train`, `--resume` and `config validate` all load through
  `from_dict`), so no section has to remember it.
- A section composes its components' configs as fields marked `fields.component`; their keys
  are the section's own in the TOML (``[diloco] outer_lr``, held by ``DilocoConfig.outer``).
  `section_keys` states that flattening once, and loading, `to_dict`, `dump_toml`, the
  did-you-mean and the docs/cli.md reference read the keys through it.
- `to_dict` / `from_dict` round-trip a `RunConfig` through plain JSON-able dicts (the driver
  sends the resolved config to the replicas as JSON through the store); `dump_toml` writes the
  resolved TOML kept in every run folder.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.resources
import json
import math
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, overload

from composer_replication.config.errors import ConfigError
from composer_replication.config.schema import RENAMED_KEYS, RunConfig
from composer_replication.fields import FLATTEN, OneOf

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "ConfigError",
    "apply_overrides",
    "default_toml_text",
    "dump_toml",
    "from_dict",
    "load_config",
    "parse_override",
    "section_keys",
    "section_values",
    "to_dict",
    "toml_value",
    "type_name",
]

T = TypeVar("T")


class _Unset:
    """An override written as `key=none`: unset an optional key (or the string "none")."""

    def __repr__(self) -> str:
        return "none"


UNSET = _Unset()


# ----------------------------------------------------------------------------- types


def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls, include_extras=True)


def _one_of(tp: object) -> tuple[object, OneOf | None]:
    """(the annotation under an ``Annotated[..., OneOf(...)]``, the OneOf) or (tp, None)."""
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        return base, next((m for m in meta if isinstance(m, OneOf)), None)
    return tp, None


def type_name(tp: object) -> str:
    """How a schema annotation reads in messages and docs: 'int', 'float or unset', ..."""
    base, one_of = _one_of(tp)
    if one_of is not None:  # a registry's names: the registry's own docs list them
        return f"str: {one_of.what}"
    origin = typing.get_origin(base)
    tp = base
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return f"list of {type_name(inner)}"
    if origin is dict:
        return "table"
    if tp is type(None):
        return "unset"
    if dataclasses.is_dataclass(tp):
        return "table"
    return getattr(tp, "__name__", str(tp))


@dataclasses.dataclass(frozen=True)
class Key:
    """Where one TOML key of a section lives: the attributes leading from the section to the
    component that holds it (``("outer",)`` for ``diloco.outer_lr``; ``()`` for the section's
    own) and that component's class, whose field of the key's name declares it."""

    path: tuple[str, ...]
    owner: type


def section_keys(cls: type) -> dict[str, Key]:
    """The keys of section ``cls`` as the TOML writes them, in order: its own fields, and in
    place of a `fields.component` field the component's keys (recursively)."""
    out: dict[str, Key] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.metadata.get(FLATTEN):
            inner = section_keys(typing.cast(type, hints[f.name])).items()
            keys = {name: Key((f.name, *key.path), key.owner) for name, key in inner}
        else:
            keys = {f.name: Key((), cls)}
        for name in keys:
            if name in out:
                raise TypeError(f"{cls.__name__}: two components hold the key {name!r}")
        out.update(keys)
    return out


def section_values(obj: DataclassInstance) -> dict[str, object]:
    """The values of a section's TOML keys (`section_keys`), read off its components."""
    out = {}
    for name, key in section_keys(type(obj)).items():
        holder = obj
        for attr in key.path:
            holder = getattr(holder, attr)
        out[name] = getattr(holder, name)
    return out


def _build(
    cls: type[T], groups: dict[tuple[str, ...], dict[str, object]], at: tuple[str, ...]
) -> T:
    """``cls`` from the values grouped by the component that holds them (`Key.path`), those at
    ``at`` its own; a component none of whose keys is given keeps its default."""
    hints = _hints(cls)
    kwargs = dict(groups.get(at, {}))
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        path = (*at, f.name)
        if f.metadata.get(FLATTEN) and any(g[: len(path)] == path for g in groups):
            kwargs[f.name] = _build(typing.cast(type, hints[f.name]), groups, path)
    return cls(**kwargs)


def _did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _section_keys() -> dict[str, list[str]]:
    """Every key of the run schema, by the name it has in its section: key -> ["section.key"]."""
    out: dict[str, list[str]] = {}
    hints = _hints(RunConfig)
    for section in dataclasses.fields(RunConfig):
        tp = hints[section.name]
        if dataclasses.is_dataclass(tp):
            for name in section_keys(typing.cast(type, tp)):
                out.setdefault(name, []).append(f"{section.name}.{name}")
    return out


def _moved(key: str, prefix: str) -> str:
    """A did-you-mean for a key written in the wrong section (``diloco.keep_rounds``: it is
    ``store.keep_rounds``) or under a name it does not have in the TOML (a component's former
    argument name, `RENAMED_KEYS`); "" when neither applies."""
    section = prefix.split("[")[0]
    if not section or "." in section:
        return ""
    if key in RENAMED_KEYS and RENAMED_KEYS[key] != f"{section}.{key}":
        return f" (did you mean {RENAMED_KEYS[key]!r}? the key has that name in the TOML)"
    elsewhere = [k for k in _section_keys().get(key, []) if not k.startswith(section + ".")]
    if elsewhere:
        return f" (did you mean {elsewhere[0]!r}? that section holds it)"
    return ""


def _convert(value: object, tp: object, key: str) -> object:
    """Check `value` against annotation `tp`; return it (ints widened to float where declared)."""
    tp, one_of = _one_of(tp)
    if one_of is not None:
        value = _convert(value, tp, key)
        choices = one_of.choices()
        if value in choices:
            return value
        hint = _did_you_mean(value, choices) if isinstance(value, str) else ""
        raise ConfigError(
            f"{key}: {_show(value)} is not one of {', '.join(repr(c) for c in choices)}{hint}"
        )
    origin = typing.get_origin(tp)
    if value is UNSET:
        args = typing.get_args(tp)
        if type(None) in args:
            return None
        if tp is str or (origin is Literal and "none" in args):
            return "none"
        raise ConfigError(f"{key}: cannot be unset (expected {type_name(tp)})")
    if tp is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:  # `float | None` and the like: the one type's own message
            raise errors[0]
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {_show(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return value
        hint = _did_you_mean(value, [str(c) for c in choices]) if isinstance(value, str) else ""
        raise ConfigError(
            f"{key}: {_show(value)} is not one of {', '.join(repr(c) for c in choices)}{hint}"
        )
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a table, got {_show(value)}")
        return from_dict(tp, value, prefix=key)  # type: ignore[arg-type]
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {type_name(tp)}, got {_show(value)}")
        (inner,) = typing.get_args(tp)
        return [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a table, got {_show(value)}")
        _, vt = typing.get_args(tp)
        return {str(k): _convert(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {_show(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {_show(value)}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
            if not math.isfinite(number):
                raise ConfigError(
                    f"{key}: {number!r} is not a finite number (inf, -inf and nan are refused); "
                    "give a finite value"
                )
            return number
        raise ConfigError(f"{key}: expected a number, got {_show(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {_show(value)} (quote it)")
    raise TypeError(f"unsupported annotation {tp!r} at {key}")  # a schema bug, not user input


def _show(value: object) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(type(value))
    if kind is None:
        kind = "table" if isinstance(value, Mapping) else type(value).__name__
    text = repr(value)
    return f"{kind} {text[:60]}"


def from_dict(cls: type[T], data: Mapping[str, object], *, prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    fields = section_keys(cls)
    hints = {key.owner: _hints(key.owner) for key in fields.values()}
    groups: dict[tuple[str, ...], dict[str, object]] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            what = f"unknown key in section [{prefix}]" if prefix else "unknown section"
            hint = _did_you_mean(str(key), fields) or _moved(str(key), prefix)
            raise ConfigError(f"{path}: {what}{hint}; known: {', '.join(fields)}")
        value = _convert(value, hints[fields[key].owner][key], path)
        groups.setdefault(fields[key].path, {})[key] = value
    try:
        return _build(cls, groups, ())
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        message = str(exc)
        # A component's config names its key as the section holds it ("outer_lr: ..."): give
        # the full path ("diloco.outer_lr: ..."); a message naming no key of the section gets
        # the section's path in front.
        key = message.partition(":")[0]
        if prefix and key in fields:
            message = f"{prefix}.{message}"
        elif prefix and not message.startswith(prefix.split("[")[0]):
            message = f"{prefix}: {message}"
        raise ConfigError(message) from None


@overload
def to_dict(obj: DataclassInstance) -> dict[str, object]: ...
@overload
def to_dict(obj: object) -> object: ...
def to_dict(obj: object) -> object:
    """A plain nested dict/list of a config dataclass (None values dropped, as TOML has no null)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for name, raw in section_values(obj).items():
            value = to_dict(raw)
            if value is not None:
                out[name] = value
        return out
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[list[str], object]:
    """'section.key=value' -> (['section', 'key'], value).

    The value is read as a TOML value (numbers, true/false, quoted strings, [lists], {tables});
    anything that is not valid TOML is taken as a bare string, and `none`/`null` unset an
    optional key.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"override {text!r}: expected section.key=value (e.g. train.max_steps=20)"
        )
    parts = key.split(".")
    if any(not p for p in parts) or len(parts) < 2:
        raise ConfigError(
            f"override {text!r}: the key must be section.key (e.g. backend.n_replicas=4)"
        )
    raw = raw.strip()
    if raw.lower() in ("none", "null"):
        return parts, UNSET
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts, value


def _set_path(tree: dict[str, object], parts: list[str], value: object, text: str) -> None:
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override {text!r}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(tree: dict[str, object], overrides: Iterable[str]) -> dict[str, object]:
    """Apply 'section.key=value' strings to a raw config tree (a deep copy is returned)."""
    out = copy.deepcopy(tree)
    for text in overrides:
        parts, value = parse_override(text)
        _set_path(out, parts, value, text)
    return out


# ----------------------------------------------------------------------------- loading


def default_toml_text() -> str:
    """The embedded default configuration (packaged `default.toml`)."""
    return (
        importlib.resources.files("composer_replication.config")
        .joinpath("default.toml")
        .read_text(encoding="utf-8")
    )


def _read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file") from None


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """The resolved RunConfig: default.toml or `path`, then the overrides; ConfigError if bad."""
    tree = tomllib.loads(default_toml_text()) if path is None else _read_toml(path)
    overrides = list(overrides)
    before = tree.get("task", {}).get("name") if isinstance(tree.get("task"), dict) else None
    tree = apply_overrides(tree, overrides)
    task = tree.get("task")
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    if (
        isinstance(task, dict)
        and task.get("name") != before
        and not any(k == "task.options" or k.startswith("task.options.") for k in keys)
    ):
        # task.options belong to the task they were written for: an override that switches
        # task.name (without new options) drops them, e.g. the default's arithmetic options
        # under `task.name=strings`.
        task.pop("options", None)
    return from_dict(RunConfig, tree)


def config_from_json(text: str) -> RunConfig:
    """The RunConfig the driver stored as JSON (`to_dict` output)."""
    return from_dict(RunConfig, json.loads(text))


# ----------------------------------------------------------------------------- TOML output


def toml_value(value: object) -> str:
    """A plain value (to_dict output) as TOML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        inner = ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return "{" + (f" {inner} " if inner else "") + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _toml_key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else json.dumps(key)


def dump_toml(config: RunConfig) -> str:
    """TOML text of a resolved config; `load_config(that file)` gives the same config back.

    Unset optional keys are written as comments, so the file still lists every key.
    """
    lines: list[str] = []
    for section in dataclasses.fields(config):
        obj = getattr(config, section.name)
        lines.append(f"[{section.name}]")
        tables: list[tuple[str, list[DataclassInstance]]] = []
        for name, value in section_values(obj).items():
            if value is None:
                lines.append(f"# {name} = (unset)")
            elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
                tables.append((name, value))
            else:
                lines.append(f"{name} = {toml_value(to_dict(value))}")
        for name, items in tables:
            for item in items:
                lines.append("")
                lines.append(f"[[{section.name}.{name}]]")
                for key, val in to_dict(item).items():
                    lines.append(f"{key} = {toml_value(val)}")
        lines.append("")
    return "\n".join(lines)
