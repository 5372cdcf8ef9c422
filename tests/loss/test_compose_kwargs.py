"""`ComposeKwargs` (the ``**kwargs`` type of the compose functions) states `ComposeConfig`'s
fields: the same names with the same types, so a setting added to one and not the other fails."""

from __future__ import annotations

import dataclasses

from composer_replication.loss._config import ComposeConfig, ComposeKwargs


def test_compose_kwargs_are_the_config_fields() -> None:
    fields = {f.name: f.type for f in dataclasses.fields(ComposeConfig)}
    keys = {k: getattr(v, "__forward_arg__", v) for k, v in ComposeKwargs.__annotations__.items()}
    assert keys == fields
    assert not ComposeKwargs.__required_keys__  # every keyword has its default
