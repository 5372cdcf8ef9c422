"""The object-store exchange: replicas that meet only through s3:// / gs:// / file:// / memory://.

The only fsspec client of the package (`store`), the wire format and codecs of pseudo-gradients,
the commit protocol, the published global state, `ObjectStoreAllReduce` and
`ObjectStoreManager` (the torchft Manager surface that `torchft.local_sgd.DiLoCo` drives).
Knows nothing of losses, trainers, tasks, models, configs or runs (ARCHITECTURE.md).

Names load lazily so that importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ObjectStore": "composer_replication.exchange.store",
    "normalize_uri": "composer_replication.exchange.store",
    "ObjectStoreAllReduce": "composer_replication.exchange.allreduce",
    "ObjectStoreManager": "composer_replication.exchange.manager",
    "MockManager": "composer_replication.exchange.manager",
    "CODECS": "composer_replication.exchange.codecs",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'composer_replication.exchange' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
