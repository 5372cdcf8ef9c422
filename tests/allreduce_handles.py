"""`exchange`: an `ObjectStoreAllReduce` whose `AllReduceConfig` fields may be given as
keywords, for the tests' helpers that forward a mix of settings and collaborators."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.settings import AllReduceConfig
from composer_replication.exchange.store import Store

CONFIG_KEYS = frozenset(f.name for f in fields(AllReduceConfig))


def exchange(
    store: str | Store, world_size: int = 1, rank: int | None = None, **kw: Any
) -> ObjectStoreAllReduce:
    """``ObjectStoreAllReduce(store, world_size, rank, config=AllReduceConfig(<its keys of
    kw>), <the rest of kw>)``."""
    config = AllReduceConfig(**{k: kw.pop(k) for k in list(kw) if k in CONFIG_KEYS})
    return ObjectStoreAllReduce(store, world_size, rank, config=config, **kw)
