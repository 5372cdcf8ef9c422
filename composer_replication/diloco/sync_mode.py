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

from collections.abc import Mapping
from typing import ClassVar

import torch

from composer_replication.diloco.manager import Manager
from composer_replication.diloco.outer_loop import DiLoCoOuterLoop, make_diloco_outer_loop
from composer_replication.diloco.outer_mode import (
    GlobalWeights,
    Lighthouse,
    ReplicaContext,
    ReplicaLoop,
    RunShape,
    Synchronizing,
)
from composer_replication.diloco.outer_optimizer import OuterOptimizerFactory
from composer_replication.diloco.section import DilocoConfig, ManagerName, ModeName
from composer_replication.exchange import codecs
from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.liveness import REPLICA_ROLE
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.state import parse_state_name, state_prefix
from composer_replication.exchange.store import ObjectStore, Store
from composer_replication.exchange.store_manager import ObjectStoreManager
from composer_replication.fields import require

__all__ = ["SyncDiLoCo", "resume_round"]


def resume_round(store: Store) -> int:
    """The round of the newest published global state (0 on a fresh run)."""
    rounds = [parse_state_name(n) for n in store.list(state_prefix("global"))]
    return max((r for r in rounds if r is not None), default=0)


class SyncDiLoCo:
    """Sync DiLoCo over the object store (see the module docstring)."""

    mode: ClassVar[ModeName] = "sync"
    manager: ClassVar[ManagerName] = "object_store"
    worker_role = REPLICA_ROLE
    lockstep = True
    store_departures = True
    has_synchronizer = False
    driver_synchronizer = False

    def __init__(self, config: DilocoConfig) -> None:
        self.config = config
        self.check_section()

    def check_section(self) -> None:
        """The rules of this mode on the `[diloco]` section."""
        d = self.config
        require(d.fragments == 1, "diloco.fragments", "is used with diloco.mode = 'decoupled' only")
        require(
            not d.lighthouse,
            "diloco.lighthouse",
            "is only used with diloco.manager = 'torchft'; remove it or set the manager",
        )
        if codecs.get(d.codec).needs_error_feedback:
            require(
                d.outer_optimizer != "adam",
                "diloco.outer_optimizer",
                "'adam' contradicts codec = 'sparseloco', whose outer step is plain SGD at "
                "sparseloco_outer_lr (the error feedback replaces the outer momentum); use "
                "'nesterov' or 'sgd' (neither is used with it) or another codec",
            )

    def check_run(self, run: RunShape) -> None:
        return None

    def quorum(self, n_replicas: int) -> int:
        return self.config.commit_quorum(n_replicas)

    def elastic(self, n_replicas: int) -> bool:
        return self.quorum(n_replicas) < n_replicas

    def may_finish_without(self, survivors: int, n_replicas: int) -> bool:
        return survivors >= self.quorum(n_replicas)

    def build_learner(self, ctx: ReplicaContext) -> ReplicaLoop:
        start_round = resume_round(ctx.store)
        built: list[DiLoCoOuterLoop] = []  # the probe reads the outer loop's global weights

        def global_weights() -> Mapping[str, torch.Tensor]:
            return built[0].global_parameters()

        manager = self.build_manager(ctx, global_weights)
        h = self.config.sync_every_h
        outer = make_diloco_outer_loop(
            None, manager, h, model=ctx.model, outer_optimizer_factory=self.outer_factory()
        )
        built.append(outer)
        return ReplicaLoop(
            outer=outer,
            start_round=start_round,
            start_step=start_round * h,
            heartbeat=lambda: {"round": outer.round},
            close=manager.close,
        )

    def build_manager(self, ctx: ReplicaContext, global_weights: GlobalWeights) -> Manager:
        """This replica's `ObjectStoreManager` (with SparseLoCo's error feedback around it)."""
        d = self.config
        screening = ctx.screening
        allreduce = ObjectStoreAllReduce(
            ctx.store.uri,
            world_size=ctx.n_replicas,
            rank=ctx.rank,
            timeout_s=d.timeout_s,
            codec=d.codec,
            min_replicas=self.quorum(ctx.n_replicas),
            aggregate=d.aggregate_policy() if screening is None else screening.policy(),
            storage_options=ctx.store.storage_options or None,
            keep_steps=ctx.keep_rounds,
            keys=ctx.keys,
            loss_probe=None if screening is None else screening.probe(global_weights),
            writer_secret=ctx.writer_secret,
            slot_secret=ctx.slot_secret,
            sparse=d.sparse_spec(),
            fence=ctx.fence,
        )
        manager = ObjectStoreManager(allreduce=allreduce)
        if codecs.get(
            d.codec
        ).needs_error_feedback:  # SparseLoCo: the replica's error feedback around it
            return d.build_error_feedback(manager)
        return manager

    def outer_factory(self) -> OuterOptimizerFactory:
        """The outer optimizer in use: `[diloco] outer_*`, or SparseLoCo's plain SGD."""
        if codecs.get(
            self.config.codec
        ).needs_error_feedback:  # the error feedback replaces the momentum
            return self.config.build_sparse_outer_optimizer()
        return self.config.build_outer_optimizer()

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
