"""The Decoupled DiLoCo synchronizer: merge each fragment once a quorum has pushed, then step.

One synchronizer is active per run (it holds the lease of exchange/lease.py). It watches the
learners' pushes (exchange/push_store.py) and, for each fragment p at version v:

1. **Quorum**: it waits until ``quorum`` distinct learners have pushed fragment p based on
   version v ("on time"), counting only learners that have not finished, are not dead and have
   not departed (the driver's departure record of a learner whose process failed or fell
   silent, exchange/liveness.py), so such a learner never blocks the run; with fewer such
   learners the quorum shrinks to them.
2. **Grace window**: then it waits ``grace = grace_gamma * max(0, grace_tau * step_time -
   quorum_time - sync_time)`` more seconds for stragglers (Douillard et al. 2026), or not at all once every
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
(`exchange.contribution_screening`), the same rules as the synchronous exchange.

This module is the loop (lease, recovery, discovery, liveness, the end); one fragment's merge
is `fragment_merger.FragmentMerger`, the math `merge_math`, the settings
`diloco/synchronizer_config.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from composer_replication.diloco.decoupled.fragment_merger import (
    FragmentMerger,
    FragmentState,
    Inbox,
    SynchronizerStats,
    Timings,
)
from composer_replication.diloco.decoupled.merge_math import (
    MergeInput,
    aggregate,
    combine_decided,
    ema,
    grace_seconds,
    outer_step,
    push_weight,
    rda,
)
from composer_replication.diloco.synchronizer_config import (
    LATE_POLICIES,
    MERGE_METHODS,
    SynchronizerConfig,
)
from composer_replication.exchange.fencing import FencedError
from composer_replication.exchange.lease import Lease
from composer_replication.exchange.liveness import (
    LEARNER_ROLE,
    read_departure,
    read_liveness,
    write_heartbeat,
)
from composer_replication.exchange.protocol import CorruptContributionError
from composer_replication.exchange.push_store import DecoupledStore, Push, PushId
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.store import Store

__all__ = [
    "LATE_POLICIES",
    "MERGE_METHODS",
    "MergeInput",
    "Synchronizer",
    "SynchronizerConfig",
    "SynchronizerStats",
    "aggregate",
    "combine_decided",
    "grace_seconds",
    "outer_step",
    "push_weight",
    "rda",
]

log = logging.getLogger(__name__)

ROLE = "synchronizer"


class Synchronizer:
    """Run Decoupled DiLoCo's synchronizer on a store (see the module docstring).

    ``run()`` blocks until the run's final versions are written (every learner done) or
    ``stop()`` is called; ``on_merge`` (if given) is called with each merge record written.
    ``keys`` (``[security] sign``): the synchronizer's signing keys; its records and states are
    signed, and pushes, progress documents and records not signed by who may write them are
    refused (recorded under ``decoupled/refused/``).
    """

    def __init__(
        self,
        store: Store,
        config: SynchronizerConfig | None = None,
        *,
        owner: str | None = None,
        on_merge: Callable[[dict[str, Any]], None] | None = None,
        manifest_timeout_s: float = 600.0,
        keys: RunKeys | None = None,
    ) -> None:
        self.config = config or SynchronizerConfig()
        self.store = store
        self.docs = DecoupledStore(store, keys=keys)
        self.lease = Lease(
            store,
            ROLE,
            owner=owner,
            ttl_s=self.config.lease_ttl_s,
            poll_interval_s=min(self.config.poll_interval_s * 2, self.config.lease_ttl_s / 4),
        )
        self.owner = self.lease.owner
        self.manifest_timeout_s = manifest_timeout_s
        self.stats = SynchronizerStats()
        self.inbox = Inbox()
        self.timings = Timings()
        self.merger = FragmentMerger(
            self.config,
            self.docs,
            self.lease,
            stats=self.stats,
            inbox=self.inbox,
            timings=self.timings,
            on_merge=on_merge,
        )
        self.n_learners = 0
        self.finished = False
        self.fenced: str | None = None  # why the store's write guard stopped this synchronizer
        self._stop = threading.Event()
        self._progress: dict[int, dict[str, Any]] = {}
        self._dead: set[int] = set()
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
    def fragments(self) -> list[FragmentState]:
        return self.merger.fragments

    @property
    def versions(self) -> list[int]:
        return self.merger.versions

    def run(self) -> bool:
        """Hold the lease and merge until the run is final (True) or `stop()` (False).

        Raises `FencedError` when the store's write guard (exchange/fencing.py: a driver-run
        synchronizer whose launch the run has been resumed from) refuses a write: it then
        writes nothing more, not even its last heartbeat or the lease's release."""
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
            if self.fenced is not None:
                raise FencedError(self.fenced)
            return False
        except FencedError as e:
            self.fenced = str(e)
            raise
        finally:
            self._stop.set()
            if self._heartbeat_thread is not None:
                self._heartbeat_thread.join(timeout=5)
            if self.fenced is None:
                self._beat(state="done" if self.finished else "running")
            if self.lease.epoch is not None and self.fenced is None:
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
        self.n_learners = self.merger.n_learners = int(manifest["n_learners"])
        self.merger.fragments = []
        self.inbox.clear()
        pushes = self.docs.list_pushes()
        for p, spec in enumerate(manifest["fragments"]):
            bases = [pid.base for pid in pushes if pid.fragment == p]
            self.merger.fragments.append(self._recover_fragment(p, spec, min(bases, default=None)))
        self.docs.write_heads(self.versions, epoch=self.lease.epoch, owner=self.owner)
        log.info(
            "synchronizer %s (epoch %s): resumed at versions %s",
            self.owner,
            self.lease.epoch,
            self.versions,
        )

    def _recover_fragment(
        self, p: int, spec: dict[str, Any], oldest_push: int | None
    ) -> FragmentState:
        ref = DecoupledStore.reference({"fragments": [spec]}, 0)
        # version 0 (the initial weights) is written by the first learner
        while not self._stop.is_set() and 0 not in self.docs.versions(p, "global"):
            self._stop.wait(self.config.poll_interval_s)
        merges = self.docs.versions(p, "merge")
        outers = set(self.docs.versions(p, "outer"))
        candidates = sorted(
            (v for v in self.docs.versions(p, "global") if v == 0 or v in outers), reverse=True
        )
        frag: FragmentState | None = None
        for v in candidates:  # the newest state that is stored completely and reads back fine
            try:
                params = self.docs.fetch_global(p, v, ref)
                mom = {} if v == 0 else self.docs.fetch_outer(p, v, ref)
            except CorruptContributionError as e:
                log.warning("fragment %d version %d unusable (%s); trying an older one", p, v, e)
                continue
            if params is not None and mom is not None:
                frag = FragmentState(p, v, params, mom, ref, list(spec.get("mean_only", [])))
                break
        if frag is None:
            raise CorruptContributionError(f"fragment {p}: no readable stored state")
        # what the stored records consumed: a push based on version b can only be in records
        # after b, so the records after the oldest push still in the store are enough
        first = frag.version if oldest_push is None else min(oldest_push, frag.version)
        signed = self.docs.keys is not None
        for v in (m for m in merges if m > first):
            try:
                record = self.docs.read_merge(p, v)
            except CorruptContributionError as e:
                if signed and v > frag.version:  # not a decision of this run: see below
                    continue
                log.warning("%s; pushes based below %d count as consumed", e, v)
                frag.floor = max(frag.floor, v)
                continue
            if record is not None:
                frag.note_consumed(record)
        for v in (m for m in merges if m > frag.version):  # decided but not yet stored: replay
            if v != frag.version + 1:
                raise CorruptContributionError(f"fragment {p}: merge records jump to {v}")
            try:
                record = self.docs.read_merge(p, v)
            except CorruptContributionError as e:
                if not signed:
                    raise
                # forged or replayed (the refusal is recorded): it decided nothing, and this
                # lease holder is the only one who may write that key
                log.warning("%s; deleting it (this run's synchronizer did not write it)", e)
                self.docs.delete_merge(p, v)
                break
            if record is None:
                raise CorruptContributionError(f"fragment {p}: merge record {v} vanished")
            self.merger.apply_record(frag, record)
            self.stats.recovered_merges += 1
        return frag

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
            self.merger.maybe_merge(frag, flush=all_done, active=self._active_learners())
        if all_done and not any(
            self.inbox.on_time(f) or self.inbox.late(f) for f in self.fragments
        ):
            self._finish()

    def _discover(self) -> None:
        try:
            pids = self.docs.list_pushes()
        except OSError as e:
            log.warning("listing pushes failed: %r", e)
            return
        self.inbox.known = set(pids)
        new = []
        for pid in pids:
            if pid.fragment >= len(self.fragments) or pid in self.inbox.pending:
                continue
            frag = self.fragments[pid.fragment]
            if pid.name in frag.consumed or pid in self.inbox.refused or pid.base < frag.floor:
                continue
            if pid.base > frag.version:
                if pid not in self.inbox.future:
                    self.inbox.future.add(pid)
                    log.warning(
                        "push %s is based on a version this synchronizer has not published (%d)",
                        pid.name,
                        frag.version,
                    )
                    if self.docs.keys is not None:  # signed: a forgery is refused at once
                        self._refuse_if_forged(pid)
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
            self.inbox.pending[pid] = got
            self.inbox.arrived[pid] = now
            if got.step_seconds > 0:
                self.timings.step_s = ema(self.timings.step_s, got.step_seconds, self.config.ema)

    def _refuse_if_forged(self, pid: PushId) -> None:
        """A push based on a version not published yet (signing on): refuse it now if its
        signature does not verify (a forger's, which no merge would ever consume)."""
        got, _ = self._fetch_push(pid)
        if isinstance(got, str):
            self.inbox.future.discard(pid)
            self._refuse(pid, got)

    def _refuse(self, pid: PushId, reason: str) -> None:
        """Refuse a push for good, recorded in the store (`DecoupledStore.write_refusal`)."""
        self.inbox.refused[pid] = reason
        self.stats.refused += 1
        self.stats.last_rejection = time.time()
        self.merger.record_unmerged(pid, reason)

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
            live = read_liveness(
                self.store,
                roles=[LEARNER_ROLE],
                stale_after_s=self.config.stale_after_s,
                dead_after_s=self.config.dead_after_s,
            )
            # the driver's departure records (a learner whose process failed, or silent):
            # left out at once, not after dead_after_s
            departed = {
                i
                for i in range(self.n_learners)
                if read_departure(self.store, LEARNER_ROLE, i) is not None
            }
        except OSError as e:
            log.warning("reading liveness failed: %r", e)
            return
        dead = {int(m.id) for m in live.values() if m.status == "dead" and m.id.isdigit()}
        self._dead = dead | departed

    def _done(self, learner: int) -> bool:
        """The learner said it is done (with at least ``max_steps`` steps, if configured: a
        resumed run's learners still carry the previous attempt's "done")."""
        doc = self._progress.get(learner) or {}
        need = self.config.max_steps
        return bool(doc.get("done")) and (need is None or int(doc.get("step", 0)) >= need)

    def _active_learners(self) -> set[int]:
        """Learners that may still push: not done and not dead."""
        return {i for i in range(self.n_learners) if not self._done(i) and i not in self._dead}

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
        learners = {
            i: int((self._progress.get(i) or {}).get("step", 0)) for i in range(self.n_learners)
        }
        self.docs.write_heads(self.versions, epoch=self.lease.epoch, owner=self.owner)
        self.docs.write_final(self.versions, learners, owner=self.owner, stats=self.stats.as_dict())
        log.info("synchronizer %s: final versions %s", self.owner, self.versions)
        self.finished = True

    # ------------------------------------------------------------------ heartbeats
    def _beat(self, state: str = "running") -> None:
        try:
            write_heartbeat(
                self.store,
                ROLE,
                _member_id(self.owner),
                state=state,
                active=self.lease.held(),
                epoch=self.lease.epoch,
                versions=self.versions,
                step_s=self.timings.step_s,
                quorum_s=self.timings.quorum_s,
                sync_s=self.timings.sync_s,
                stats=self.stats.as_dict(),
            )
        except FencedError as e:  # a newer launch owns the run: stop writing at once
            self.fenced = str(e)
            self._stop.set()
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
                    except FencedError as e:
                        self.fenced = str(e)
                        self._stop.set()
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
