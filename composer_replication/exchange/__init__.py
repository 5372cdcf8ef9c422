"""The object-store exchange: replicas that meet only through s3:// / gs:// / file:// / memory://.

The only fsspec client of the package (`store`), the wire format and codecs of pseudo-gradients,
the commit protocol, the published global state, `ObjectStoreAllReduce` and
`ObjectStoreManager` (the torchft Manager surface that `torchft.local_sgd.DiLoCo` drives).
Knows nothing of losses, trainers, tasks, models, configs or runs (ARCHITECTURE.md).

Names load lazily so that importing this package stays cheap.
"""

from __future__ import annotations

from composer_replication.lazy import lazy_getattr

EXPORTS = {
    "ObjectStore": "composer_replication.exchange.store",
    "normalize_uri": "composer_replication.exchange.store",
    "AllReduceConfig": "composer_replication.exchange.settings",
    "ObjectStoreAllReduce": "composer_replication.exchange.allreduce",
    "ObjectStoreManager": "composer_replication.exchange.store_manager",
    "MockManager": "composer_replication.exchange.store_manager",
    "CODECS": "composer_replication.exchange.codecs",
}

__all__ = sorted(EXPORTS)


__getattr__ = lazy_getattr(__name__, EXPORTS)
