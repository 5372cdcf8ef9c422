"""The one seam of the outer loop: `OuterLoopMode`, and what crosses it.

Sync DiLoCo over the object store (`sync_mode.SyncDiLoCo`), the torchft path
(`torchft_mode.TorchftDiLoCo`) and Decoupled DiLoCo (`decoupled_mode.DecoupledDiLoCo`) are each
one class behind this protocol. `mode_registry.outer_loop_mode` picks the class once from the
run's `[diloco]` section (its ``mode`` and ``manager``); the replica and the driver then call
the mode and never test which one it is:

- learner side: `OuterLoopMode.build_learner` turns a `ReplicaContext` (the replica's store,
  rank, model, keys...) into a `ReplicaLoop`: the `OuterLoop` the trainer runs inside, the
  round and step it (re)starts at, its heartbeat fields and how to close it;
- service side, where the mode has one: `build_synchronizer` (decoupled: the `Synchronizer`
  that merges the learners' pushes) and `build_lighthouse` (torchft: the lighthouse the driver
  runs for a local run);
- what the run does around it: `lockstep` (every replica ends round R at inner step R * H:
  exact resume states, a rollback on resume, a fixed number of rounds), `store_departures`
  (peers wait for each other in the store, so the driver declares a failed replica departed),
  `worker_role` (the replicas' heartbeat role), `quorum`, `elastic`, `may_finish_without`,
  `release_failed`, and `check_run`: the mode's rules across sections (raised as the run
  config's ``ValueError``, naming the key).

The mode's own rules on the `[diloco]` section are checked when it is built (a wrong
combination is a config error before any replica starts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

import torch
from torch import nn

from composer_replication.exchange.robust import AggregatePolicy, LossProbe
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.store_manager import RoundRecord

if TYPE_CHECKING:
    from transformers import TrainerCallback

__all__ = [
    "GlobalWeights",
    "Lighthouse",
    "OuterLoop",
    "OuterLoopMode",
    "ReplicaContext",
    "ReplicaLoop",
    "RunShape",
    "Screening",
    "Synchronizing",
]

GlobalWeights = Callable[[], Mapping[str, torch.Tensor]]


class Screening(Protocol):
    """How the run screens contributions to the object-store exchange (assembly/screening.py)."""

    def policy(self) -> AggregatePolicy:
        """The exchange's policy with the run's claim bounds."""
        ...

    def probe(self, global_weights: GlobalWeights) -> LossProbe | None:
        """The held-out loss probe of ``screen = "loss"`` over the outer loop's global weights
        (None for other screens)."""
        ...


class OuterLoop(Protocol):
    """What a replica trains inside: `DiLoCoOuterLoop` (sync, torchft) or `DecoupledLearner`.

    The DiLoCo callback binds and enters it in ``on_train_begin``; the reporter reads its round,
    history, global weights and outer state."""

    @property
    def bound(self) -> bool: ...

    @property
    def round(self) -> int: ...

    @property
    def history(self) -> Sequence[RoundRecord]: ...

    def bind(self, *, model: nn.Module | None = ..., optimizer: Any = ...) -> Self: ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    def record_tokens(self, n: int) -> None: ...

    def load_global_weights(self) -> None: ...

    def global_parameters(self) -> dict[str, torch.Tensor]: ...

    def outer_optimizer_state(self) -> dict[str, dict[str, object]]: ...

    def callback(self) -> TrainerCallback: ...


@dataclass(frozen=True)
class ReplicaContext:
    """What a mode needs to build one replica's outer loop.

    ``screening``: the run's screening of exchange contributions (None: the section's policy,
    without claim bounds or probe); ``keys`` / ``writer_secret`` sign or identify this rank's
    uploads; ``slot_secret`` (the run's, every rank's) derives the keys each rank uploads to; ``fence`` is checked before every write (a newer launch of the run stops this
    one)."""

    store: ObjectStore
    rank: int
    n_replicas: int
    keep_rounds: int
    model: nn.Module
    fence: Callable[[], None] | None = None
    keys: RunKeys | None = None
    writer_secret: bytes | None = None
    slot_secret: bytes | None = None
    screening: Screening | None = None


def _no_op() -> None:
    return None


@dataclass
class ReplicaLoop:
    """One replica's side of the outer loop, as its mode built it.

    ``start_round`` / ``start_step``: where a (re)launched replica continues (0 on a fresh run);
    ``heartbeat``: the fields of its heartbeat besides its state; ``close``: release what the
    mode opened (connections, threads), called once when the replica ends."""

    outer: OuterLoop
    start_round: int
    start_step: int
    heartbeat: Callable[[], dict[str, object]]
    close: Callable[[], None] = field(default=_no_op)


@dataclass(frozen=True)
class RunShape:
    """What a mode's cross-section rules need to know of the rest of the run."""

    n_replicas: int
    backend: str
    local_backend: bool
    signed: bool
    model_blocks: int | None  # transformer blocks of a model built locally; None = unknown


class SynchronizerStats(Protocol):
    def as_dict(self) -> dict[str, object]: ...


class Synchronizing(Protocol):
    """The service side of a mode with a synchronizer (`diloco.synchronizer.Synchronizer`):
    `run` merges until the run is final (True) or `stop` is called (False)."""

    @property
    def owner(self) -> str: ...

    @property
    def versions(self) -> list[int]: ...

    @property
    def stats(self) -> SynchronizerStats: ...

    def run(self) -> bool: ...

    def stop(self) -> None: ...


class Lighthouse(Protocol):
    """A torchft lighthouse the driver runs for the run's lifetime."""

    @property
    def env(self) -> Mapping[str, str]:
        """What the replicas' environment needs to dial it."""
        ...

    def shutdown(self) -> None: ...


class OuterLoopMode(Protocol):
    """One way of running the outer loop (see the module docstring)."""

    @property
    def worker_role(self) -> str:
        """The heartbeat role of the run's replicas ("replica", decoupled: "learner")."""
        ...

    @property
    def lockstep(self) -> bool:
        """Every replica ends round R at inner step R * H (exact resume, fixed rounds)."""
        ...

    @property
    def store_departures(self) -> bool:
        """Peers wait for each other in the store: a failed replica is declared departed."""
        ...

    @property
    def has_synchronizer(self) -> bool:
        """A synchronizer merges the replicas' work (its heartbeat counts to the run's health)."""
        ...

    @property
    def driver_synchronizer(self) -> bool:
        """The driver runs the synchronizer beside itself."""
        ...

    def check_run(self, run: RunShape) -> None:
        """``ValueError`` naming the key when the rest of the run contradicts this mode."""
        ...

    def quorum(self, n_replicas: int) -> int:
        """Replicas the run needs alive to make progress."""
        ...

    def elastic(self, n_replicas: int) -> bool:
        """A replica's failure does not stop the others at once."""
        ...

    def may_finish_without(self, survivors: int, n_replicas: int) -> bool:
        """The run counts as finished with only ``survivors`` replicas having completed."""
        ...

    def build_learner(self, ctx: ReplicaContext) -> ReplicaLoop:
        """This replica's outer loop (learner side)."""
        ...

    def build_synchronizer(
        self, store: ObjectStore, *, keep_rounds: int, max_steps: int, keys: RunKeys | None = None
    ) -> Synchronizing | None:
        """The service that merges the replicas' work, if the mode has one (``keys``: its
        signing keys in a signed run)."""
        ...

    def build_lighthouse(self, n_replicas: int) -> Lighthouse | None:
        """A lighthouse for the driver to run (on 127.0.0.1), if the mode needs one there."""
        ...

    def release_failed(
        self,
        store: ObjectStore,
        failed: Mapping[int, str],
        max_steps: int,
        keys: RunKeys | None = None,
    ) -> None:
        """Replicas that failed for good (rank -> why) will not come back: let the service stop
        waiting for them (``keys``: the driver's signing keys in a signed run)."""
        ...
