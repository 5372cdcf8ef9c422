"""The `Manager` protocol: what the DiLoCo outer loop needs from whoever averages across replicas.

Two halves:

- the surface of ``torchft.Manager`` that ``torchft.local_sgd.DiLoCo`` (torchft 0.2.0, pinned)
  drives: ``_use_async_quorum`` (torchft's own attribute name, which DiLoCo reads; it must be
  False), ``register_state_dict_fn``, ``allow/disallow_state_dict_read`` (around every inner
  optimizer step), ``start_quorum``, ``current_step``, ``allreduce`` (in-place average, returns
  a ``Work``) and ``should_commit``;
- the outer loop's hooks: ``add_heal_hook`` (called in the round in which a heal replaced this
  replica's global state, before that round's outer step: the outer loop copies the global
  weights into the model),
  ``initial_sync`` (make every replica start from the run's global state; returns the round it
  resumes at), ``record_inner_step`` / ``record_tokens`` (what this round trained),
  ``publish_if_due`` (publish the outer state when a committed round calls for it), ``drain``
  (end of training: finish in-flight work and publish a due state; the manager stays usable),
  ``history`` (one `RoundRecord` per round) and ``close`` (release connections and threads;
  called by whoever built the manager, not by the outer loop).

Implementations: `composer_replication.exchange.ObjectStoreManager` (replicas that meet only in an
object store; it satisfies the protocol structurally, the exchange does not import this
package) and `composer_replication.diloco.torchft.torchft_path.TorchFTManager` (a real torchft Manager
and lighthouse). mypy checks both against the protocol (each proof sits beside what it proves
and imports this module, never the other way round: no import circle).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from composer_replication.exchange.outer_state import LoadStateFn, SaveStateFn
from composer_replication.exchange.store_manager import RoundRecord

__all__ = ["DiLoCoSurface", "Manager", "RoundRecord"]


class DiLoCoSurface(Protocol):
    """The part of ``torchft.Manager`` that ``torchft.local_sgd.DiLoCo`` calls."""

    _use_async_quorum: bool

    def register_state_dict_fn(
        self, key: str, load_state_dict: LoadStateFn, state_dict: SaveStateFn
    ) -> None: ...

    def allow_state_dict_read(self) -> None: ...

    def disallow_state_dict_read(self) -> None: ...

    def start_quorum(
        self, allow_heal: bool = ..., shrink_only: bool = ..., timeout: timedelta | None = ...
    ) -> None: ...

    def current_step(self) -> int: ...

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = ...) -> dist.Work: ...

    def should_commit(self, timeout: timedelta | None = ...) -> bool: ...


class Manager(DiLoCoSurface, Protocol):
    """What the outer loop needs: DiLoCo's surface plus its hooks (see the module docstring)."""

    def add_heal_hook(self, fn: Callable[[], None]) -> None: ...

    def initial_sync(self, named_parameters: Mapping[str, torch.Tensor]) -> int: ...

    def record_inner_step(self) -> None: ...

    def record_tokens(self, n: int) -> None: ...

    def publish_if_due(self) -> bool: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...

    @property
    def history(self) -> Sequence[RoundRecord]: ...


if TYPE_CHECKING:  # mypy proves that the object-store implementation satisfies the protocol
    from composer_replication.exchange.store_manager import ObjectStoreManager

    def _implementation(a: ObjectStoreManager) -> Manager:
        return a  # (torchft_path.py holds the same proof for TorchFTManager)
