"""One fragment's merges: decide (quorum, grace window), record, step and publish.

The synchronizer (diloco/decoupled/synchronizer.py) discovers pushes into an `Inbox` and asks a
`FragmentMerger` to merge what is due. For fragment p at version v the merger

1. waits until ``quorum`` distinct live, unfinished learners have pushed p based on v, then a
   grace window (`merge_math.grace_seconds`) for stragglers, or not at all once all of them have;
2. takes each learner's newest on-time push (older ones of the same base are superseded), and
   the late pushes (based on an older version) as ``late`` says: dropped, or carried into this
   merge, never twice (a push is consumed by exactly one record);
3. writes the merge record (put-if-absent: the decision; a rival's record is adopted instead),
   computes the merge (`merge_math.aggregate`, or `merge_math.combine_decided` when replaying
   a record), applies the outer step and publishes the new momentum, global weights and
   ``heads.json``.

`apply_record` replays a stored decision (recovery, or a rival's record): aggregation is a pure
function of the pushes the record pins by checksum.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_replication.diloco.decoupled.merge_math import (
    Decision,
    MergeInput,
    aggregate,
    combine_decided,
    ema,
    grace_seconds,
    merge_pushes,
    outer_step,
    push_weight,
)
from composer_replication.diloco.synchronizer_config import SynchronizerConfig
from composer_replication.exchange.contribution_screening import AggregatePolicy
from composer_replication.exchange.lease import Lease
from composer_replication.exchange.protocol import CorruptContributionError
from composer_replication.exchange.push_store import DecoupledStore, Push, PushId

__all__ = ["FragmentMerger", "FragmentState", "Inbox", "SynchronizerStats", "Timings"]

log = logging.getLogger(__name__)

_DEFAULT_OUTLIER_RATIO = AggregatePolicy().aggregate_outlier_ratio

Tensors = dict[str, torch.Tensor]
Reference = dict[str, tuple[list[int], str]]


@dataclass
class FragmentState:
    """The synchronizer's view of one fragment."""

    index: int
    version: int
    params: Tensors
    momentum: Tensors
    reference: Reference
    mean_only: list[str]
    consumed: set[str] = field(default_factory=set)
    merged_bases: set[tuple[int, int]] = field(default_factory=set)  # (learner, base) merged
    floor: int = 0  # pushes based below this are consumed (an unreadable record covered them)
    first_at: float | None = None  # monotonic time the round's first on-time push was seen
    quorum_at: float | None = None
    grace_s: float = 0.0

    def note_consumed(self, record: dict[str, Any]) -> None:
        """What a stored merge record consumed, and which (learner, base) it merged."""
        self.consumed.update(record["consumed"])
        for entry in record["inputs"]:
            pid = PushId.parse(entry["push"])
            if pid is not None and (record["decisions"].get(entry["push"]) or {}).get("included"):
                self.merged_bases.add((pid.learner, pid.base))


@dataclass
class SynchronizerStats:
    """Counters since this synchronizer started (written to its heartbeat and status)."""

    merges: int = 0
    inputs: int = 0
    rejected: int = 0
    dropped_late: int = 0
    carried_late: int = 0
    superseded: int = 0
    refused: int = 0
    recovered_merges: int = 0
    adopted_merges: int = 0
    repaired_states: int = 0
    steps_merged: int = 0
    last_rejection: float | None = None  # wall time of the newest refused/rejected push
    last_merges: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["last_merges"] = list(self.last_merges[-8:])
        return out


@dataclass
class Inbox:
    """The pushes seen and not yet consumed (with when each arrived), and the refused ones."""

    pending: dict[PushId, Push] = field(default_factory=dict)
    arrived: dict[PushId, float] = field(default_factory=dict)
    refused: dict[PushId, str] = field(default_factory=dict)
    future: set[PushId] = field(default_factory=set)  # based on a version not yet published
    known: set[PushId] = field(default_factory=set)  # every push seen in the newest listing

    def clear(self) -> None:
        self.pending.clear()
        self.arrived.clear()
        self.refused.clear()
        self.future.clear()

    def on_time(self, frag: FragmentState) -> dict[int, list[PushId]]:
        """learner -> its pending pushes based on the fragment's version (oldest first)."""
        out: dict[int, list[PushId]] = {}
        for pid in sorted(self.pending):
            if pid.fragment == frag.index and pid.base == frag.version:
                out.setdefault(pid.learner, []).append(pid)
        return out

    def late(self, frag: FragmentState) -> list[PushId]:
        """The fragment's pending pushes based on an older version."""
        return sorted(p for p in self.pending if p.fragment == frag.index and p.base < frag.version)

    def discard(self, pids: list[PushId]) -> None:
        for p in pids:
            self.pending.pop(p, None)
            self.arrived.pop(p, None)


@dataclass
class Timings:
    """EMAs of the learners' seconds per inner step, a round's first push to its quorum, and
    a merge's publication (the grace window's inputs)."""

    step_s: float | None = None
    quorum_s: float | None = None
    sync_s: float | None = None


@dataclass
class _Selection:
    """What one merge takes: its inputs (on time, then carried late pushes), the pushes they
    supersede, and the late pushes it drops (name -> why)."""

    inputs: list[PushId] = field(default_factory=list)
    superseded: list[PushId] = field(default_factory=list)
    carried: list[PushId] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)


class FragmentMerger:
    """Merges the fragments of one run (see the module docstring); ``fragments`` is set by the
    synchronizer's recovery."""

    def __init__(
        self,
        config: SynchronizerConfig,
        docs: DecoupledStore,
        lease: Lease,
        *,
        stats: SynchronizerStats,
        inbox: Inbox,
        timings: Timings,
        on_merge: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.config, self.docs, self.lease = config, docs, lease
        self.stats, self.inbox, self.timings = stats, inbox, timings
        self.on_merge = on_merge
        self.fragments: list[FragmentState] = []
        self.n_learners = 0

    @property
    def versions(self) -> list[int]:
        return [f.version for f in self.fragments]

    def maybe_merge(self, frag: FragmentState, *, flush: bool, active: set[int]) -> None:
        """Merge fragment ``frag`` if it is due (``flush``: every learner is done, merge what
        is left without quorum or grace); ``active``: the learners that may still push."""
        on_time = self.inbox.on_time(frag)
        late = self.inbox.late(frag)
        if not on_time and not (flush and late):
            frag.first_at = frag.quorum_at = None
            return
        now = time.monotonic()
        if on_time:
            first = min(self.inbox.arrived[p] for ps in on_time.values() for p in ps)
            frag.first_at = first if frag.first_at is None else min(frag.first_at, first)
        if not flush:
            wanted = self.config.resolved_quorum(self.n_learners)
            quorum = max(1, min(wanted, len(active) or 1))
            if len(on_time) < quorum:
                return
            if frag.quorum_at is None:
                frag.quorum_at = now
                t = self.timings
                frag.grace_s = grace_seconds(
                    self.config.grace_gamma, self.config.grace_tau, t.step_s, t.quorum_s, t.sync_s
                )
            everyone = active <= set(on_time)
            if not everyone and now - frag.quorum_at < frag.grace_s:
                return
        self._merge(frag, on_time, late, now)

    def _merge(
        self, frag: FragmentState, on_time: dict[int, list[PushId]], late: list[PushId], now: float
    ) -> None:
        sel = self._select(frag, on_time, late)
        if not sel.inputs:
            # only late pushes to drop: consume them without a new version (recorded, as no
            # merge record will name them)
            for pid in late:
                if pid.name in sel.dropped:
                    self.record_unmerged(pid, f"dropped: {sel.dropped[pid.name]}")
            frag.consumed.update(sel.dropped)
            for pid in late:
                self.inbox.pending.pop(pid, None)
            self.stats.dropped_late += len(sel.dropped)
            return
        record = self._record(frag, sel, now)
        t0 = time.monotonic()
        pushes = [self.inbox.pending[p] for p in sel.inputs]
        merged, decisions = self._combine(record, pushes, frag)
        record["decisions"] = decisions
        if not merged:  # every input refused: consume them, no new version (recorded)
            log.warning("fragment %d: every input refused (%s)", frag.index, decisions)
            self._record_refused_merge(record, sel, late)
            frag.consumed.update(record["consumed"])
            for p in sel.inputs + sel.superseded + late:
                self.inbox.pending.pop(p, None)
            self.stats.rejected += len(sel.inputs)
            return
        if not self.lease.held() or not self.lease.renew():
            log.warning(
                "synchronizer %s lost the lease before merging fragment %d",
                self.lease.owner,
                frag.index,
            )
            return
        if not self.docs.write_merge(record):
            self._adopt(frag)
            return
        self._publish(frag, record, merged)
        t, cfg = self.timings, self.config
        t.sync_s = ema(t.sync_s, time.monotonic() - t0, cfg.ema)
        if frag.quorum_at is not None and frag.first_at is not None:
            t.quorum_s = ema(t.quorum_s, frag.quorum_at - frag.first_at, cfg.ema)
        self.inbox.discard(sel.inputs + sel.superseded + late)
        frag.first_at = frag.quorum_at = None
        if frag.version % cfg.keep_rounds == 0:  # housekeeping every `keep_rounds` merges
            self._gc(frag)
        self._count(frag, record, sel)
        if self.on_merge is not None:
            self.on_merge(record)

    def record_unmerged(self, pid: PushId, reason: str) -> None:
        """Record a push consumed without a merge record naming it (refused, or dropped when no
        merge happens), so that an audit can account for every push written."""
        try:
            self.docs.write_refusal(pid, reason)
        except OSError as e:  # housekeeping: the decision stands either way
            log.warning("recording why %s was not merged failed: %r", pid.name, e)

    def _record_refused_merge(
        self, record: dict[str, Any], sel: _Selection, late: list[PushId]
    ) -> None:
        """Every push a merge that refused all its inputs consumes, recorded with why."""
        why = {k: f"dropped: {v}" for k, v in sel.dropped.items()}
        why.update({p.name: "superseded by a push that was refused" for p in sel.superseded})
        for k, d in record["decisions"].items():
            why[k] = f"refused by the merge: {(d or {}).get('reason', d)}"
        for pid in sel.inputs + sel.superseded + late:
            if pid.name in record["consumed"]:
                self.record_unmerged(pid, why.get(pid.name, "refused by the merge"))

    def _select(
        self, frag: FragmentState, on_time: dict[int, list[PushId]], late: list[PushId]
    ) -> _Selection:
        """Each learner's newest on-time push, and the late pushes ``late`` carries or drops."""
        sel = _Selection()
        for pids in on_time.values():
            sel.inputs.append(pids[-1])
            sel.superseded += pids[:-1]
        newest_late: dict[tuple[int, int], PushId] = {}
        for pid in late:  # ascending: the last one per (learner, base) is the newest
            if self.config.late == "drop":
                sel.dropped[pid.name] = f"late: version {pid.base + 1} was already merged"
            elif pid.base < frag.version - self.config.keep_rounds:
                sel.dropped[pid.name] = f"too stale: based on {pid.base}, now {frag.version}"
            elif (pid.learner, pid.base) in frag.merged_bases:
                sel.dropped[pid.name] = (
                    f"learner {pid.learner} already had a push based on {pid.base} merged "
                    "(its work is in it)"
                )
            else:
                old = newest_late.get((pid.learner, pid.base))
                if old is not None:
                    sel.superseded.append(old)
                newest_late[(pid.learner, pid.base)] = pid
        sel.carried = sorted(newest_late.values())
        sel.inputs = sorted(sel.inputs) + sel.carried
        return sel

    def _record(self, frag: FragmentState, sel: _Selection, now: float) -> dict[str, Any]:
        """The merge record of ``sel`` (its ``decisions`` are filled in after combining)."""
        cfg, pending = self.config, self.inbox.pending
        outer = cfg.outer
        pushes = [pending[p] for p in sel.inputs]
        waited = None if frag.first_at is None else now - frag.first_at
        to_quorum = None
        if frag.quorum_at is not None and frag.first_at is not None:
            to_quorum = frag.quorum_at - frag.first_at
        return {
            "format": 1,
            "kind": "merge",
            "fragment": frag.index,
            "version": frag.version + 1,
            "base_version": frag.version,
            "inputs": [
                {
                    "push": p.id.name,
                    "learner": p.id.learner,
                    "base": p.id.base,
                    "weight": push_weight(p, cfg.weighting),
                    "checksum": p.checksum,
                    "steps": p.steps,
                    "tokens": p.tokens,
                    "steps_since_push": p.steps_since_push,
                    "learner_step": p.learner_step,
                    "late": p.id.base < frag.version,
                }
                for p in pushes
            ],
            "decisions": {},
            "superseded": [p.name for p in sel.superseded],
            # the steps a superseded push covered are inside the newer push that replaces it
            "superseded_steps": {p.name: pending[p].steps_since_push for p in sel.superseded},
            "dropped": sel.dropped,
            "consumed": sorted(
                {p.name for p in sel.inputs} | {p.name for p in sel.superseded} | set(sel.dropped)
            ),
            "merge": cfg.merge,
            "aggregate": cfg.aggregate,
            "outlier_ratio": cfg.aggregate_outlier_ratio,
            "outer": {
                "lr": outer.outer_lr,
                "momentum": outer.outer_momentum,
                "nesterov": outer.nesterov,
            },
            "timings": {
                "first_to_quorum_s": to_quorum,
                "grace_s": frag.grace_s,
                "step_s": self.timings.step_s,
                "waited_s": waited,
            },
            "epoch": self.lease.epoch,
            "owner": self.lease.owner,
            "time": time.time(),
        }

    def _adopt(self, frag: FragmentState) -> None:
        """A rival decided this version first: replay its record instead of ours."""
        stored = self.docs.read_merge(frag.index, frag.version + 1)
        log.warning(
            "fragment %d version %d was decided by %s; adopting it",
            frag.index,
            frag.version + 1,
            None if stored is None else stored.get("owner"),
        )
        if stored is None:
            return
        self.apply_record(frag, stored)
        self.stats.adopted_merges += 1
        for p in list(self.inbox.pending):
            if p.name in frag.consumed:
                self.inbox.pending.pop(p)

    def _count(self, frag: FragmentState, record: dict[str, Any], sel: _Selection) -> None:
        decisions = record["decisions"]
        accepted = [e for e in record["inputs"] if decisions[e["push"]]["included"]]
        stats = self.stats
        stats.merges += 1
        stats.inputs += len(accepted)
        stats.rejected += len(record["inputs"]) - len(accepted)
        if len(record["inputs"]) > len(accepted):
            stats.last_rejection = time.time()
        stats.dropped_late += len(sel.dropped)
        stats.carried_late += len(sel.carried)
        stats.superseded += len(sel.superseded)
        stats.steps_merged += sum(int(e["steps_since_push"]) for e in accepted)
        stats.last_merges.append(
            {
                "fragment": frag.index,
                "version": frag.version,
                "learners": sorted(int(e["learner"]) for e in accepted),
                "late": sum(bool(e["late"]) for e in accepted),
                "grace_s": frag.grace_s,
            }
        )
        del stats.last_merges[:-32]

    def _gc(self, frag: FragmentState) -> None:
        try:
            known = [p for p in self.inbox.known if p.fragment == frag.index]
            for p in self.docs.gc(frag.index, frag.version, self.config.keep_rounds, known):
                self.inbox.known.discard(p)
                self.inbox.refused.pop(p, None)
        except OSError as e:  # housekeeping: never fail a merge for it
            log.warning("garbage collection of fragment %d failed: %r", frag.index, e)

    def _combine(
        self,
        record: dict[str, Any],
        pushes: list[Push],
        frag: FragmentState,
        *,
        replay: bool = False,
    ) -> tuple[Tensors, dict[str, Decision]]:
        """Aggregate the record's inputs; a replay combines as the record decided (screening
        norms are not bit-reproducible across machines, the recorded decisions are)."""
        inputs = [
            MergeInput(e["push"], float(e["weight"]), p.decode())
            for e, p in zip(record["inputs"], pushes)
        ]
        if replay:
            decisions = record["decisions"]
            merged = combine_decided(inputs, decisions, record["aggregate"])
        else:
            ratio = record.get("outlier_ratio")  # null in records of an unset ratio: the default
            merged, decisions = aggregate(
                inputs,
                record["aggregate"],
                outlier_ratio=_DEFAULT_OUTLIER_RATIO if ratio is None else float(ratio),
            )
        return merge_pushes(record["merge"], merged, inputs, decisions, frag.mean_only), decisions

    def _publish(self, frag: FragmentState, record: dict[str, Any], merged: Tensors) -> None:
        """Apply the outer step of a decided record and store the new version (put-if-absent:
        a version already stored, e.g. by a predecessor, is read back and used instead)."""
        o = record["outer"]
        params, mom = outer_step(
            frag.params,
            frag.momentum,
            merged,
            lr=float(o["lr"]),
            mu=float(o["momentum"]),
            nesterov=bool(o["nesterov"]),
        )
        v = record["version"]
        if not self.docs.publish_outer(frag.index, v, mom):
            try:
                mom = self.docs.fetch_outer(frag.index, v, frag.reference) or mom
            except CorruptContributionError:  # damaged, or forged in a signed run
                self.docs.repair_outer(frag.index, v, mom)
                self.stats.repaired_states += 1
        if not self.docs.publish_global(frag.index, v, params):
            try:
                params = self.docs.fetch_global(frag.index, v, frag.reference) or params
            except CorruptContributionError:
                self.docs.repair_global(frag.index, v, params)
                self.stats.repaired_states += 1
        frag.params, frag.momentum, frag.version = params, mom, v
        frag.note_consumed(record)
        self.docs.write_heads(self.versions, epoch=self.lease.epoch, owner=self.lease.owner)

    def apply_record(self, frag: FragmentState, record: dict[str, Any]) -> None:
        """Replay a stored decision (recovery, or a rival's record): fetch the pushes it pins,
        aggregate them exactly as it says, step and store."""
        pushes = []
        for entry in record["inputs"]:
            pid = PushId.parse(entry["push"])
            assert pid is not None
            got, _ = self.docs.fetch_push(pid, frag.reference)
            if not isinstance(got, Push) or got.checksum != entry["checksum"]:
                raise CorruptContributionError(
                    f"fragment {frag.index} version {record['version']}: push {pid.name} "
                    + ("is gone" if got is None else "does not match the record's checksum")
                )
            pushes.append(got)
        merged, _ = self._combine(record, pushes, frag, replay=True)
        self._publish(frag, record, merged)
