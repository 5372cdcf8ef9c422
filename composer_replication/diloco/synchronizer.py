"""The Decoupled DiLoCo synchronizer: merge each fragment once a quorum has pushed, then step.

One synchronizer is active per run (it holds the lease of exchange/lease.py). It watches the
learners' pushes (exchange/push_store.py) and, for each fragment p at version v:

1. **Quorum**: it waits until ``quorum`` distinct learners have pushed fragment p based on
   version v ("on time"), counting only learners that have not finished and are not dead (so a
   dead learner never blocks the run; with fewer such learners the quorum shrinks to them).
2. **Grace window**: then it waits ``grace = gamma * max(0, tau * step_time - quorum_time -
   sync_time)`` more seconds for stragglers (Douillard et al. 2026), or not at all once every
   unfinished live learner has pushed. ``step_time`` is an EMA of the learners' reported seconds
   per inner step, ``quorum_time`` an EMA of the time from a round's first push to its quorum,
   ``sync_time`` an EMA of how long a merge takes to publish (EMA weight ``ema`` for a new
   sample).
3. **Merge**: each learner's newest on-time push (older ones of the same base are superseded:
   the newest covers their work) is weighted by the work behind it: ``steps`` since the learner
   loaded version v (``weighting="equal"``: equal per step) or ``tokens * tokens / steps``
   (``weighting="tokens"``, the paper's token weighting: tokens times tokens per step). Late
   pushes (based on an older version) are dropped (``late="drop"``) or merged into this round
   (``late="carry"``), never twice: a push is consumed by exactly one record, and a late push of
   a learner whose earlier push at the same base was merged is dropped (its work is in it).
   ``merge="mean"`` is the weighted mean; ``merge="rda"`` radial-directional averaging: the
   weighted mean of the norms times the normalised weighted mean of the directions, per tensor
   (tensors the manifest lists as mean-only, such as embeddings, keep the plain mean).
4. **Outer step**: Nesterov SGD on fragment p's global weights with the merged pseudo-gradient
   (``global - local`` sign, as in sync mode), elementwise in float32 with separately rounded ops.
5. **Publish**: the merge record (put-if-absent: the decision), then the new momentum and global
   weights, then ``heads.json``.

Restarts: a synchronizer starts by acquiring the lease (waiting for a previous holder's TTL),
then rebuilds its state from the store: the newest version of each fragment whose weights and
momentum are stored, then every later merge record replayed (aggregation is a pure function of
the pushes the record pins by checksum). So no committed merge is lost and none is applied twice.
When every learner reports it is done, it merges what is left (no quorum, no grace), writes
``final.json`` and stops. `aggregate` screens and merges through the robust-aggregation module
(`exchange.robust`), the same rules as the synchronous exchange.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_replication.exchange import robust
from composer_replication.exchange.lease import Lease
from composer_replication.exchange.liveness import (
    DEAD_AFTER_S,
    STALE_AFTER_S,
    read_liveness,
    write_heartbeat,
)
from composer_replication.exchange.protocol import CorruptContributionError
from composer_replication.exchange.push_store import DecoupledStore, Push, PushId
from composer_replication.exchange.store import Store

__all__ = [
    "MERGE_METHODS",
    "LATE_POLICIES",
    "MergeInput",
    "Synchronizer",
    "SynchronizerConfig",
    "aggregate",
    "combine_decided",
    "grace_seconds",
    "outer_step",
    "push_weight",
    "rda",
]

log = logging.getLogger(__name__)

MERGE_METHODS = ("mean", "rda")
LATE_POLICIES = ("drop", "carry")
WEIGHTINGS = ("equal", "tokens")
ROLE = "synchronizer"
LEARNER_ROLE = "learner"

Tensors = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- pure math


def grace_seconds(
    gamma: float, tau: float, step_s: float | None, quorum_s: float | None, sync_s: float | None
) -> float:
    """``gamma * max(0, tau * step - quorum - sync)`` (unknown timings count as 0)."""
    return gamma * max(0.0, tau * (step_s or 0.0) - (quorum_s or 0.0) - (sync_s or 0.0))


def _ema(old: float | None, sample: float, weight: float) -> float:
    return sample if old is None else (1.0 - weight) * old + weight * sample


@dataclass
class MergeInput:
    """One contribution handed to the aggregation: an id, its raw weight, its tensors."""

    id: str
    weight: float
    tensors: Tensors


def _weighted_mean(inputs: list[MergeInput], names: Iterable[str]) -> Tensors:
    total = sum(i.weight for i in inputs)
    out: Tensors = {}
    for name in names:
        acc: torch.Tensor | None = None
        for i in inputs:  # fixed order, separately rounded float32 ops
            term = i.tensors[name].to(torch.float32) * (i.weight / total)
            acc = term if acc is None else acc.add(term)
        assert acc is not None
        out[name] = acc
    return out


Decision = dict[str, Any]
"""Per input: ``{"included": bool, "reason": str, "weight": float, "scale": float, "note": str}``
(``weight`` sums to 1 over included inputs; ``scale`` < 1 when norm clipping shrank it)."""


def _decision(included: bool, reason: str = "", weight: float = 0.0, scale: float = 1.0,
              note: str = "") -> Decision:  # fmt: skip
    return {"included": included, "reason": reason, "weight": weight, "scale": scale, "note": note}


def _policy(method: str, outlier_ratio: float | None) -> robust.AggregatePolicy:
    # the inputs' work weights go in as weight claims (capped at the robust default multiple of
    # the round's median claim); no per-step claim bounds: the work is counted by the learners
    if outlier_ratio is None:
        return robust.AggregatePolicy(method=method, weighting="tokens")
    return robust.AggregatePolicy(method=method, weighting="tokens", outlier_ratio=outlier_ratio)


def aggregate(
    inputs: list[MergeInput], method: str = "mean", *, outlier_ratio: float | None = None
) -> tuple[Tensors, dict[str, Decision]]:
    """Screen and merge ``inputs``: (merged tensors, one `Decision` per input id).

    Inputs without work (weight 0) are refused. Every input is screened by the robust-aggregation
    module (``exchange.robust``: non-finite values, norm outliers against the round's median
    unless ``outlier_ratio=0``, weight claims capped against the median) and ``method`` is any of
    its merges (mean, trimmed_mean, median, norm_clip). A robust method with fewer than
    ``robust.MIN_TO_JUDGE`` pushes with work includes none of them. Empty tensors: nothing
    included.
    """
    decisions = {i.id: _decision(False, "no work (weight 0)") for i in inputs if i.weight <= 0}
    work = [i for i in inputs if i.weight > 0]
    if method != "mean" and 0 < len(work) < robust.MIN_TO_JUDGE:
        # A robust merge of one or two pushes cannot leave anyone out (a trimmed mean of two is
        # their mean): merging them would let a byzantine push through whenever a merge is
        # small (the end of a run, dead learners). Their work is dropped instead.
        why = (f"too few pushes for a robust merge ({len(work)} < {robust.MIN_TO_JUDGE}; "
               f"aggregate={method!r})")  # fmt: skip
        decisions.update({i.id: _decision(False, why) for i in work})
        work = []
    if work:
        policy = _policy(method, outlier_ratio)
        top = max(i.weight for i in work)  # integer claims that keep the ratios to 1e-9
        candidates = [robust.Candidate(k, i.tensors, tokens=max(1, round(i.weight / top * 1e9)))
                      for k, i in enumerate(work)]  # fmt: skip
        for d in robust.screen(candidates, policy):
            decisions[work[d.rank].id] = _decision(d.included, d.reason, d.weight if d.included
                                                   else 0.0, d.scale, d.note)  # fmt: skip
    return combine_decided(inputs, decisions, method), decisions


def combine_decided(
    inputs: list[MergeInput], decisions: dict[str, Decision], method: str
) -> Tensors:
    """The merge that ``decisions`` describe (what a replay of a merge record recomputes).

    A pure function of the inputs' tensors and the recorded weights/scales: ``mean`` (and
    ``norm_clip``) is the weighted mean of ``scale * x`` in input order; ``trimmed_mean`` and
    ``median`` are the robust module's coordinate-wise merges. Empty when nothing is included.
    """
    chosen = [i for i in inputs if decisions[i.id]["included"]]
    if not chosen:
        return {}
    candidates = [robust.Candidate(k, i.tensors) for k, i in enumerate(chosen)]
    verdicts = [robust.Decision(rank=k, included=True, weight=decisions[i.id]["weight"],
                                scale=decisions[i.id]["scale"]) for k, i in enumerate(chosen)]  # fmt: skip
    merged: Tensors = robust.combine(candidates, verdicts, _policy(method, None))
    return merged


def rda(inputs: list[MergeInput], mean_only: Iterable[str] = ()) -> Tensors:
    """Radial-directional averaging per tensor: ``(sum w |x| / sum w) * unit(sum w unit(x))``.

    A zero tensor contributes its weight to the norm but no direction; tensors in ``mean_only``
    get the weighted mean. Inputs with weight 0 are ignored.
    """
    accepted = [i for i in inputs if i.weight > 0]
    if not accepted:
        return {}
    names = sorted(accepted[0].tensors)
    plain = set(mean_only)
    out = _weighted_mean(accepted, [n for n in names if n in plain])
    total = sum(i.weight for i in accepted)
    for name in names:
        if name in plain:
            continue
        norm_mean = 0.0
        direction: torch.Tensor | None = None
        for i in accepted:
            x = i.tensors[name].to(torch.float32)
            n = float(torch.linalg.vector_norm(x.double()))
            norm_mean += i.weight * n / total
            unit = x * (1.0 / n) if n > 0 else torch.zeros_like(x)
            term = unit * (i.weight / total)
            direction = term if direction is None else direction.add(term)
        assert direction is not None
        dn = float(torch.linalg.vector_norm(direction.double()))
        out[name] = direction * (norm_mean / dn) if dn > 0 else torch.zeros_like(direction)
    return out


def outer_step(
    params: Tensors, momentum: Tensors, grad: Tensors, *, lr: float, mu: float, nesterov: bool
) -> tuple[Tensors, Tensors]:
    """One outer SGD step (torch.optim.SGD semantics, dampening 0), returning new tensors:

    ``m = mu * m + g``; ``update = g + mu * m`` (Nesterov) or ``m``; ``theta = theta - lr * update``.
    """
    new_p: Tensors = {}
    new_m: Tensors = {}
    for name, theta in params.items():
        g = grad[name].to(torch.float32)
        m = momentum.get(name)
        m = g.clone() if m is None else m.to(torch.float32).mul(mu).add(g)
        update = g.add(m.mul(mu)) if nesterov else m
        new_p[name] = theta.to(torch.float32).sub(update.mul(lr))
        new_m[name] = m
    return new_p, new_m


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class SynchronizerConfig:
    """How the synchronizer merges (see the module docstring; defaults in docs/diloco.md)."""

    quorum: int = 1
    gamma: float = 0.8
    tau: float = 2.0
    merge: str = "mean"
    aggregate: str = "mean"
    outlier_ratio: float | None = None  # norm screening (exchange.robust); None = its default
    weighting: str = "equal"
    late: str = "carry"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    keep: int = 4
    poll_interval_s: float = 0.1
    lease_ttl_s: float = 10.0
    ema: float = 0.2
    stale_after_s: float = STALE_AFTER_S
    dead_after_s: float = DEAD_AFTER_S
    heartbeat_every_s: float = 1.0
    progress_every_s: float = 0.5
    max_steps: int | None = None  # a learner counts as done at "done" with step >= this

    def __post_init__(self) -> None:
        if not isinstance(self.quorum, int) or self.quorum < 1:
            raise ValueError(f"quorum must be an int >= 1, got {self.quorum!r}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma!r}")
        if not self.tau >= 0:
            raise ValueError(f"tau must be >= 0, got {self.tau!r}")
        for key, value, allowed in (("merge", self.merge, MERGE_METHODS),
                                    ("late", self.late, LATE_POLICIES),
                                    ("weighting", self.weighting, WEIGHTINGS)):  # fmt: skip
            if value not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
        if self.merge == "rda" and self.aggregate != "mean":
            raise ValueError("merge='rda' averages directions itself: use aggregate='mean'")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError("need outer_lr > 0 and outer_momentum in [0, 1)")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {self.keep!r}")
        if not 0 < self.ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {self.ema!r}")
        for key in ("poll_interval_s", "lease_ttl_s", "heartbeat_every_s", "progress_every_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0")


# ----------------------------------------------------------------------------- state


@dataclass
class _Fragment:
    """The synchronizer's view of one fragment."""

    index: int
    version: int
    params: Tensors
    momentum: Tensors
    reference: dict[str, tuple[list[int], str]]
    mean_only: list[str]
    consumed: set[str] = field(default_factory=set)
    merged_bases: set[tuple[int, int]] = field(default_factory=set)  # (learner, base) merged
    floor: int = 0  # pushes based below this are consumed (an unreadable record covered them)
    first_at: float | None = None  # monotonic time the round's first on-time push was seen
    quorum_at: float | None = None
    grace_s: float = 0.0


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


class Synchronizer:
    """Run Decoupled DiLoCo's synchronizer on a store (see the module docstring).

    ``run()`` blocks until the run's final versions are written (every learner done) or
    ``stop()`` is called; ``on_merge`` (if given) is called with each merge record written.
    """

    def __init__(
        self,
        store: Store,
        config: SynchronizerConfig | None = None,
        *,
        owner: str | None = None,
        on_merge: Callable[[dict[str, Any]], None] | None = None,
        manifest_timeout_s: float = 600.0,
    ) -> None:
        self.config = config or SynchronizerConfig()
        self.store = store
        self.docs = DecoupledStore(store)
        self.lease = Lease(store, ROLE, owner=owner, ttl_s=self.config.lease_ttl_s,
                           poll_interval_s=min(self.config.poll_interval_s * 2,
                                               self.config.lease_ttl_s / 4))  # fmt: skip
        self.owner = self.lease.owner
        self.on_merge = on_merge
        self.manifest_timeout_s = manifest_timeout_s
        self.stats = SynchronizerStats()
        self.fragments: list[_Fragment] = []
        self.n_learners = 0
        self.finished = False
        self._stop = threading.Event()
        self._pending: dict[PushId, Push] = {}
        self._arrived: dict[PushId, float] = {}
        self._refused: dict[PushId, str] = {}
        self._future: set[PushId] = set()
        self._known: set[PushId] = set()  # every push seen in the newest listing
        self._progress: dict[int, dict[str, Any]] = {}
        self._dead: set[int] = set()
        self._step_s: float | None = None
        self._quorum_s: float | None = None
        self._sync_s: float | None = None
        self._last_progress = 0.0
        self._last_liveness = 0.0
        self._fetcher: ThreadPoolExecutor | None = None
        self._heartbeat_thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public
    def stop(self) -> None:
        """Ask `run` to return at the next poll (thread-safe; the lease is released)."""
        self._stop.set()

    @property
    def versions(self) -> list[int]:
        return [f.version for f in self.fragments]

    def run(self) -> bool:
        """Hold the lease and merge until the run is final (True) or `stop()` (False)."""
        self._start_heartbeats()
        try:
            while not self._stop.is_set():
                if not self.lease.held():
                    try:
                        if not self.activate():
                            break
                    except InterruptedError:
                        break
                    continue
                try:
                    self.poll_once()
                except OSError as e:  # a store hiccup: the next poll retries (state is intact)
                    log.warning("synchronizer %s: store error, retrying: %r", self.owner, e)
                if self.finished:
                    return True
                self._stop.wait(self.config.poll_interval_s)
            return False
        finally:
            self._stop.set()
            if self._heartbeat_thread is not None:
                self._heartbeat_thread.join(timeout=5)
            self._beat(state="done" if self.finished else "running")
            if self.lease.epoch is not None:
                try:
                    self.lease.release()
                except OSError as e:
                    log.warning("releasing the lease failed: %r", e)
            if self._fetcher is not None:
                self._fetcher.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ lease and recovery
    def activate(self) -> bool:
        """Acquire the lease (waiting out a previous holder), then rebuild every fragment's
        state from the store; False if stopped meanwhile. `run` calls it whenever it does not
        hold the lease."""
        log.info("synchronizer %s: waiting for the lease", self.owner)
        if not self.lease.acquire(cancelled=self._stop):
            return False
        self._recover()
        return True

    def _wait_for_manifest(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.manifest_timeout_s
        while True:
            manifest = self.docs.read_manifest()
            if manifest is not None:
                return manifest
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no decoupled manifest at {self.docs.uri} after {self.manifest_timeout_s}s: "
                    "start the learners (they write it)"
                )
            if self._stop.wait(self.config.poll_interval_s):
                raise InterruptedError("stopped while waiting for the manifest")

    def _recover(self) -> None:
        """Rebuild every fragment's state from the store (see the module docstring)."""
        manifest = self._wait_for_manifest()
        self.n_learners = int(manifest["n_learners"])
        self.fragments = []
        self._pending.clear()
        self._arrived.clear()
        self._refused.clear()
        self._future.clear()
        pushes = self.docs.list_pushes()
        for p, spec in enumerate(manifest["fragments"]):
            bases = [pid.base for pid in pushes if pid.fragment == p]
            self.fragments.append(self._recover_fragment(p, spec, min(bases, default=None)))
        self.docs.write_heads(self.versions, epoch=self.lease.epoch, owner=self.owner)
        log.info("synchronizer %s (epoch %s): resumed at versions %s", self.owner,
                 self.lease.epoch, self.versions)  # fmt: skip

    def _recover_fragment(self, p: int, spec: dict[str, Any], oldest_push: int | None) -> _Fragment:
        ref = DecoupledStore.reference({"fragments": [spec]}, 0)
        # version 0 (the initial weights) is written by the first learner
        while not self._stop.is_set() and 0 not in self.docs.versions(p, "global"):
            self._stop.wait(self.config.poll_interval_s)
        merges = self.docs.versions(p, "merge")
        outers = set(self.docs.versions(p, "outer"))
        candidates = sorted(
            (v for v in self.docs.versions(p, "global") if v == 0 or v in outers), reverse=True
        )
        frag: _Fragment | None = None
        for v in candidates:  # the newest state that is stored completely and reads back fine
            try:
                params = self.docs.fetch_global(p, v, ref)
                mom = {} if v == 0 else self.docs.fetch_outer(p, v, ref)
            except CorruptContributionError as e:
                log.warning("fragment %d version %d unusable (%s); trying an older one", p, v, e)
                continue
            if params is not None and mom is not None:
                frag = _Fragment(p, v, params, mom, ref, list(spec.get("mean_only", [])))
                break
        if frag is None:
            raise CorruptContributionError(f"fragment {p}: no readable stored state")
        # what the stored records consumed: a push based on version b can only be in records
        # after b, so the records after the oldest push still in the store are enough
        first = frag.version if oldest_push is None else min(oldest_push, frag.version)
        for v in (m for m in merges if m > first):
            try:
                record = self.docs.read_merge(p, v)
            except CorruptContributionError as e:
                log.warning("%s; pushes based below %d count as consumed", e, v)
                frag.floor = max(frag.floor, v)
                continue
            if record is not None:
                self._note_consumed(frag, record)
        for v in (m for m in merges if m > frag.version):  # decided but not yet stored: replay
            if v != frag.version + 1:
                raise CorruptContributionError(f"fragment {p}: merge records jump to {v}")
            record = self.docs.read_merge(p, v)
            if record is None:
                raise CorruptContributionError(f"fragment {p}: merge record {v} vanished")
            self._apply_record(frag, record)
            self.stats.recovered_merges += 1
        return frag

    @staticmethod
    def _note_consumed(frag: _Fragment, record: dict[str, Any]) -> None:
        frag.consumed.update(record["consumed"])
        for entry in record["inputs"]:
            pid = PushId.parse(entry["push"])
            if pid is not None and (record["decisions"].get(entry["push"]) or {}).get("included"):
                frag.merged_bases.add((pid.learner, pid.base))

    # ------------------------------------------------------------------ one poll
    def poll_once(self) -> None:
        """Discover pushes, refresh learners' progress/liveness, merge what is due."""
        self._discover()
        now = time.monotonic()
        if now - self._last_progress >= self.config.progress_every_s:
            self._refresh_progress()
            self._last_progress = now
        if now - self._last_liveness >= 2 * self.config.heartbeat_every_s:
            self._refresh_liveness()
            self._last_liveness = now
        all_done = self.n_learners > 0 and all(self._done(i) for i in range(self.n_learners))
        if all_done:
            self._refresh_progress()  # final pushes are written before "done": look again
            self._discover()
        for frag in self.fragments:
            if self._stop.is_set():
                return
            self._maybe_merge(frag, flush=all_done)
        if all_done and not any(self._on_time(f) or self._late(f) for f in self.fragments):
            self._finish()

    def _discover(self) -> None:
        try:
            pids = self.docs.list_pushes()
        except OSError as e:
            log.warning("listing pushes failed: %r", e)
            return
        self._known = set(pids)
        new = []
        for pid in pids:
            if pid.fragment >= len(self.fragments) or pid in self._pending:
                continue
            frag = self.fragments[pid.fragment]
            if pid.name in frag.consumed or pid in self._refused or pid.base < frag.floor:
                continue
            if pid.base > frag.version:
                if pid not in self._future:
                    self._future.add(pid)
                    log.warning("push %s is based on a version this synchronizer has not "
                                "published (%d)", pid.name, frag.version)  # fmt: skip
                continue
            new.append(pid)
        if not new:
            return
        if self._fetcher is None:
            workers = 1 if self.store.is_local else 8
            self._fetcher = ThreadPoolExecutor(workers, thread_name_prefix="sync-fetch")
        now = time.monotonic()
        for pid, (got, _) in zip(new, self._fetcher.map(self._fetch_push, new)):
            if got is None:
                continue  # deleted meanwhile
            if isinstance(got, str):
                log.warning("refusing %s", got)
                self._refuse(pid, got)
                continue
            if self.config.weighting == "tokens" and got.tokens is None:
                self._refuse(pid, f"push {pid.name}: no token count for weighting='tokens'")
                continue
            self._pending[pid] = got
            self._arrived[pid] = now
            if got.step_seconds > 0:
                self._step_s = _ema(self._step_s, got.step_seconds, self.config.ema)

    def _refuse(self, pid: PushId, reason: str) -> None:
        """Refuse a push for good, recorded in the store (`DecoupledStore.write_refusal`)."""
        self._refused[pid] = reason
        self.stats.refused += 1
        self.stats.last_rejection = time.time()
        self._record_unmerged(pid, reason)

    def _record_unmerged(self, pid: PushId, reason: str) -> None:
        """Record a push consumed without a merge record naming it (refused, or dropped when no
        merge happens), so that an audit can account for every push written."""
        try:
            self.docs.write_refusal(pid, reason)
        except OSError as e:  # housekeeping: the decision stands either way
            log.warning("recording why %s was not merged failed: %r", pid.name, e)

    def _fetch_push(self, pid: PushId) -> tuple[Push | str | None, int]:
        return self.docs.fetch_push(pid, self.fragments[pid.fragment].reference)

    def _refresh_progress(self) -> None:
        for i in range(self.n_learners):
            try:
                doc = self.docs.read_progress(i)
            except OSError:
                continue
            if doc is not None:
                self._progress[i] = doc

    def _refresh_liveness(self) -> None:
        try:
            live = read_liveness(self.store, roles=[LEARNER_ROLE],
                                 stale_after_s=self.config.stale_after_s,
                                 dead_after_s=self.config.dead_after_s)  # fmt: skip
        except OSError as e:
            log.warning("reading liveness failed: %r", e)
            return
        self._dead = {int(m.id) for m in live.values() if m.status == "dead" and m.id.isdigit()}

    def _done(self, learner: int) -> bool:
        """The learner said it is done (with at least ``max_steps`` steps, if configured: a
        resumed run's learners still carry the previous attempt's "done")."""
        doc = self._progress.get(learner) or {}
        need = self.config.max_steps
        return bool(doc.get("done")) and (need is None or int(doc.get("step", 0)) >= need)

    def _active_learners(self) -> set[int]:
        """Learners that may still push: not done and not dead."""
        return {i for i in range(self.n_learners) if not self._done(i) and i not in self._dead}

    # ------------------------------------------------------------------ merging
    def _on_time(self, frag: _Fragment) -> dict[int, list[PushId]]:
        """learner -> its pending pushes based on the fragment's current version (oldest first)."""
        out: dict[int, list[PushId]] = {}
        for pid in sorted(self._pending):
            if pid.fragment == frag.index and pid.base == frag.version:
                out.setdefault(pid.learner, []).append(pid)
        return out

    def _late(self, frag: _Fragment) -> list[PushId]:
        return sorted(
            p for p in self._pending if p.fragment == frag.index and p.base < frag.version
        )

    def _maybe_merge(self, frag: _Fragment, *, flush: bool) -> None:
        on_time = self._on_time(frag)
        late = self._late(frag)
        if not on_time and not (flush and late):
            frag.first_at = frag.quorum_at = None
            return
        now = time.monotonic()
        if on_time:
            first = min(self._arrived[p] for ps in on_time.values() for p in ps)
            frag.first_at = first if frag.first_at is None else min(frag.first_at, first)
        if not flush:
            active = self._active_learners()
            quorum = max(1, min(self.config.quorum, len(active) or 1))
            if len(on_time) < quorum:
                return
            if frag.quorum_at is None:
                frag.quorum_at = now
                frag.grace_s = grace_seconds(self.config.gamma, self.config.tau, self._step_s,
                                             self._quorum_s, self._sync_s)  # fmt: skip
            everyone = active <= set(on_time)
            if not everyone and now - frag.quorum_at < frag.grace_s:
                return
        self._merge(frag, on_time, late, now)

    def _merge(
        self, frag: _Fragment, on_time: dict[int, list[PushId]], late: list[PushId], now: float
    ) -> None:
        cfg = self.config
        inputs: list[PushId] = []
        superseded: list[PushId] = []
        dropped: dict[str, str] = {}
        for pids in on_time.values():
            inputs.append(pids[-1])
            superseded += pids[:-1]
        newest_late: dict[tuple[int, int], PushId] = {}
        for pid in late:  # ascending: the last one per (learner, base) is the newest
            if cfg.late == "drop":
                dropped[pid.name] = f"late: version {pid.base + 1} was already merged"
            elif pid.base < frag.version - cfg.keep:
                dropped[pid.name] = f"too stale: based on {pid.base}, now {frag.version}"
            elif (pid.learner, pid.base) in frag.merged_bases:
                dropped[pid.name] = (f"learner {pid.learner} already had a push based on "
                                     f"{pid.base} merged (its work is in it)")  # fmt: skip
            else:
                old = newest_late.get((pid.learner, pid.base))
                if old is not None:
                    superseded.append(old)
                newest_late[(pid.learner, pid.base)] = pid
        carried = sorted(newest_late.values())
        inputs = sorted(inputs) + carried
        if not inputs:
            # only late pushes to drop: consume them without a new version (recorded, as no
            # merge record will name them)
            for pid in late:
                if pid.name in dropped:
                    self._record_unmerged(pid, f"dropped: {dropped[pid.name]}")
            for name in dropped:
                frag.consumed.add(name)
            for pid in late:
                self._pending.pop(pid, None)
            self.stats.dropped_late += len(dropped)
            return
        pushes = [self._pending[p] for p in inputs]
        record: dict[str, Any] = {
            "format": 1, "kind": "merge", "fragment": frag.index, "version": frag.version + 1,
            "base_version": frag.version,
            "inputs": [{
                "push": p.id.name, "learner": p.id.learner, "base": p.id.base,
                "weight": push_weight(p, cfg.weighting), "checksum": p.checksum, "steps": p.steps,
                "tokens": p.tokens, "steps_since_push": p.steps_since_push,
                "learner_step": p.learner_step, "late": p.id.base < frag.version,
            } for p in pushes],
            "decisions": {},
            "superseded": [p.name for p in superseded],
            # the steps a superseded push covered are inside the newer push that replaces it
            "superseded_steps": {p.name: self._pending[p].steps_since_push for p in superseded},
            "dropped": dropped,
            "consumed": sorted({p.name for p in inputs} | {p.name for p in superseded}
                               | set(dropped)),
            "merge": cfg.merge, "aggregate": cfg.aggregate, "outlier_ratio": cfg.outlier_ratio,
            "outer": {"lr": cfg.outer_lr, "momentum": cfg.outer_momentum,
                      "nesterov": cfg.nesterov},
            "timings": {
                "first_to_quorum_s": None if frag.quorum_at is None or frag.first_at is None
                else frag.quorum_at - frag.first_at,
                "grace_s": frag.grace_s, "step_s": self._step_s,
                "waited_s": None if frag.first_at is None else now - frag.first_at,
            },
            "epoch": self.lease.epoch, "owner": self.owner, "time": time.time(),
        }  # fmt: skip
        t0 = time.monotonic()
        merged, decisions = self._combine(record, pushes, frag)
        record["decisions"] = decisions
        if not merged:  # every input refused: consume them, no new version (recorded)
            log.warning("fragment %d: every input refused (%s)", frag.index, decisions)
            why = {**{k: f"dropped: {v}" for k, v in dropped.items()},
                   **{p.name: "superseded by a push that was refused" for p in superseded},
                   **{k: f"refused by the merge: {(d or {}).get('reason', d)}"
                      for k, d in decisions.items()}}  # fmt: skip
            for pid in inputs + superseded + late:
                if pid.name in record["consumed"]:
                    self._record_unmerged(pid, why.get(pid.name, "refused by the merge"))
            frag.consumed.update(record["consumed"])
            for p in inputs + superseded + late:
                self._pending.pop(p, None)
            self.stats.rejected += len(inputs)
            return
        if not self.lease.held() or not self.lease.renew():
            log.warning("synchronizer %s lost the lease before merging fragment %d", self.owner,
                        frag.index)  # fmt: skip
            return
        if not self.docs.write_merge(record):
            stored = self.docs.read_merge(frag.index, frag.version + 1)
            log.warning("fragment %d version %d was decided by %s; adopting it", frag.index,
                        frag.version + 1, None if stored is None else stored.get("owner"))  # fmt: skip
            if stored is None:
                return
            self._apply_record(frag, stored)
            self.stats.adopted_merges += 1
            for p in list(self._pending):
                if p.name in frag.consumed:
                    self._pending.pop(p)
            return
        self._publish(frag, record, merged)
        self._sync_s = _ema(self._sync_s, time.monotonic() - t0, cfg.ema)
        if frag.quorum_at is not None and frag.first_at is not None:
            self._quorum_s = _ema(self._quorum_s, frag.quorum_at - frag.first_at, cfg.ema)
        for p in inputs + superseded + late:
            self._pending.pop(p, None)
            self._arrived.pop(p, None)
        frag.first_at = frag.quorum_at = None
        if frag.version % cfg.keep == 0:  # housekeeping every `keep` merges of the fragment
            self._gc(frag)
        accepted = [e for e in record["inputs"] if decisions[e["push"]]["included"]]
        self.stats.merges += 1
        self.stats.inputs += len(accepted)
        self.stats.rejected += len(record["inputs"]) - len(accepted)
        if len(record["inputs"]) > len(accepted):
            self.stats.last_rejection = time.time()
        self.stats.dropped_late += len(dropped)
        self.stats.carried_late += len(carried)
        self.stats.superseded += len(superseded)
        self.stats.steps_merged += sum(int(e["steps_since_push"]) for e in accepted)
        self.stats.last_merges.append({
            "fragment": frag.index, "version": frag.version,
            "learners": sorted(int(e["learner"]) for e in accepted),
            "late": sum(bool(e["late"]) for e in accepted), "grace_s": frag.grace_s,
        })  # fmt: skip
        del self.stats.last_merges[:-32]
        if self.on_merge is not None:
            self.on_merge(record)

    def _gc(self, frag: _Fragment) -> None:
        try:
            known = [p for p in self._known if p.fragment == frag.index]
            for p in self.docs.gc(frag.index, frag.version, self.config.keep, known):
                self._known.discard(p)
                self._refused.pop(p, None)
        except OSError as e:  # housekeeping: never fail a merge for it
            log.warning("garbage collection of fragment %d failed: %r", frag.index, e)

    def _combine(
        self, record: dict[str, Any], pushes: list[Push], frag: _Fragment, *, replay: bool = False
    ) -> tuple[Tensors, dict[str, Decision]]:
        """Aggregate the record's inputs; a replay combines as the record decided (screening
        norms are not bit-reproducible across machines, the recorded decisions are)."""
        inputs = [MergeInput(e["push"], float(e["weight"]), p.decode())
                  for e, p in zip(record["inputs"], pushes)]  # fmt: skip
        if replay:
            decisions = record["decisions"]
            merged = combine_decided(inputs, decisions, record["aggregate"])
        else:
            merged, decisions = aggregate(inputs, record["aggregate"],
                                          outlier_ratio=record.get("outlier_ratio"))  # fmt: skip
        if merged and record["merge"] == "rda":
            chosen = [MergeInput(i.id, decisions[i.id]["weight"], i.tensors)
                      for i in inputs if decisions[i.id]["included"]]  # fmt: skip
            merged = rda(chosen, frag.mean_only)
        return merged, decisions

    def _publish(self, frag: _Fragment, record: dict[str, Any], merged: Tensors) -> None:
        """Apply the outer step of a decided record and store the new version (put-if-absent:
        a version already stored, e.g. by a predecessor, is read back and used instead)."""
        o = record["outer"]
        params, mom = outer_step(frag.params, frag.momentum, merged, lr=float(o["lr"]),
                                 mu=float(o["momentum"]), nesterov=bool(o["nesterov"]))  # fmt: skip
        v = record["version"]
        if not self.docs.publish_outer(frag.index, v, mom):
            mom = self.docs.fetch_outer(frag.index, v, frag.reference) or mom
        if not self.docs.publish_global(frag.index, v, params):
            try:
                params = self.docs.fetch_global(frag.index, v, frag.reference) or params
            except CorruptContributionError:
                self.docs.repair_global(frag.index, v, params)
                self.stats.repaired_states += 1
        frag.params, frag.momentum, frag.version = params, mom, v
        self._note_consumed(frag, record)
        self.docs.write_heads(self.versions, epoch=self.lease.epoch, owner=self.owner)

    def _apply_record(self, frag: _Fragment, record: dict[str, Any]) -> None:
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

    # ------------------------------------------------------------------ the end
    def _finish(self) -> None:
        """Every learner is done and nothing is pending: verify and publish the final state."""
        for frag in self.fragments:
            try:
                ok = self.docs.fetch_global(frag.index, frag.version, frag.reference) is not None
            except CorruptContributionError as e:
                log.warning("final state of fragment %d is corrupt (%s): repairing", frag.index, e)
                ok = False
            if not ok:
                self.docs.repair_global(frag.index, frag.version, frag.params)
                self.stats.repaired_states += 1
        learners = {i: int((self._progress.get(i) or {}).get("step", 0))
                    for i in range(self.n_learners)}  # fmt: skip
        self.docs.write_heads(self.versions, epoch=self.lease.epoch, owner=self.owner)
        self.docs.write_final(self.versions, learners, owner=self.owner, stats=self.stats.as_dict())
        log.info("synchronizer %s: final versions %s", self.owner, self.versions)
        self.finished = True

    # ------------------------------------------------------------------ heartbeats
    def _beat(self, state: str = "running") -> None:
        try:
            write_heartbeat(
                self.store, ROLE, _member_id(self.owner), state=state,
                active=self.lease.held(), epoch=self.lease.epoch, versions=self.versions,
                step_s=self._step_s, quorum_s=self._quorum_s, sync_s=self._sync_s,
                stats=self.stats.as_dict(),
            )  # fmt: skip
        except (OSError, ValueError) as e:
            log.warning("heartbeat failed: %r", e)

    def _start_heartbeats(self) -> None:
        def loop() -> None:
            renew_every = self.config.lease_ttl_s * self.lease.safety / 3
            last_renew = 0.0
            while not self._stop.is_set():
                self._beat()
                now = time.monotonic()
                if self.lease.epoch is not None and now - last_renew >= renew_every:
                    try:
                        self.lease.renew()
                    except OSError as e:
                        log.warning("lease renewal failed: %r", e)
                    last_renew = now
                self._stop.wait(min(self.config.heartbeat_every_s, renew_every))

        self._heartbeat_thread = threading.Thread(target=loop, name="sync-heartbeat", daemon=True)
        self._heartbeat_thread.start()


def _member_id(owner: str) -> str:
    """A heartbeat id from the lease owner (heartbeat ids allow [A-Za-z0-9_.-], 64 chars)."""
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in owner)
    return cleaned[:64] or "synchronizer"


def push_weight(push: Push, weighting: str) -> float:
    """The raw merge weight of a push: 0 without work; ``steps`` (``"equal"``: equal per step)
    or ``tokens * tokens / steps`` (``"tokens"``: tokens times tokens per step)."""
    if push.steps <= 0:
        return 0.0
    if weighting == "tokens":
        tokens = float(push.tokens or 0)
        return tokens * tokens / push.steps
    return float(push.steps)
