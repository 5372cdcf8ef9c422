"""`ComposeKwargs` (the ``**kwargs`` type of the compose functions) states `ComposeConfig`'s
fields: the same names with the same types, so a setting added to one and not the other fails."""

from __future__ import annotations

import typing

from composer_replication.loss._config import ComposeConfig, ComposeKwargs


def test_compose_kwargs_are_the_config_fields() -> None:
    # resolved types on both sides: a field's `type` may be a string or, once the config loader
    # has resolved it in this process, the type itself
    fields = typing.get_type_hints(ComposeConfig)
    keys = typing.get_type_hints(ComposeKwargs)
    assert keys == fields
    assert not ComposeKwargs.__required_keys__  # every keyword has its default


def test_a_field_missing_from_the_kwargs_is_seen() -> None:
    fields = typing.get_type_hints(ComposeConfig)
    keys = dict(typing.get_type_hints(ComposeKwargs))
    keys.pop(next(iter(keys)))
    assert keys != fields
