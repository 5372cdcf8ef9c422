"""Typed run configuration: schema (frozen dataclasses), TOML loading, command-line overrides."""

from composer_replication.config.loader import (
    ConfigError,
    apply_overrides,
    config_from_json,
    default_toml_text,
    dump_toml,
    from_dict,
    load_config,
    parse_override,
    to_dict,
)
from composer_replication.config.schema import BACKENDS, RunConfig

__all__ = [
    "BACKENDS",
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
