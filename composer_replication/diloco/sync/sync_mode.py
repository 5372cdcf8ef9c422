"""Sync DiLoCo over the object store: `SyncDiLoCo`, the ``mode = "sync"``, ``manager =
"object_store"`` `OuterLoopMode`.

Every H inner steps each replica uploads its pseudo-gradient to the store
(`ObjectStoreAllReduce`), the round commits once ``min_replicas`` have (screened by
``aggregate*`` / ``screen*``), and every replica applies the same outer step
(`DiLoCoOuterLoop` over an `ObjectStoreManager`). With codec ``"sparseloco"`` the replica's
error feedback wraps the manager and the outer step is SparseLoCo's plain SGD. A replica
(re)joins at the newest published round; rounds are lockstep, so a run resumes exactly from
the replicas' resume states (diloco/replica_state.py) and a replica lost for good lets the others
finish when at least ``min_replicas`` remain.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from composer_replication.diloco.manager import Manager
from composer_replication.diloco.mode_protocol import (
    AfterLoss,
    GlobalWeights,
    HostedService,
    Lighthouse,
    RefusalSource,
    ReplicaContext,
    ReplicaLoop,
    ReplicaStart,
    RunShape,
    Synchronizing,
)
from composer_replication.diloco.outer_loop import DiLoCoOuterLoop, make_diloco_outer_loop
from composer_replication.diloco.outer_optimizer import OuterOptimizerFactory
from composer_replication.diloco.replica_state import ResumableTrainer
from composer_replication.diloco.section import DilocoConfig, ManagerName, ModeName
from composer_replication.exchange import codecs
from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.document_format import parse_state_name, state_prefix
from composer_replication.exchange.liveness import REPLICA_ROLE, MemberLiveness
from composer_replication.exchange.protocol import commit_key
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.store import ObjectStore, Store
from composer_replication.exchange.store_manager import ObjectStoreManager
from composer_replication.fields import require
from composer_replication.json_types import JSONDict, JSONValue

if TYPE_CHECKING:
    from transformers import TrainerCallback

__all__ = ["SyncDiLoCo", "last_round_problem", "resume_round"]


def resume_round(store: Store) -> int:
    """The round of the newest published global state (0 on a fresh run)."""
    rounds = [parse_state_name(n) for n in store.list(state_prefix("global"))]
    return max((r for r in rounds if r is not None), default=0)


def _committed_rounds(store: ObjectStore) -> list[int]:
    """Rounds with a commit record in the store, oldest first."""
    rounds = [int(name) for name in store.list("steps") if name.isdigit()]
    return sorted(r for r in rounds if store.exists(commit_key(r)))


def last_round_problem(store: ObjectStore, n_rounds: int) -> str | None:
    """Why the store's newest commit record is not the run's last round, ``n_rounds``, read
    back as that round's (the end-of-run check); None when it is."""
    rounds = _committed_rounds(store)
    last = rounds[-1] if rounds else 0
    if last != n_rounds:
        return (
            f"end-of-run check: the store's last committed round is {last}, the run has "
            f"{n_rounds} (train.max_steps / diloco.sync_every_h)"
        )
    try:
        record = json.loads(bytes(store.get(commit_key(last)) or b""))
    except ValueError:
        record = None
    if not isinstance(record, dict) or record.get("step") != last:
        return f"end-of-run check: the commit record of the last round ({last}) is not readable"
    return None


class SyncDiLoCo:
    """Sync DiLoCo over the object store (see the module docstring)."""

    mode: ClassVar[ModeName] = "sync"
    manager: ClassVar[ManagerName] = "object_store"
    worker_role = REPLICA_ROLE
    service_roles: tuple[str, ...] = ()
    departure_roles: tuple[str, ...] = (REPLICA_ROLE,)  # the peers wait in the store

    def __init__(self, config: DilocoConfig) -> None:
        self.config = config
        self.check_section()

    def check_section(self) -> None:
        """The rules of this mode on the `[diloco]` section."""
        d = self.config
        require(
            d.decoupled.fragments == 1,
            "diloco.fragments",
            "is used with diloco.mode = 'decoupled' only",
        )
        require(
            not d.torchft.lighthouse,
            "diloco.lighthouse",
            "is only used with diloco.manager = 'torchft'; remove it or set the manager",
        )
        if codecs.get(d.exchange.codec).needs_error_feedback:
            require(
                d.outer.outer_optimizer != "adam",
                "diloco.outer_optimizer",
                "'adam' contradicts codec = 'sparseloco', whose outer step is plain SGD at "
                "sparseloco_outer_lr (the error feedback replaces the outer momentum); use "
                "'nesterov' or 'sgd' (neither is used with it) or another codec",
            )

    def check_run(self, run: RunShape) -> None:
        return None

    def quorum(self, n_replicas: int) -> int:
        return self.config.exchange.commit_quorum(n_replicas)

    def n_rounds(self, max_steps: int) -> int:
        return max_steps // self.config.sync_every_h

    def after_loss(self, n_replicas: int) -> AfterLoss:
        """Go on when the quorum leaves room for a lost replica (the others then finish
        without it while at least the quorum remains)."""
        return "go_on" if self.quorum(n_replicas) < n_replicas else "stop"

    def departure_effect(self, gone: int, n_replicas: int) -> str:
        """By the run's quorum (`diloco.min_replicas`; its default is the exchange's): go on,
        or wait up to `diloco.timeout_s` and fail the round."""
        quorum = self.quorum(n_replicas)
        if n_replicas - gone >= quorum:
            return "the others go on without waiting for it"
        return (
            f"the others cannot go on without it: diloco.min_replicas = {quorum} of "
            f"{n_replicas} replicas (they wait up to diloco.timeout_s = "
            f"{self.config.exchange.timeout_s:g} s, then the round fails; set diloco.min_replicas "
            f"below {n_replicas} to go on without a replica)"
        )

    def may_finish_without(self, survivors: int, n_replicas: int) -> bool:
        return survivors >= self.quorum(n_replicas)

    def rollback_for_resume(
        self, store: ObjectStore, n_replicas: int, warn: Callable[[str], None]
    ) -> int:
        from composer_replication.diloco.sync import sync_resume  # transformers: on first use

        return sync_resume.rollback_for_resume(store, n_replicas, warn)

    def resume_plan(self, store: ObjectStore, n_replicas: int) -> tuple[str, list[str]]:
        from composer_replication.diloco.sync import sync_resume

        return sync_resume.resume_plan_now(store, n_replicas)

    def end_of_run_problem(self, store: ObjectStore, n_replicas: int, max_steps: int) -> str | None:
        """The newest commit record is round ``max_steps / H`` and reads back as that
        round's; a run of one replica exchanges nothing (nothing to check)."""
        if n_replicas <= 1:
            return None
        return last_round_problem(store, self.n_rounds(max_steps))

    def check_chaos(
        self, store: ObjectStore, kills: Sequence[Mapping[str, JSONValue]]
    ) -> JSONDict | None:
        return None  # the run's own checks (exact rounds, the end-of-run check) hold it

    def refusal_sources(
        self, store: ObjectStore, keys: RunKeys | None
    ) -> tuple[RefusalSource, ...]:
        return ()  # a rejection is in the replicas' round records already

    def driver_service(self) -> HostedService | None:
        return None

    def service_status(self, member: MemberLiveness, now: float) -> tuple[JSONDict, bool]:
        return {"id": member.id, "status": member.status}, False  # it has no services

    def build_learner(self, ctx: ReplicaContext) -> ReplicaLoop:
        start_round = resume_round(ctx.store)
        built: list[DiLoCoOuterLoop] = []  # the probe reads the outer loop's global weights

        def global_weights() -> Mapping[str, torch.Tensor]:
            return built[0].global_parameters()

        manager = self.build_manager(ctx, global_weights)
        h = self.config.sync_every_h
        outer = make_diloco_outer_loop(
            None, manager, h, model=ctx.model, outer=self.outer_factory()
        )
        built.append(outer)

        def resume(max_steps: int) -> ReplicaStart:
            """Rounds end at step R * H on every replica: this rank's state of its round."""
            from composer_replication.diloco.sync import sync_resume

            step = start_round * h
            state = None
            if max_steps > step:
                state = sync_resume.own_resume_state(ctx.store, ctx.rank, start_round, ctx.keys)
            return ReplicaStart(state, step)

        def state_writer(trainer: ResumableTrainer, flush: Callable[[], None]) -> TrainerCallback:
            from composer_replication.diloco.sync import sync_resume

            return sync_resume.ResumeStateWriter(
                store=ctx.store,
                rank=ctx.rank,
                outer=outer,
                trainer=trainer,
                sync_every_h=h,
                keep_rounds=ctx.keep_rounds,
                flush=flush,
                keys=ctx.keys,
            )

        return ReplicaLoop(
            outer=outer,
            start_round=start_round,
            start_step=start_round * h,
            heartbeat=lambda: {"round": outer.round},
            resume=resume,
            state_writer=state_writer,
            close=manager.close,
        )

    def build_manager(self, ctx: ReplicaContext, global_weights: GlobalWeights) -> Manager:
        """This replica's `ObjectStoreManager` (with SparseLoCo's error feedback around it)."""
        d = self.config
        screening = ctx.screening
        allreduce = ObjectStoreAllReduce(
            ctx.store.uri,  # a client of its own: its request counts are the exchange's
            world_size=ctx.n_replicas,
            rank=ctx.rank,
            config=d.exchange.allreduce_config(
                ctx.n_replicas,
                keep_rounds=ctx.keep_rounds,
                policy=None if screening is None else screening.policy(),
                sparse=d.sparseloco.sparse_spec(),
            ),
            storage_options=ctx.store.storage_options or None,
            keys=ctx.keys,
            loss_probe=None if screening is None else screening.probe(global_weights),
            writer_secret=ctx.writer_secret,
            slot_secret=ctx.slot_secret,
            fence=ctx.fence,
        )
        manager = ObjectStoreManager(allreduce=allreduce)
        if codecs.get(
            d.exchange.codec
        ).needs_error_feedback:  # SparseLoCo: the replica's error feedback around it
            return d.sparseloco.build_error_feedback(manager)
        return manager

    def outer_factory(self) -> OuterOptimizerFactory:
        """The outer optimizer in use: `[diloco] outer_*`, or SparseLoCo's plain SGD."""
        if codecs.get(
            self.config.exchange.codec
        ).needs_error_feedback:  # the error feedback replaces the momentum
            return self.config.sparseloco.build_sparse_outer_optimizer()
        return self.config.outer.build_outer_optimizer()

    def build_synchronizer(
        self, store: ObjectStore, *, keep_rounds: int, max_steps: int, keys: RunKeys | None = None
    ) -> Synchronizing | None:
        return None

    def build_lighthouse(self, n_replicas: int) -> Lighthouse | None:
        return None

    def release_failed(
        self,
        store: ObjectStore,
        failed: Mapping[int, str],
        max_steps: int,
        keys: RunKeys | None = None,
    ) -> None:
        return None  # the driver's departure records release the peers (store_departures)
