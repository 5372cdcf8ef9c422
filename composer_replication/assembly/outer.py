"""Build the outer loop's parts from the run config: the mode, a replica's learner side, the
synchronizer and the lighthouse.

- `outer_loop_mode(config)`: the `OuterLoopMode` that `[diloco] mode` / `manager` name (the
  registry in diloco/mode_registry.py picks it once; run/ asks it what to do);
- `build_outer_loop(config, rank, store, model, tokenizer, task, ...)`: replica ``rank``'s
  `ReplicaLoop`, with this run's screening of exchange contributions
  (`screening.RunScreening`), its signing keys or writer secret and its fence;
- `build_synchronizer(config, store, keys=)`: the decoupled run's `Synchronizer` (what
  `composer-replication synchronizer` runs);
- `build_lighthouse(config)`: the torchft lighthouse the driver runs for a local run, or None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from composer_replication.assembly.screening import RunScreening
from composer_replication.diloco.mode_protocol import (
    Lighthouse,
    OuterLoopMode,
    ReplicaContext,
    ReplicaLoop,
    Synchronizing,
)
from composer_replication.diloco.mode_registry import outer_loop_mode as _mode_of
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.store import ObjectStore

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from composer_replication.config import RunConfig
    from composer_replication.tasks import Task

__all__ = ["build_lighthouse", "build_outer_loop", "build_synchronizer", "outer_loop_mode"]


def outer_loop_mode(config: RunConfig) -> OuterLoopMode:
    """The run's `OuterLoopMode` (`[diloco] mode` and `manager`)."""
    return _mode_of(config.diloco)


def build_outer_loop(
    config: RunConfig,
    rank: int,
    store: ObjectStore,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    *,
    keys: RunKeys | None = None,
    writer_secret: bytes | None = None,
    fence: Callable[[], None] | None = None,
    slot_secret: bytes | None = None,
) -> ReplicaLoop:
    """Replica ``rank``'s side of the outer loop (see the module docstring)."""
    ctx = ReplicaContext(
        store=store,
        rank=rank,
        n_replicas=config.backend.n_replicas,
        keep_rounds=config.store.keep_rounds,
        model=model,
        fence=fence,
        keys=keys,
        writer_secret=writer_secret,
        slot_secret=slot_secret,
        screening=RunScreening(config, model, tokenizer, task),
    )
    return outer_loop_mode(config).build_learner(ctx)


def build_synchronizer(
    config: RunConfig, store: ObjectStore, *, keys: RunKeys | None = None
) -> Synchronizing:
    """The run's synchronizer (ValueError when its mode has none); ``keys``: its signing keys
    (a signed run)."""
    synchronizer = outer_loop_mode(config).build_synchronizer(
        store, keep_rounds=config.store.keep_rounds, max_steps=config.train.max_steps, keys=keys
    )
    if synchronizer is None:
        raise ValueError(
            f"run {config.run.name!r} has diloco.mode = {config.diloco.mode!r}; only decoupled "
            "runs have a synchronizer"
        )
    return synchronizer


def build_lighthouse(config: RunConfig) -> Lighthouse | None:
    """The lighthouse the driver runs for the run's lifetime (torchft without
    ``diloco.lighthouse``), or None."""
    return outer_loop_mode(config).build_lighthouse(config.backend.n_replicas)
