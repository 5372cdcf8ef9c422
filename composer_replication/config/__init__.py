"""Typed run configuration: schema (frozen dataclasses), TOML loading, command-line overrides.

Names load lazily: `composer_replication.config.errors` (and so the CLI's `--help`) stays cheap,
while the schema imports the loss library (torch) to take the loss keys' defaults from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_replication.lazy import lazy_getattr

if TYPE_CHECKING:
    from composer_replication.config.errors import ConfigError
    from composer_replication.config.loader import (
        apply_overrides,
        config_from_json,
        default_toml_text,
        dump_toml,
        from_dict,
        load_config,
        parse_override,
        to_dict,
    )
    from composer_replication.config.schema import RunConfig

_LAZY = {
    "ConfigError": "composer_replication.config.errors",
    "RunConfig": "composer_replication.config.schema",
    "apply_overrides": "composer_replication.config.loader",
    "config_from_json": "composer_replication.config.loader",
    "default_toml_text": "composer_replication.config.loader",
    "dump_toml": "composer_replication.config.loader",
    "from_dict": "composer_replication.config.loader",
    "load_config": "composer_replication.config.loader",
    "parse_override": "composer_replication.config.loader",
    "to_dict": "composer_replication.config.loader",
}

__all__ = [
    "ConfigError",
    "RunConfig",
    "apply_overrides",
    "config_from_json",
    "default_toml_text",
    "dump_toml",
    "from_dict",
    "load_config",
    "parse_override",
    "to_dict",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
