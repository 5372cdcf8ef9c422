"""Decoupled DiLoCo: `DecoupledDiLoCo`, the ``mode = "decoupled"`` `OuterLoopMode`.

Learners never wait for each other (`DecoupledLearner`): each pushes one of ``fragments``
fragments every ``sync_every_h / fragments`` inner steps and takes each new global fragment as
it is published. The service side is the `Synchronizer` (one active per run, through a lease),
which merges a fragment once ``quorum`` learners have pushed it; the driver runs it beside
itself with ``synchronizer = "driver"``. With ``[security] sign`` the learners sign their
pushes and progress with their rank's key and the synchronizer its merge records and states with
the synchronizer's key; each refuses what is not signed by who may write it
(exchange/push_store.py). Rounds are not lockstep: a relaunched learner
continues from its own state at its last push (diloco/decoupled/learner_state.py; without one, from the
newest global versions with fresh inner state), and the run needs every learner to finish (one that fails for good is released so the synchronizer stops waiting).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, ClassVar

from composer_replication.diloco.decoupled.decoupled_check import (
    check_decoupled_run,
    final_merges_problem,
)
from composer_replication.diloco.decoupled.learner import (
    DecoupledLearner,
    LearnerConfig,
    RejoinRecord,
)
from composer_replication.diloco.decoupled.synchronizer import ROLE as SYNCHRONIZER_ROLE
from composer_replication.diloco.decoupled.synchronizer import Synchronizer
from composer_replication.diloco.mode_protocol import (
    AfterLoss,
    HostedService,
    Lighthouse,
    RefusalSource,
    ReplicaContext,
    ReplicaLoop,
    ReplicaStart,
    RunShape,
)
from composer_replication.diloco.replica_state import ResumableTrainer
from composer_replication.diloco.section import DilocoConfig, ManagerName, ModeName
from composer_replication.diloco.synchronizer_config import (
    SynchronizerConfig,
    SynchronizerSettings,
    check_outer_step,
)
from composer_replication.exchange import codecs
from composer_replication.exchange.liveness import LEARNER_ROLE, MemberLiveness
from composer_replication.exchange.push_store import DecoupledStore
from composer_replication.exchange.signing import SYNCHRONIZER, RunKeys
from composer_replication.exchange.store import ObjectStore
from composer_replication.fields import require
from composer_replication.json_types import JSONDict, JSONValue

if TYPE_CHECKING:
    from transformers import TrainerCallback

__all__ = ["REJECTION_WINDOW_S", "DecoupledDiLoCo"]

REJECTION_WINDOW_S = 60.0  # a refusal the synchronizer made this recently degrades the run


def _rejoin_fields(rejoin: RejoinRecord | None) -> JSONDict:
    """The "train_begin" event's fields: what binding downloaded (only the newest version of
    each fragment merged while the learner was down; docs/diloco.md)."""
    if rejoin is None:
        return {}
    return {
        "rejoin_bytes": rejoin["bytes"],
        "rejoin_objects": rejoin["objects"],
        "rejoin_merged_meanwhile": rejoin["merged_meanwhile"],
    }


class DecoupledDiLoCo:
    """Decoupled DiLoCo (see the module docstring)."""

    mode: ClassVar[ModeName] = "decoupled"
    manager: ClassVar[ManagerName] = "object_store"
    worker_role = LEARNER_ROLE
    service_roles: tuple[str, ...] = (SYNCHRONIZER_ROLE,)
    # the synchronizer leaves a departed learner out of its quorum
    departure_roles: tuple[str, ...] = (LEARNER_ROLE,)

    def __init__(self, config: DilocoConfig) -> None:
        self.config = config
        self.check_section()

    def driver_service(self) -> HostedService | None:
        """The synchronizer, with ``diloco.synchronizer = "driver"`` (``"external"``: the
        user runs it)."""
        if self.config.decoupled.synchronizer != "driver":
            return None
        return HostedService(name="synchronizer", identity=SYNCHRONIZER)

    def check_section(self) -> None:
        """The rules of this mode on the `[diloco]` section."""
        d = self.config
        try:  # the synchronizer's own rules, on the section's keys
            check_outer_step(
                outer_optimizer=d.outer.outer_optimizer,
                merge=d.decoupled.merge,
                aggregate=d.exchange.aggregate,
            )
        except ValueError as exc:
            raise ValueError(f"diloco.{exc}") from None
        require(
            d.exchange.screen == "none",
            "diloco.screen",
            "the loss screen runs in the synchronous exchange only; decoupled mode screens "
            "by norm (diloco.aggregate_outlier_ratio): set diloco.screen = 'none'",
        )
        require(
            not codecs.get(d.exchange.codec).needs_error_feedback,
            "diloco.codec",
            f"{d.exchange.codec!r} runs in sync mode only: a decoupled push is the whole change since "
            "the last global version the learner loaded (a later push repeats an earlier "
            "one's work, and a queued push can be replaced by a newer one), so a per-push "
            "error-feedback accumulator would count work twice; use diloco.mode = 'sync'",
        )
        require(
            not d.torchft.lighthouse,
            "diloco.lighthouse",
            "is only used with diloco.manager = 'torchft'; remove it or set the manager",
        )

    def check_run(self, run: RunShape) -> None:
        d = self.config
        if run.model_blocks is not None:
            require(
                d.decoupled.fragments <= run.model_blocks,
                "diloco.fragments",
                f"{d.decoupled.fragments} exceeds model.num_layers ({run.model_blocks}): each fragment "
                "needs at least one transformer block",
            )
        if d.decoupled.quorum is not None:
            require(
                d.decoupled.quorum <= run.n_replicas,
                "diloco.quorum",
                f"{d.decoupled.quorum} exceeds backend.n_replicas ({run.n_replicas})",
            )

    def quorum(self, n_replicas: int) -> int:
        return self.config.decoupled.resolved_quorum(n_replicas)

    def n_rounds(self, max_steps: int) -> None:
        return None  # one global version per merge, any number of them per H steps

    def after_loss(self, n_replicas: int) -> AfterLoss:
        return "go_on"  # learners never wait for each other

    def departure_effect(self, gone: int, n_replicas: int) -> str:
        return (
            "the other learners go on (none waits for another); the synchronizer leaves "
            "it out of its quorum"
        )

    def may_finish_without(self, survivors: int, n_replicas: int) -> bool:
        return False  # a learner's pushes are part of the run's result

    def rollback_for_resume(
        self, store: ObjectStore, n_replicas: int, warn: Callable[[str], None]
    ) -> None:
        return None  # each learner resumes from its own newest state at a push

    def resume_plan(self, store: ObjectStore, n_replicas: int) -> tuple[str, list[str]]:
        # learner_state needs transformers: imported on first use, so that loading a config
        # (which picks its mode) does not import it
        from composer_replication.diloco.decoupled import learner_state

        return learner_state.learner_resume_plan(store, n_replicas)

    def end_of_run_problem(self, store: ObjectStore, n_replicas: int, max_steps: int) -> str | None:
        return final_merges_problem(store, self.config.decoupled.fragments)

    def check_chaos(
        self, store: ObjectStore, kills: Sequence[Mapping[str, JSONValue]]
    ) -> JSONDict | None:
        return check_decoupled_run(store, None, [dict(kill) for kill in kills])

    def service_status(self, member: MemberLiveness, now: float) -> tuple[JSONDict, bool]:
        """The synchronizer's row (its heartbeat's fields and stats), and whether it refused
        a contribution in the last `REJECTION_WINDOW_S` seconds."""
        fields = member.heartbeat.fields if member.heartbeat is not None else {}
        raw = fields.get("stats")
        stats: JSONDict = raw if isinstance(raw, dict) else {}
        row: JSONDict = {
            "id": member.id,
            "status": member.status,
            "active": fields.get("active"),
            "epoch": fields.get("epoch"),
            "versions": fields.get("versions"),
            "merges": stats.get("merges"),
            "refused": stats.get("refused"),
            "rejected": stats.get("rejected"),
            "dropped_late": stats.get("dropped_late"),
            "carried_late": stats.get("carried_late"),
        }
        last = stats.get("last_rejection")
        recent = isinstance(last, int | float) and now - float(last) < REJECTION_WINDOW_S
        return row, recent

    def refusal_sources(
        self, store: ObjectStore, keys: RunKeys | None
    ) -> tuple[RefusalSource, ...]:
        return (DecoupledStore(store, keys=keys),)

    def build_learner(self, ctx: ReplicaContext) -> ReplicaLoop:
        d = self.config
        learner = DecoupledLearner(
            ctx.store,
            learner=ctx.rank,
            n_learners=ctx.n_replicas,
            config=LearnerConfig(
                sync_every_h=d.sync_every_h,
                fragments=d.decoupled.fragments,
                alpha=d.decoupled.alpha,
                codec=d.exchange.codec,
                poll_interval_s=0.1 if ctx.store.is_local else 0.5,
                drain_timeout_s=d.exchange.timeout_s,
                heartbeat_every_s=None,  # the replica's heartbeat carries the learner's fields
            ),
            model=ctx.model,
            keys=ctx.keys,
        )

        def state_writer(trainer: ResumableTrainer, flush: Callable[[], None]) -> TrainerCallback:
            from composer_replication.diloco.decoupled import learner_state

            return learner_state.LearnerStateWriter(
                store=ctx.store, rank=ctx.rank, learner=learner, trainer=trainer, flush=flush
            )

        def resume(max_steps: int) -> ReplicaStart:
            from composer_replication.diloco.decoupled import learner_state

            return learner_state.learner_start(ctx.store, ctx.rank, learner, max_steps)

        return ReplicaLoop(
            outer=learner,
            start_round=0,
            start_step=learner.start_step,
            heartbeat=lambda: {
                "round": learner.round,
                "step": learner.step,
                "versions": list(learner.versions),
            },
            resume=resume,
            state_writer=state_writer,
            begin_fields=lambda: _rejoin_fields(learner.rejoin),
        )

    def synchronizer_config(
        self, *, keep_rounds: int, max_steps: int, local: bool
    ) -> SynchronizerConfig:
        """The synchronizer's config: the section's keys under the same names (its decoupled
        component's synchronizer settings, the exchange's screening keys, its outer optimizer),
        the store's ``keep_rounds`` and the run's length."""
        d = self.config
        settings = {f.name: getattr(d.decoupled, f.name) for f in fields(SynchronizerSettings)}
        return SynchronizerConfig(
            **settings,
            outer=d.outer,
            weighting=d.exchange.weighting,
            aggregate=d.exchange.aggregate,
            aggregate_outlier_ratio=d.exchange.aggregate_outlier_ratio,
            keep_rounds=keep_rounds,
            max_steps=max_steps,
            poll_interval_s=0.05 if local else 0.25,
        )

    def build_synchronizer(
        self, store: ObjectStore, *, keep_rounds: int, max_steps: int, keys: RunKeys | None = None
    ) -> Synchronizer:
        config = self.synchronizer_config(
            keep_rounds=keep_rounds, max_steps=max_steps, local=store.uri.startswith("file:")
        )
        return Synchronizer(store, config, keys=keys)

    def build_lighthouse(self, n_replicas: int) -> Lighthouse | None:
        return None

    def release_failed(
        self,
        store: ObjectStore,
        failed: Mapping[int, str],
        max_steps: int,
        keys: RunKeys | None = None,
    ) -> None:
        """Mark each learner that failed for good done (abandoned): the synchronizer neither
        waits for it in a quorum nor before the final merge (``keys``: the driver's, a signed
        run)."""
        docs = DecoupledStore(store, keys=keys)
        for rank, error in failed.items():
            doc = docs.read_progress(rank)
            if doc is None or not doc.get("abandoned"):
                docs.write_progress(
                    rank, step=max_steps, done=True, abandoned=True, error=error[:500]
                )
