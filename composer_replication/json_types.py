"""The type of a JSON document, written once: what `json.loads` returns and `json.dumps` takes.

``JSONValue`` is recursive (a scalar, a list of values, an object of values), so a record read
from disk or the store is typed without `Any` or `object`: a reader narrows a value with
``isinstance`` before it uses it, as it must for untrusted input anyway. A record of fixed
shape is a TypedDict beside its writer; this alias is for the documents whose keys vary
(metrics rows, status rows, SDK payloads). The `as_*` helpers narrow one field of such a
document the way its readers do (a missing field is its default).

Imports nothing of ours, like `lazy` and `fields`: every layer may use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

__all__ = [
    "JSONDict",
    "JSONScalar",
    "JSONValue",
    "as_dict",
    "as_float",
    "as_int",
    "as_list",
    "as_number",
]

JSONScalar: TypeAlias = str | int | float | bool | None
# Read-only containers inside a value, so that a `list[int]` or a `dict[str, str]` is a value
# (a `list[JSONValue]` is not, lists being invariant); `json.loads` gives lists and dicts, which
# a reader narrows with `isinstance(v, list)` / `isinstance(v, dict)` (or `as_list`, `as_dict`).
JSONValue: TypeAlias = JSONScalar | Sequence["JSONValue"] | Mapping[str, "JSONValue"]
JSONDict: TypeAlias = dict[str, JSONValue]  # one document: a JSON object


def as_dict(value: JSONValue) -> JSONDict:
    """``value`` when it is a JSON object, else ``{}`` (a missing or malformed field)."""
    return value if isinstance(value, dict) else {}


def as_list(value: JSONValue) -> list[JSONValue]:
    """``value`` when it is a JSON array, else ``[]`` (a missing or malformed field)."""
    return value if isinstance(value, list) else []


def as_number(value: JSONValue) -> float | None:
    """``value`` as a float when it is a JSON number (not a bool), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def as_int(value: JSONValue, default: int = 0) -> int:
    """``int(value)`` of a scalar, as a reader of a record writes it; ``default`` for a missing
    (None) value; an array or an object raises ``TypeError`` as ``int()`` does."""
    if value is None:
        return default
    if isinstance(value, str | int | float):
        return int(value)
    raise TypeError(f"expected a number, got a JSON {type(value).__name__}")


def as_float(value: JSONValue, default: float = 0.0) -> float:
    """``float(value)`` of a scalar; ``default`` for a missing (None) value; an array or an
    object raises ``TypeError`` as ``float()`` does."""
    if value is None:
        return default
    if isinstance(value, str | int | float):
        return float(value)
    raise TypeError(f"expected a number, got a JSON {type(value).__name__}")
