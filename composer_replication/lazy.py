"""Lazy re-exports for package ``__init__`` modules (one implementation for every package).

A package lists ``{"Name": "composer_replication.x.module"}`` and assigns
``__getattr__ = lazy_getattr(__name__, TABLE)``: ``import composer_replication.x`` then imports
nothing heavy, and ``composer_replication.x.Name`` imports its module on first use (PEP 562).
A value naming a module itself (``{"replica_entrypoint": "composer_replication.run.replica"}``
with ``modules=...``) returns that module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(
    package: str, names: Mapping[str, str], modules: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` resolving ``names`` (attribute -> module) lazily."""
    module_names = dict(modules or {})

    def __getattr__(name: str) -> Any:
        if name in module_names:
            return importlib.import_module(module_names[name])
        module_name = names.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module_name), name)

    return __getattr__
