"""Orchestration of a training run: run folder, driver, metrics, progress, report, status.

The CLI (`composer_replication.cli`) sits on top of this package; the replicas use only
`metrics`, `checkpoint` and `reporter` (and the store client `exchange.store`). Nothing heavy
is imported here.
"""

from composer_replication.run.folder import RunFolder, default_run_name

__all__ = ["RunFolder", "default_run_name"]
