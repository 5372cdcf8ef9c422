"""The one seam of the outer loop: `OuterLoopMode`, and what crosses it.

Sync DiLoCo over the object store (`sync_mode.SyncDiLoCo`), the torchft path
(`torchft_mode.TorchftDiLoCo`) and Decoupled DiLoCo (`decoupled_mode.DecoupledDiLoCo`) are each
one class behind this protocol. `mode_registry.outer_loop_mode` picks the class once from the
run's `[diloco]` section (its ``mode`` and ``manager``); the replica, the driver and `status`
then call the mode's hooks and never ask which mode it is (tests/test_architecture.py keeps
run/ free of such questions):

- learner side: `OuterLoopMode.build_learner` turns a `ReplicaContext` (the replica's store,
  rank, model, keys...) into a `ReplicaLoop`: the `OuterLoop` the trainer runs inside, where it
  (re)starts and from which resume state (`ReplicaLoop.resume`), the trainer callback that
  saves its resume states (`state_writer`), its heartbeat fields and how to close it;
- service side, where the mode has one: `build_synchronizer` (decoupled: the `Synchronizer`
  that merges the learners' pushes), `driver_service` (the process the driver hosts for it:
  what to run, under which signing identity) and `build_lighthouse` (torchft: the lighthouse
  the driver runs for a local run);
- the driver's resume (`rollback_for_resume`; `status`: `resume_plan`), supervision
  (`departure_roles`, `departure_effect`, `after_loss`, `may_finish_without`, `release_failed`,
  `refusal_sources`, the roles of its services' heartbeats in `service_roles` and their status
  rows, `service_status`), its checks once
  the run ended (`end_of_run_problem`, and after a chaos run `check_chaos`), the run's length in
  rounds (`n_rounds`, what the progress display counts) and `check_run`: the mode's rules
  across sections (raised as the run config's ``ValueError``, naming the key).

Each hook takes only what the mode cannot know from its own `[diloco]` section (the store, the
number of replicas, the run's length): the mode is handed its own config and nothing else.
The mode's own rules on the `[diloco]` section are checked when it is built (a wrong
combination is a config error before any replica starts).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self

import torch
from torch import nn

from composer_replication.diloco.replica_state import ResumableTrainer
from composer_replication.exchange.contribution_screening import AggregatePolicy, LossProbe
from composer_replication.exchange.liveness import MemberLiveness
from composer_replication.exchange.push_store import Refusal
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.store_manager import RoundRecord
from composer_replication.json_types import JSONDict, JSONValue

if TYPE_CHECKING:
    from transformers import TrainerCallback

__all__ = [
    "AfterLoss",
    "GlobalWeights",
    "HostedService",
    "Lighthouse",
    "OuterLoop",
    "OuterLoopMode",
    "RefusalSource",
    "ReplicaContext",
    "ReplicaLoop",
    "ReplicaStart",
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


def _no_fields() -> JSONDict:
    return {}


@dataclass(frozen=True)
class ReplicaStart:
    """Where a replica's training continues: ``state``, its resume state (the trainer's and
    the mode's; None: fresh inner state), at inner step ``step``; ``fields``: what the "start"
    event says of it (the state's key, or why there is none)."""

    state: dict[str, object] | None
    step: int
    fields: dict[str, str | int] = field(default_factory=dict)


@dataclass
class ReplicaLoop:
    """One replica's side of the outer loop, as its mode built it.

    ``start_round`` / ``start_step``: where a (re)launched replica continues (0 on a fresh run);
    ``resume(max_steps)``: the resume state it continues from (called once, before training;
    a decoupled learner restores its own part of it and may move ``start_step``);
    ``state_writer(trainer, flush)``: the trainer callback that saves its resume states (added
    last, after the trainer's own callbacks; ``flush`` sends the metrics first);
    ``heartbeat``: the fields of its heartbeat besides its state; ``begin_fields``: what the
    "train_begin" event adds (a decoupled learner: what binding downloaded); ``close``: release
    what the mode opened (connections, threads), called once when the replica ends."""

    outer: OuterLoop
    start_round: int
    start_step: int
    heartbeat: Callable[[], JSONDict]
    resume: Callable[[int], ReplicaStart]
    state_writer: Callable[[ResumableTrainer, Callable[[], None]], TrainerCallback]
    close: Callable[[], None] = field(default=_no_op)
    begin_fields: Callable[[], JSONDict] = field(default=_no_fields)


@dataclass(frozen=True)
class RunShape:
    """What a mode's cross-section rules need to know of the rest of the run."""

    n_replicas: int
    backend: str
    local_backend: bool
    signed: bool
    model_blocks: int | None  # transformer blocks of a model built locally; None = unknown


class SynchronizerStats(Protocol):
    def as_dict(self) -> JSONDict: ...


class Synchronizing(Protocol):
    """The service side of a mode with a synchronizer (`decoupled.synchronizer.Synchronizer`):
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


@dataclass(frozen=True)
class HostedService:
    """A process the driver runs beside the replicas for the run's lifetime, restarting it
    when it dies: `composer-replication synchronizer` on the run's store, which runs the
    mode's `build_synchronizer`. ``name``: its log (``logs/<name>.log``) and what the chaos
    schedule's ``kill_<name>`` kills; ``identity``: the signing identity whose private key
    it alone gets in a signed run."""

    name: str
    identity: str


class RefusalSource(Protocol):
    """Where the run records what its participants refused (decoupled: the refusal records
    under ``decoupled/refused/``); the driver turns each into a "rejected" event."""

    def read_rejections(self, skip: Collection[str] = ()) -> Mapping[str, Refusal]: ...


AfterLoss = Literal["stop", "go_on"]  # what the run does the moment a replica fails for good


class OuterLoopMode(Protocol):
    """One way of running the outer loop (see the module docstring)."""

    @property
    def worker_role(self) -> str:
        """The heartbeat role of the run's replicas ("replica", decoupled: "learner")."""
        ...

    @property
    def service_roles(self) -> tuple[str, ...]:
        """The heartbeat roles of the mode's services, which count to the run's health
        (decoupled: its synchronizer's)."""
        ...

    @property
    def departure_roles(self) -> tuple[str, ...]:
        """The roles whose departures the store records: peers wait for each other there, so
        the driver declares a failed or silent member departed and a new launch expects
        every rank again (torchft: none, its lighthouse tracks who is alive)."""
        ...

    def check_run(self, run: RunShape) -> None:
        """``ValueError`` naming the key when the rest of the run contradicts this mode."""
        ...

    def quorum(self, n_replicas: int) -> int:
        """Replicas the run needs alive to make progress."""
        ...

    def n_rounds(self, max_steps: int) -> int | None:
        """The run's number of outer rounds (every replica ends round R at inner step R * H),
        or None where rounds are not fixed (decoupled: one global version per merge)."""
        ...

    def after_loss(self, n_replicas: int) -> AfterLoss:
        """What the run does the moment a replica fails for good: stop, or let the others
        go on (they may still finish, `may_finish_without`)."""
        ...

    def departure_effect(self, gone: int, n_replicas: int) -> str:
        """What the other replicas do once ``gone`` replicas have departed (one clause)."""
        ...

    def may_finish_without(self, survivors: int, n_replicas: int) -> bool:
        """The run counts as finished with only ``survivors`` replicas having completed."""
        ...

    def rollback_for_resume(
        self, store: ObjectStore, n_replicas: int, warn: Callable[[str], None]
    ) -> int | None:
        """``train --resume``, before relaunching: the round every replica resumes from
        exactly, the store rolled back to it (None: each replica finds its own state)."""
        ...

    def resume_plan(self, store: ObjectStore, n_replicas: int) -> tuple[str, list[str]]:
        """What ``train --resume`` would do now (read only), and the warnings it would say."""
        ...

    def end_of_run_problem(self, store: ObjectStore, n_replicas: int, max_steps: int) -> str | None:
        """Before a run reports success: why the store does not hold its last round, or
        None."""
        ...

    def check_chaos(
        self, store: ObjectStore, kills: Sequence[Mapping[str, JSONValue]]
    ) -> JSONDict | None:
        """After a chaos run that finished: the mode's checks over the store (``"ok"`` and
        ``"problems"``), or None where it has none; ``kills``: the injector's kill entries."""
        ...

    def refusal_sources(
        self, store: ObjectStore, keys: RunKeys | None
    ) -> tuple[RefusalSource, ...]:
        """Where the run's refusal records are (``keys``: the driver's, a signed run)."""
        ...

    def driver_service(self) -> HostedService | None:
        """The process the driver runs beside the replicas, if the mode has one there."""
        ...

    def service_status(self, member: MemberLiveness, now: float) -> tuple[JSONDict, bool]:
        """The status row of one of the mode's services (a member of `service_roles`) from its
        heartbeat (``health.synchronizer`` in `status`), and whether it refused something
        recently (the run is then degraded)."""
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
