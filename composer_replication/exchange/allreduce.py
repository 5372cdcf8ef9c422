"""ObjectStoreAllReduce: average pseudo-gradients of N replicas that meet only in a bucket.

Each step, every replica uploads one immutable contribution (put-if-absent), downloads and
validates the others', and then obeys the step's single commit record: the first replica that
sees all ``world_size`` contributions settled (or, after ``timeout_s``, at least
``min_replicas`` valid ones) writes it with put-if-absent; everybody, including replicas that
were too late to be listed, aggregates exactly the listed contributions in rank order in float32.
That makes the result bit-identical on every replica (docs/object-store.md explains why).

Before committing, the committer screens the contributions it saw
(exchange/contribution_screening.py: inconsistent token claims, non-finite values, norm outliers
against the round's median, and optionally a loss probe) and records every decision in the commit
record, which also names the merge (``mean``, ``trimmed_mean``, ``median``, ``norm_clip``); readers
replay exactly that. The committer lists its own contribution from memory; with
``verify_own_upload`` it reads it back from the store first (one download more per committed
step) and leaves out an upload that rotted or was overwritten there, which would otherwise fail
the step's merge on every reader. A listed contribution a reader cannot read or verify raises
`ListedContributionError` (nothing is averaged; `ObjectStoreManager` adopts the round's
published state instead of retrying it).

Each rank's objects of a step go under keys only its writer uses: with the run's slot secret
(``slot_secret``, the same on every rank; the run driver hands one out per run) the key of rank
r's upload for step s ends in ``HMAC(secret, r:s)`` (`slot`), which nobody without the secret can
predict before the rank writes, and readers only ever read the key of the writer they expect
for that rank. An object planted anywhere else (a copy of an earlier contribution, a foreign
writer id) is never read, so it cannot displace the honest upload (Templar gives each peer its
own bucket; this is the same guarantee in one bucket). A contribution that is refused (bad
header, non-finite, wrong writer, failed signature, screened out) counts as that rank's absence
for the round: the round commits without it when ``min_replicas`` others are valid.

Within its slot, a slot holds only what its rank wrote: every upload carries a writer id (an HMAC of the step under
the rank's writer secret, so nobody without the secret can predict it, while a restarted
incarnation of the rank given the same secret recognises its earlier upload); in unsigned runs
the rank confirms its slot with ``owner/<rank>.json`` (and a slot nobody confirmed is never
committed), and a rank that finds its slot taken by an object it did not write reports it in
``squat/<rank>.json`` so the round excludes it. With signing on (``keys``), every contribution
and commit record is signed and anything unsigned or mis-signed is refused outright.

A rank the run driver declared departed (``departed/replica/<rank>.json``, exchange/liveness.py:
its process exited for good, or it is being restarted) is not waited for: the step counts as
ready once every other rank's slot is judged, so survivors with ``min_replicas`` valid
contributions commit at once instead of waiting ``timeout_s`` (a departed rank's contribution
still counts if it is there). Departures never make a step fail early: when the others are
fewer than ``min_replicas`` they wait as before (a rank being restarted may come back in time). The departure records of missing ranks are read by key, at the first poll for
ranks already known to be departed and then at most once per ``departure_poll_s``.

``fence`` (a callable, e.g. `fencing.Fence`) is called before this rank writes anything of a
step (its contribution, and again before a commit record): it raises when a newer launch of the
run has taken over, and the step stops before the write.

A steady-state round sends no LIST request: ranks are polled by key (``requests`` in
`StepResult` counts what one call sent). Timeouts are ordered: ``upload_timeout_s < timeout_s <
run_timeout_s``. ``cancel()`` aborts any wait. Nothing read from the store is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from composer_replication.exchange import checksums, codecs, rules
from composer_replication.exchange.contribution_screening import (
    Candidate,
    Decision,
    LossProbe,
    TensorStats,
    merge_weights,
    screen,
    tensor_stats,
)
from composer_replication.exchange.document_format import model_fingerprint
from composer_replication.exchange.liveness import REPLICA_ROLE, read_departure
from composer_replication.exchange.merge_arithmetic import average_in_rank_order, check_inputs
from composer_replication.exchange.protocol import (
    HEAD_KEY,
    Encoding,
    commit_key,
    contrib_key,
    decode_contribution,
    encode_contribution,
    make_commit,
    owner_key,
    parse_commit,
    squat_key,
    step_keys,
)
from composer_replication.exchange.retry import retry_write
from composer_replication.exchange.run_documents import RunDocuments
from composer_replication.exchange.settings import AllReduceConfig
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.store import ObjectStore, Store
from composer_replication.exchange.vocabulary import (
    CommitRecord,
    Contribution,
    CorruptContributionError,
    ExchangeCancelledError,
    ListedContributionError,
    ModelMismatchError,
    QuorumLostError,
    StepResult,
    StoreTimeoutError,
    UpdateRefusedError,
    dtype_name,
)
from composer_replication.exchange.wire import Buffer

__all__ = [
    "ObjectStoreAllReduce",
    "StepResult",
    "StoreTimeoutError",
    "CorruptContributionError",
    "ListedContributionError",
    "ModelMismatchError",
    "ExchangeCancelledError",
    "model_fingerprint",
]

log = logging.getLogger(__name__)


class ObjectStoreAllReduce(RunDocuments):
    """Pseudo-gradient exchange through ``uri``: the store's URI (``file://``, ``memory://``,
    ``s3://``, ``gs://``; with ``storage_options`` for fsspec) or a `store.Store` of it (e.g. a
    `faulty_store.FaultyStore` that injects faults).

    ``rank=None`` gives a driver/observer handle (manifest, states, run documents) that cannot
    call :meth:`allreduce` unless ``world_size == 1`` (a passthrough needs no rank). ``config``:
    the exchange's settings (`settings.AllReduceConfig`: codec, checksum, quorum, aggregation,
    timeouts, retention; None: its defaults). Replicas of one run may use different checksums:
    headers and commit records name the algorithm, and readers verify with it (xxh3-128 needs
    xxhash everywhere). SparseLoCo's payloads describe their own layout, so readers decode
    whatever a peer sent (validated); error feedback is the caller's (``diloco/sparseloco.py``).
    ``loss_probe``: the held-out loss callback a ``screen="loss"`` policy needs. ``keys``: this
    replica's `signing.RunKeys` (signing on: sha256 checksums, everything signed and verified).
    ``writer_secret``: the key of this rank's writer ids (unsigned runs; >= 16 bytes). Give every
    incarnation of a rank the same secret (the run driver keeps one per rank in the run folder)
    so that a restarted rank recognises the upload its earlier incarnation made for a step that
    is not committed yet; None: a random secret per process (a restarted rank then finds that
    slot squatted and sits the step out). ``slot_secret``: the run's slot secret, the same bytes
    (>= 16) on every rank: each rank's keys of a step are derived from it (`slot`, module
    docstring), so a planted object is never read; None: the plain ``contrib/<rank>`` keys, where
    only the owner records tell a planted object from the rank's (and a squatted slot is that
    rank's absence).
    """

    def __init__(
        self,
        uri: str | Store,
        world_size: int = 1,
        rank: int | None = None,
        *,
        config: AllReduceConfig | None = None,
        storage_options: dict[str, object] | None = None,
        keys: RunKeys | None = None,
        writer_secret: bytes | None = None,
        slot_secret: bytes | None = None,
        loss_probe: LossProbe | None = None,
        fence: Callable[[], None] | None = None,
    ) -> None:
        config = AllReduceConfig() if config is None else config
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if rank is not None and (not isinstance(rank, int) or not 0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        min_replicas = world_size if config.min_replicas is None else config.min_replicas
        if not 1 <= min_replicas <= world_size:
            raise ValueError(f"min_replicas must be in [1, {world_size}], got {min_replicas!r}")
        policy = config.policy()
        if policy.screen == "loss" and loss_probe is None:
            raise ValueError("a screen='loss' policy needs loss_probe=<held-out loss callback>")
        checksum = config.checksum
        if keys is not None and checksum not in (None, "sha256"):
            raise ValueError(f"signing needs sha256 checksums; checksum={checksum!r} given")
        for name, secret in (("writer_secret", writer_secret), ("slot_secret", slot_secret)):
            if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
                raise ValueError(
                    f"{name} must be bytes of length >= 16 (e.g. os.urandom(32)), or None"
                )
        store = ObjectStore(uri, storage_options) if isinstance(uri, str) else uri
        if store is uri and storage_options:
            raise ValueError(
                "storage_options configure the store built from a URI; a Store given has its own"
            )
        super().__init__(
            store,
            world_size=world_size,
            codec=codecs.check_codec(config.codec),
            keep_steps=config.keep_rounds,
            poll_interval_s=float(config.poll_interval_s),
            keys=keys,
            mac_secret=slot_secret,
        )
        self.config = config
        self.rank = rank
        self.sparse = config.sparse if config.sparse is not None else codecs.SparseSpec()
        self._codec = codecs.configured(self.codec, self.sparse)  # what this replica sends
        # what this replica writes; readers verify whatever algorithm each header names
        if keys is not None:
            checksum = "sha256"  # xxh3-128 is not collision resistant: a signature must bind
        self.checksum = (
            checksums.default_checksum() if checksum is None else checksums.check_checksum(checksum)
        )
        self.policy = policy
        self.loss_probe = loss_probe
        self.timeout_s = float(config.timeout_s)
        # how long the others wait for the lowest valid rank's commit record before committing
        self.commit_grace_s = min(self.timeout_s / 4, max(5.0, 50 * self.poll_interval_s))
        self.upload_timeout_s = float(config.upload_s)
        self.run_timeout_s = config.run_timeout_s
        self.min_replicas = min_replicas
        self.weighting = policy.weighting
        self.last_result: StepResult | None = None
        # writer ids: HMAC(step) under this secret; the same secret across a rank's incarnations
        # lets a restart recognise its earlier upload of a step not committed yet
        self._writer_secret = os.urandom(32) if writer_secret is None else writer_secret
        self._slot_secret = slot_secret
        run_timeout_s = config.run_timeout_s
        self._run_deadline = None if run_timeout_s is None else time.monotonic() + run_timeout_s
        self._uploader: ThreadPoolExecutor | None = None
        self._fetcher: ThreadPoolExecutor | None = None
        self.departure_poll_s = float(config.departure_poll_s)
        self.fence = fence
        # ranks seen departed at an earlier step: checked at the first poll of the next ones
        self._known_departed: set[int] = set()
        self._refused_hints: set[str] = set()
        self._known_commits: set[int] = set()  # steps whose commit record this handle parsed

    def writer_id(self, step: int) -> str:
        """The writer id this rank puts in its upload for ``step`` (and in its owner record)."""
        mac = hmac.new(self._writer_secret, f"{self.rank}:{step}".encode(), hashlib.sha256)
        return mac.hexdigest()[:32]

    def slot(self, step: int, rank: int) -> str:
        """The per-writer part of rank ``rank``'s keys for ``step`` ("" without a slot
        secret: the plain keys)."""
        if self._slot_secret is None:
            return ""
        mac = hmac.new(self._slot_secret, f"slot:{rank}:{step}".encode(), hashlib.sha256)
        return mac.hexdigest()[:32]

    def __repr__(self) -> str:
        return (
            f"ObjectStoreAllReduce(uri={self.uri!r}, world_size={self.world_size}, "
            f"rank={self.rank}, codec={self.codec!r})"
        )

    def close(self) -> None:
        """Stop this handle's upload/fetch threads (an upload still running is abandoned)."""
        for ex in (self._uploader, self._fetcher):
            if ex is not None:
                ex.shutdown(wait=False, cancel_futures=True)
        self._uploader = self._fetcher = None

    def __enter__(self) -> ObjectStoreAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cancel(self) -> None:
        """Abort the current and future waits with ExchangeCancelledError (thread-safe)."""
        self.cancelled.set()

    # ------------------------------------------------------------------ exchange
    def allreduce(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        step: int,
        tokens: int | None = None,
        inner_steps: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Average ``tensors`` over the contributions listed in ``step``'s commit record.

        Returns a new dict with the same names, shapes, dtypes and devices; the values are
        bit-identical on every replica. ``tokens`` is required with ``weighting='tokens'``.
        Raises StoreTimeoutError (who is missing, which timeout), ListedContributionError (a
        CorruptContributionError: the step is committed but lists an object this replica cannot
        read or verify; nothing is averaged), CorruptContributionError (e.g. a malformed commit
        record), QuorumLostError (every rank is
        judged and fewer than ``min_replicas`` are valid: the step can never commit) or
        ExchangeCancelledError.
        """
        check_inputs(tensors, step, tokens, inner_steps, self.weighting)
        start = time.monotonic()
        before = self.store.requests.snapshot()
        if self.world_size == 1:
            self.last_result = StepResult(step, [0], [], {0: 1.0}, 0, 0, 0.0, self.codec, 0)
            if self._codec.needs_error_feedback:  # the "average" of one replica is its message
                return {n: self._round_trip(t) for n, t in tensors.items()}
            return dict(tensors)
        if self.rank is None:
            raise ValueError(
                "this ObjectStoreAllReduce is a driver handle (rank=None); construct it with "
                "rank=<this replica's index> to call allreduce()"
            )
        result, commit, nbytes_up, nbytes_down, own_squat, phases = self._exchange(
            tensors, step, tokens, inner_steps
        )
        included = commit["included_ranks"]
        if commit.get("committed_by") == self.rank:
            self._gc(step)
        rejected = dict(commit["excluded"])
        if own_squat is not None:
            rejected[self.rank] = own_squat + (
                " (committed before this rank arrived: included anyway)"
                if self.rank in included
                else ""
            )
        self.last_result = StepResult(
            step=step,
            included_ranks=list(included),
            excluded_ranks=[r for r in range(self.world_size) if r not in included],
            weights=dict(commit["weights"]),
            bytes_uploaded=nbytes_up,
            bytes_downloaded=nbytes_down,
            seconds=time.monotonic() - start,
            codec=self.codec,
            committed_by=commit.get("committed_by"),
            rejected=rejected,
            aggregate=str(commit.get("aggregate", "mean")),
            requests=self.store.requests.since(before),
            upload_seconds=phases[0],
            wait_seconds=phases[1],
            merge_seconds=phases[2],
        )
        return result

    def _round_trip(self, t: torch.Tensor) -> torch.Tensor:
        """What a lone replica's message decodes to (shape, dtype, device of t)."""
        flat = torch.empty(t.numel(), dtype=torch.float32)
        self._codec.decode_into(self._codec.encode(t), flat)
        return flat.view(t.shape).to(dtype=t.dtype, device=t.device)

    def _check_cancel_and_run(self, step: int) -> None:
        if self.cancelled.is_set():
            raise ExchangeCancelledError(f"step {step}: exchange cancelled")
        if self._run_deadline is not None and time.monotonic() > self._run_deadline:
            raise StoreTimeoutError(
                f"step {step}: run_timeout_s={self.run_timeout_s} exceeded (rank {self.rank})"
            )

    def _upload(self, step: int, payload: list[Buffer], nbytes: int) -> bool:
        """put-if-absent our contribution within upload_timeout_s; False if one was there."""
        assert self.rank is not None
        if self._uploader is None:
            self._uploader = ThreadPoolExecutor(1, thread_name_prefix="store-upload")
        uploader = self._uploader
        key = contrib_key(step, self.rank, self.slot(step, self.rank))

        def put(seconds_left: float) -> bool:
            fut = uploader.submit(self.store.put_if_absent, key, payload)
            try:
                return fut.result(timeout=seconds_left)
            except FutureTimeout:
                raise StoreTimeoutError(
                    f"step {step}: rank {self.rank}'s upload of {nbytes} bytes did not finish "
                    f"within upload_timeout_s={self.upload_timeout_s} (to {self.uri})"
                ) from None

        return self._write_retrying(step, f"upload of {nbytes} bytes to {self.uri}", put)

    def _write_retrying(self, step: int, what: str, put: Callable[[float], bool]) -> bool:
        """``put(seconds left)``, a put-if-absent of ours, retried through a spell of store
        errors (the bucket read-only or full for a while) for up to upload_timeout_s, then a
        `StoreTimeoutError`: the step fails loudly and is retried next round. Safe to repeat:
        a try whose answer was lost finds our own object (`_claim_existing_slot`,
        `_confirm_slot`)."""
        return retry_write(
            put,
            what=f"step {step}: rank {self.rank}'s {what}",
            within_s=self.upload_timeout_s,
            first_s=self.poll_interval_s,
            between=lambda: self._check_cancel_and_run(step),
        )

    def _exchange(
        self,
        tensors: dict[str, torch.Tensor],
        step: int,
        tokens: int | None,
        inner_steps: int | None,
    ) -> tuple[
        dict[str, torch.Tensor], CommitRecord, int, int, str | None, tuple[float, float, float]
    ]:
        """(merged tensors, commit record, bytes up, bytes down, why our slot was squatted,
        seconds spent (uploading, waiting for the peers, merging))."""
        assert self.rank is not None
        t_start = time.monotonic()
        ref = {n: (list(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()}
        writer = self.writer_id(step)
        payload, own = encode_contribution(
            tensors,
            rank=self.rank,
            step=step,
            tokens=tokens,
            inner_steps=inner_steps,
            encoding=Encoding(self.codec, self.sparse, self.checksum),
            writer=writer,
            keys=self.keys,
        )
        up = down = 0
        valid: dict[int, Contribution] = {}
        rejected: dict[int, str] = {}
        unconfirmed: dict[int, Contribution] = {}  # present, its rank has not confirmed it yet
        own_squat: str | None = None
        # what we uploaded is ours from memory until we read it back: a committer lists only
        # contributions read back from the store (`_stored_copy_problem`)
        own_read_back = False
        commit = self._read_commit(step)
        if commit is None:
            self._check_not_stale(step)
            if self.fence is not None:
                self.fence()
            if self._upload(step, payload, own.nbytes):
                up += own.nbytes
                valid[self.rank] = own
            else:  # our slot is taken: our own earlier upload, or someone else's object
                mine, down = self._claim_existing_slot(step, ref, writer)
                if isinstance(mine, Contribution):
                    valid[self.rank] = mine
                    own_read_back = True
                else:
                    own_squat = rejected[self.rank] = mine
            if own_squat is None and self.keys is None:
                own_squat = self._confirm_slot(step, writer)
                if own_squat is not None:
                    valid.pop(self.rank, None)
                    rejected[self.rank] = own_squat
            if own_squat is not None:
                log.warning("step %d: %s", step, own_squat)
                self._report_squat(step, own_squat)
        del payload  # the header + views of our tensors; keep memory to one copy per peer
        # The step clock starts once our contribution is in (the upload has its own timeout),
        # so a slow client start-up or upload does not eat into the wait for the others.
        t_in = time.monotonic()
        deadline = t_in + self.timeout_s
        last_error = ""
        stats: dict[int, TensorStats] = {}
        ready_since: float | None = None
        departed: dict[int, str] = {}  # rank -> why the driver declared it gone
        next_departure_poll = t_in  # known departed ranks: at the first poll; others: later
        while commit is None:
            self._check_cancel_and_run(step)
            try:
                commit = self._read_commit(step)
                if commit is not None:
                    break
                down += self._poll_slots(step, ref, valid, rejected, unconfirmed)
                if time.monotonic() >= next_departure_poll:
                    self._poll_departures(
                        step, valid, rejected, departed, first=next_departure_poll == t_in
                    )
                    next_departure_poll = time.monotonic() + self.departure_poll_s
            except (OSError, RuntimeError) as e:  # transient store errors: retry until deadline
                last_error = f"; last store error: {e!r}"
                log.warning("step %d: store error while polling: %r", step, e)
                time.sleep(self.poll_interval_s)
                continue
            settled = self._settled(valid, rejected)
            timed_out = time.monotonic() >= deadline
            # departed ranks are not waited for when the others are enough; they never make a
            # step fail early (a rank being restarted may still come back in time)
            enough = settled or self._settled(valid, rejected, departed)
            ready = (enough or timed_out) and len(valid) >= self.min_replicas
            if ready and ready_since is None:
                ready_since = time.monotonic()
            # One replica screens and commits: the lowest valid rank. The others wait for its
            # record and take over after commit_grace_s (it may have died after uploading), so
            # screening (a pass over every contribution) is not done n times on a busy machine.
            my_turn = ready and (
                self.rank == min(valid)
                or time.monotonic() - (ready_since or 0.0) >= self.commit_grace_s
            )
            attempted = False
            if my_turn and not settled and not timed_out:
                # ready only because departed ranks are not waited for: a rank that stalled
                # past the end of its peers must not commit a step the run has left behind
                # (its record may be garbage-collected): refused, it heals instead. A listing,
                # not the head hint: a committer stopped between its record and the hint may
                # have set the hint back (the run has lost a member: off the steady state)
                self._check_not_stale(step, listing=True)
            if (
                my_turn
                and self.config.verify_own_upload
                and self.rank in valid
                and not own_read_back
            ):
                # our own contribution as the others will read it: bit rot or an overwrite
                # in the store would make every reader fail the step we commit
                own_read_back = True
                problem, nbytes = self._stored_copy_problem(step, ref, valid[self.rank])
                down += nbytes
                if problem is not None:
                    log.warning("step %d: leaving our own contribution out: %s", step, problem)
                    del valid[self.rank]
                    rejected[self.rank] = problem
                    continue
            if my_turn:
                try:
                    screened = self._screen(step, valid, rejected, unconfirmed, stats)
                    if screened is not None:
                        chosen, excluded, decisions = screened
                        for r, why in departed.items():
                            if r not in chosen and r not in rejected:
                                excluded[r] = f"departed: {why}"
                        if self.fence is not None:
                            self.fence()
                        commit = self._write_commit(step, chosen, excluded, decisions)
                        break
                    attempted = True  # screening left fewer than min_replicas
                except OSError as e:  # transient: put-if-absent is safe to retry next poll
                    last_error = f"; last store error: {e!r}"
                    log.warning("step %d: writing the commit record failed: %r", step, e)
                    if timed_out and time.monotonic() >= deadline + self.timeout_s:
                        raise
                    time.sleep(self.poll_interval_s)
                    continue
            settled = self._settled(valid, rejected)
            hopeless = attempted or len(valid) < self.min_replicas
            if settled and hopeless:  # every rank judged: this step can never commit
                commit = self._read_commit(step)
                if commit is not None:
                    break
                raise QuorumLostError(
                    f"step {step}: only {len(valid)} valid contributions, min_replicas="
                    f"{self.min_replicas}; rejected: {rejected}; nothing committed",
                    step=step,
                    rejected=rejected,
                )
            if timed_out and hopeless:
                commit = self._read_commit(step)
                if commit is not None:
                    break
                self._check_not_stale(step, listing=True)
                missing = sorted(
                    set(range(self.world_size)) - valid.keys() - rejected.keys() - departed.keys()
                )
                raise StoreTimeoutError(
                    f"step {step}: timeout_s={self.timeout_s} elapsed with {len(valid)} valid "
                    f"contributions (ranks {sorted(valid)}), min_replicas={self.min_replicas}; "
                    f"missing ranks {missing}, rejected {rejected}, departed "
                    f"{sorted(departed)}; nothing committed by "
                    f"rank {self.rank}{last_error}"
                )
            if self.cancelled.wait(self.poll_interval_s):
                raise ExchangeCancelledError(f"step {step}: exchange cancelled")
        t_commit = time.monotonic()
        # what we hold: valid, or read but not yet confirmed by its owner (the commit's pinned
        # checksum decides, as it would for the same object downloaded again)
        result, d = self._aggregate(step, commit, {**unconfirmed, **valid}, tensors, ref)
        phases = (t_in - t_start, t_commit - t_in, time.monotonic() - t_commit)
        return result, commit, up, down + d, own_squat, phases

    def _settled(
        self,
        valid: dict[int, Contribution],
        rejected: dict[int, str],
        departed: dict[int, str] | None = None,
    ) -> bool:
        """Every rank is judged: valid, rejected (or, given ``departed``, not expected)."""
        judged = valid.keys() | rejected.keys() | (departed or {}).keys()
        return len(judged) == self.world_size

    def _poll_departures(
        self,
        step: int,
        valid: dict[int, Contribution],
        rejected: dict[int, str],
        departed: dict[int, str],
        *,
        first: bool,
    ) -> None:
        """Read the departure records of the ranks still missing (by key, no listing); at the
        first poll of a step only those of ranks already known to be departed."""
        pending = [
            r
            for r in range(self.world_size)
            if r not in valid
            and r not in rejected
            and r not in departed
            and r != self.rank
            and (not first or r in self._known_departed)
        ]
        if not pending:
            return
        reasons = list(
            self._pool().map(
                lambda r: read_departure(self.store, REPLICA_ROLE, r, secret=self._slot_secret),
                pending,
            )
        )
        for r, why in zip(pending, reasons):
            if why is None:
                self._known_departed.discard(r)  # it is back (a restarted incarnation)
                continue
            if r not in self._known_departed:
                log.warning("step %d: rank %d departed (%s): not waiting for it", step, r, why)
            self._known_departed.add(r)
            departed[r] = why

    def _stored_copy_problem(
        self, step: int, ref: dict[str, tuple[list[int], str]], own: Contribution
    ) -> tuple[str | None, int]:
        """Read our contribution back from the store before committing it: (why the stored
        copy cannot stand for what we uploaded, or None; bytes read). One extra download of
        our own contribution per step we commit (the committer reads n - 1 others anyway)."""
        assert self.rank is not None
        (found, nbytes) = self._fetch_many(step, [self.rank], ref)[0]
        what = f"rank {self.rank}'s stored contribution for step {step}"
        if found is None:
            return f"{what} is gone", nbytes
        if isinstance(found, str):
            return f"{what} does not read back: {found}", nbytes
        if found.checksum != own.checksum:
            return f"{what} differs from what it uploaded (overwritten?)", nbytes
        return None, nbytes

    def _claim_existing_slot(
        self, step: int, ref: dict[str, tuple[list[int], str]], writer: str
    ) -> tuple[Contribution | str, int]:
        """Our upload found our slot taken: (the object if we wrote it, else why not; bytes).

        "We wrote it": signed by our key (an earlier incarnation of this rank included), or,
        unsigned, carrying this process's writer id for this step (a retried step).
        """
        assert self.rank is not None
        (found, nbytes) = self._fetch_many(step, [self.rank], ref)[0]
        what = f"slot squatted: rank {self.rank}'s slot for step {step} holds an object"
        if found is None:
            return f"{what} that vanished (deleted by someone else)", nbytes
        if isinstance(found, str):
            return f"{what} it did not write, and it is refused: {found}", nbytes
        if self.keys is None and found.writer != writer:
            return f"{what} it did not write (writer id {found.writer!r})", nbytes
        return found, nbytes

    def _confirm_slot(self, step: int, writer: str) -> str | None:
        """Unsigned runs: write ``owner/<rank>.json`` naming our writer id (None = confirmed)."""
        assert self.rank is not None
        key = owner_key(step, self.rank, self.slot(step, self.rank))
        body = json.dumps({"writer": writer}).encode()
        written = self._write_retrying(
            step, "owner record", lambda _left: self.store.put_if_absent(key, body)
        )
        if written:
            return None
        raw = self.store.get(key)
        if _owner_writer(raw) == writer:
            return None  # we confirmed it before (a retried step)
        return (
            f"slot squatted: rank {self.rank}'s owner record for step {step} was written by "
            "someone else"
        )

    def _report_squat(self, step: int, reason: str) -> None:
        assert self.rank is not None
        try:
            body = json.dumps({"rank": self.rank, "step": step, "reason": reason}).encode()
            self.store.put_if_absent(squat_key(step, self.rank, self.slot(step, self.rank)), body)
        except OSError as e:  # the report is advisory; the slot is excluded by us anyway
            log.warning("step %d: could not write the squat report: %r", step, e)

    def _poll_slots(
        self,
        step: int,
        ref: dict[str, tuple[list[int], str]],
        valid: dict[int, Contribution],
        rejected: dict[int, str],
        unconfirmed: dict[int, Contribution],
    ) -> int:
        """Fetch the slots not yet judged, by key (no listing); returns the bytes read."""
        down = 0
        pending = [
            r
            for r in range(self.world_size)
            if r not in valid and r not in rejected and r not in unconfirmed
        ]
        for r, (c, nbytes) in zip(pending, self._fetch_many(step, pending, ref)):
            down += nbytes
            if isinstance(c, Contribution):
                if self.keys is None:
                    unconfirmed[r] = c  # its owner record decides
                else:
                    valid[r] = c
            elif c is not None:
                log.warning("rejecting %s", c)
                rejected[r] = c
        if unconfirmed:
            ranks = sorted(unconfirmed)
            owners = self._get_many([owner_key(step, r, self.slot(step, r)) for r in ranks])
            silent = [r for r, raw in zip(ranks, owners) if raw is None]
            for r, raw in zip(
                silent, self._get_many([squat_key(step, r, self.slot(step, r)) for r in silent])
            ):
                if raw is not None:
                    unconfirmed.pop(r)
                    rejected[r] = f"slot squatted: rank {r} reports an object it did not write"
            for r, raw in zip(ranks, owners):
                if raw is None:
                    continue  # not confirmed yet
                c = unconfirmed.pop(r)
                if _owner_writer(raw) == c.writer and c.writer is not None:
                    valid[r] = c
                else:
                    rejected[r] = (
                        f"slot squatted: the object in rank {r}'s slot was not written by rank "
                        f"{r} (its owner record names another writer)"
                    )
        return down

    def _screen(
        self,
        step: int,
        valid: dict[int, Contribution],
        rejected: dict[int, str],
        unconfirmed: dict[int, Contribution],
        stats: dict[int, TensorStats],
    ) -> tuple[dict[int, Contribution], dict[int, str], list[Decision]] | None:
        """The committer's screening: (included, excluded with reasons, decisions), or None
        when fewer than ``min_replicas`` pass (the caller waits or fails)."""
        excluded = {r: "missing (not uploaded in time)" for r in range(self.world_size)}
        for r in unconfirmed:
            excluded[r] = (
                "unconfirmed: its object is in the slot but rank never confirmed writing it "
                "(planted, or the rank died between upload and confirmation)"
            )
        if self.keys is None:  # squat reports of ranks we are about to include
            ranks = sorted(r for r in valid if r != self.rank)
            for r, raw in zip(
                ranks, self._get_many([squat_key(step, r, self.slot(step, r)) for r in ranks])
            ):
                if raw is not None:
                    rejected[r] = f"slot squatted: rank {r} reports an object it did not write"
                    valid.pop(r, None)
        excluded.update(rejected)
        candidates = []
        for r, c in sorted(valid.items()):
            need = self.policy.screen == "loss"
            if r not in stats and not need:
                stats[r] = tensor_stats(c.decode())
            candidates.append(
                Candidate(r, c.decode() if need else None, c.tokens, c.inner_steps, stats.get(r))
            )
        decisions = screen(candidates, self.policy, loss_probe=self.loss_probe)
        chosen = {d.rank: valid[d.rank] for d in decisions if d.included}
        for d in decisions:
            if not d.included:
                excluded[d.rank] = f"screened out: {d.reason}"
                log.warning("step %d: rank %d screened out: %s", step, d.rank, d.reason)
        if len(chosen) < self.min_replicas:
            for d in decisions:
                if not d.included:
                    rejected[d.rank] = f"screened out: {d.reason}"
                    valid.pop(d.rank, None)
            return None
        for r in list(excluded):
            if r in chosen:
                excluded.pop(r)
        return chosen, excluded, decisions

    def _read_commit(self, step: int) -> CommitRecord | None:
        raw = self.store.get(commit_key(step))
        if raw is None:
            return None
        record = parse_commit(raw, step=step, world_size=self.world_size, keys=self.keys)
        self._know(step)
        return record

    def _know(self, step: int) -> None:
        """Remember that ``step``'s commit record parsed (the newest 64 steps are kept)."""
        self._known_commits.add(step)
        if len(self._known_commits) > 64:
            self._known_commits = set(sorted(self._known_commits)[-64:])

    def committed(self, step: int) -> bool:
        """Whether ``step`` has a commit record (one GET, never a listing)."""
        return self.store.get(commit_key(step)) is not None

    def _head_mac(self, step: int) -> str | None:
        """Unsigned runs with a slot secret: the head hint's MAC (None: nothing to MAC with)."""
        if self._slot_secret is None:
            return None
        return hmac.new(self._slot_secret, f"head:{step}".encode(), hashlib.sha256).hexdigest()

    def _write_head(self, step: int) -> None:
        """Overwrite the head hint with ``step`` (the committer, after its commit record).
        Signed runs sign it; unsigned runs with a slot secret MAC it under that secret."""
        record: dict[str, object] = {"kind": "head", "step": step}
        mac = self._head_mac(step)
        if self.keys is None and mac is not None:
            record["mac"] = mac
        try:
            body = record if self.keys is None else self.keys.sign(record)
            self.store.put(HEAD_KEY, json.dumps(body).encode())
        except OSError as e:  # a hint: readers fall back to a listing when it lags
            log.warning("step %d: could not update the head hint: %r", step, e)

    def head_step(self) -> int | None:
        """The newest committed step: the head hint if it holds up, else a listing.

        The hint is one GET; it is believed only when it is signed (signing on) or carries the
        MAC of the run's slot secret (unsigned, with one), and the commit record of its step
        and that record's predecessor hold up (`RunDocuments.unconfirmed_commit`). A hint that
        does not (planted, malformed, ahead of every commit) is refused: the refusal goes to
        `refusals` (once per distinct hint) and this falls back to `latest_committed_step`,
        which lists. A believed hint may lag behind (a committer died between its commit
        record and the hint, or two committers wrote it out of order): a lower bound. None
        when nothing is committed.
        """
        raw = self.store.get(HEAD_KEY)
        if raw is None:
            return None
        step, why = self._parse_head(bytes(raw))
        if step is not None and why is None and step not in self._known_commits:
            why = self.unconfirmed_commit(step)
        if why is None:
            return step
        digest = hashlib.sha256(bytes(raw)).hexdigest()
        if digest not in self._refused_hints:
            self._refused_hints.add(digest)
            log.warning("refusing the head hint at %s: %s", self.uri, why)
            self.refusals.append((HEAD_KEY, f"head hint refused: {why}"))
        return self.latest_committed_step()

    def _parse_head(self, raw: bytes) -> tuple[int | None, str | None]:
        """(the hinted step, why the hint is not believed: None when it may be)."""
        try:
            doc = json.loads(raw)
            if self.keys is not None:
                self.keys.verify(doc, signers={"rank-*"}, what="head hint")
        except (UnicodeDecodeError, json.JSONDecodeError, CorruptContributionError) as e:
            return None, f"unreadable or unsigned ({e})"
        step = doc.get("step") if isinstance(doc, dict) else None
        if not isinstance(doc, dict) or doc.get("kind") != "head":
            return None, "not a head hint"
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**10:
            return None, f"step {step!r} is not a step number"
        mac = self._head_mac(step)
        if self.keys is None and mac is not None:
            theirs = doc.get("mac")
            if not isinstance(theirs, str) or not hmac.compare_digest(theirs, mac):
                return None, "its MAC does not verify (not written by a replica of this run)"
        return step, None

    def _write_commit(
        self,
        step: int,
        valid: dict[int, Contribution],
        excluded: dict[int, str],
        decisions: list[Decision] | None = None,
    ) -> CommitRecord:
        assert self.rank is not None
        method = self.policy.aggregate
        record = make_commit(
            step=step,
            world_size=self.world_size,
            included=list(valid.values()),
            weighting=self.weighting,
            committed_by=self.rank,
            excluded=excluded,
            decisions=decisions,
            aggregate=method,
            trim=rules.get(method).trim(len(valid), self.policy),
            keys=self.keys,
        )
        raw = json.dumps(record, sort_keys=True).encode()
        if self.store.put_if_absent(commit_key(step), raw):
            log.info("step %d: rank %d committed ranks %s", step, self.rank, sorted(valid))
            ours = parse_commit(raw, step=step, world_size=self.world_size, keys=self.keys)
            self._know(step)
            self._write_head(step)
            return ours
        # lost the race: the winner's record decides, whatever we saw
        for _ in range(50):
            commit = self._read_commit(step)
            if commit is not None:
                return commit
            time.sleep(self.poll_interval_s)
        raise StoreTimeoutError(f"step {step}: lost the commit race but cannot read the record")

    def _aggregate(
        self,
        step: int,
        commit: CommitRecord,
        held: dict[int, Contribution],
        tensors: dict[str, torch.Tensor],
        ref: dict[str, tuple[list[int], str]],
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Fetch whatever the commit lists that we lack (absent from `held`, or held with another
        checksum than the commit pins), then average it (see merge_arithmetic.py)."""
        down = 0
        ranks = commit["included_ranks"]
        pinned = commit["checksums"]
        valid = {r: c for r, c in held.items() if r in ranks}
        refetch = [r for r in ranks if r not in valid or valid[r].checksum != pinned[r]]
        for r, (c, nbytes) in zip(refetch, self._fetch_many(step, refetch, ref)):
            down += nbytes
            if isinstance(c, Contribution) and c.checksum == pinned[r]:
                valid[r] = c
                continue
            if c is None:
                problem = f"the commit lists rank {r} but its contribution is gone "
                problem += "(garbage-collected? keep_steps too small)"
            elif isinstance(c, str):
                problem = f"the commit lists rank {r} but its contribution cannot be used: {c}"
            else:
                problem = f"rank {r}'s stored contribution does not match the checksum in the "
                problem += "commit record"
            raise ListedContributionError(
                f"step {step}: {problem}",
                step=step,
                committed_by=commit.get("committed_by"),
                included_ranks=list(ranks),
            )
        why = self._against_rule(commit, valid)
        if why is not None:
            raise UpdateRefusedError(
                f"step {step}: the commit record (committed by {commit.get('committed_by')!r}) "
                f"is refused: {why}; a forged or broken commit record? Nothing is applied",
                step=step,
                rejected=dict(commit["excluded"]),
            )
        acc = average_in_rank_order(commit, valid)
        out = {n: acc[n].to(device=t.device, dtype=t.dtype) for n, t in tensors.items()}
        return out, down

    def _against_rule(self, commit: CommitRecord, held: dict[int, Contribution]) -> str | None:
        """Why ``commit`` does not follow this run's merge rule for the contributions it
        includes (``held``: each of them, verified against its pinned checksum), or None.

        Every reader recomputes what the committer had no choice about: the merge method, the
        weighting, the weights (`contribution_screening.merge_weights` over the included
        contributions' token claims), the trim and the clip scales the rule allows
        (`rules.AggregationRule`). Which ranks are included, and by how much norm_clip shrinks one,
        rest on norms that are not bit-reproducible across machines: they stay the committer's."""
        policy, ranks = self.policy, commit["included_ranks"]
        method = commit.get("aggregate", "mean")
        if method != policy.aggregate or commit.get("weighting", "equal") != policy.weighting:
            return (
                f"it merges with {method!r} weighting {commit.get('weighting', 'equal')!r}; "
                f"this run merges with {policy.aggregate!r} weighting {policy.weighting!r}"
            )
        rule = rules.get(method)
        trim = rule.trim(len(ranks), policy)
        if int(commit.get("trim", 0)) != trim:
            return f"it trims {commit.get('trim')!r} per end; the rule gives {trim}"
        want = merge_weights({r: held[r].tokens for r in ranks}, policy)
        for r in ranks:
            got = commit["weights"][r]
            if not math.isclose(got, want[r], rel_tol=1e-9, abs_tol=1e-12):
                return f"rank {r}'s weight is {got!r}; the run's weighting rule gives {want[r]!r}"
            scale = commit["scales"].get(r, 1.0)
            problem = rule.scale_problem(scale)
            if problem is not None:
                return f"rank {r}'s scale is {scale!r}; {method!r} {problem}"
        return None

    def _fetch_many(
        self, step: int, ranks: list[int], ref: dict[str, tuple[list[int], str]]
    ) -> list[tuple[Contribution | str | None, int]]:
        """Download and validate ``ranks``' contributions concurrently.

        Per rank: (Contribution, or the rejection reason, or None if absent; bytes read).
        Threads overlap network latency and checksumming (hashlib and xxhash release the GIL).
        """
        if not ranks:
            return []

        def fetch(r: int) -> tuple[Contribution | str | None, int]:
            raw = self.store.get(contrib_key(step, r, self.slot(step, r)))
            if raw is None:
                return None, 0
            try:
                c = decode_contribution(raw, step=step, rank=r, reference=ref, keys=self.keys)
            except CorruptContributionError as e:
                return str(e), len(raw)
            return c, len(raw)

        return list(self._pool().map(fetch, ranks))

    def _pool(self) -> ThreadPoolExecutor:
        if self._fetcher is None:
            # Remote stores: overlap request latency. Local files: reads are memcpy and
            # hashing is CPU, so threads only help with spare cores (measured: on 2 cores with
            # 4 replicas, 3 fetch threads made the step 2x slower than 1).
            spare = max(1, (os.cpu_count() or 1) // 2)
            workers = min(self.world_size, spare if self.store.is_local else 8)
            self._fetcher = ThreadPoolExecutor(workers, thread_name_prefix="store-fetch")
        return self._fetcher

    def _get_many(self, keys: list[str]) -> list[Buffer | None]:
        """Small objects by key, concurrently on remote stores."""
        return list(self._pool().map(self.store.get, keys)) if keys else []

    def _check_not_stale(self, step: int, *, listing: bool = False) -> None:
        """Refuse a step the run has moved past: one GET of the head hint, or (``listing``,
        only after a wait timed out) a listing of every committed step."""
        latest = self.latest_committed_step() if listing else self.head_step()
        if latest is not None and latest > step:
            raise StoreTimeoutError(
                f"step {step} was never committed or was garbage-collected, and the run is "
                f"already at step {latest}: fetch the latest global state and rejoin there"
            )

    def _gc(self, step: int) -> None:
        """Delete the step ``keep_steps`` back (done by the committer; no listing: a step
        whose committer died before its GC stays until the run prefix is deleted)."""
        old = step - self.keep_steps
        if old < 0:
            return
        try:
            slots = [self.slot(old, r) for r in range(self.world_size)]
            self.store.delete_many(step_keys(old, self.world_size, slots))
        except OSError as e:  # GC is housekeeping; never fail a committed step for it
            log.warning("garbage collection of step %d failed: %r", old, e)


def _owner_writer(raw: Buffer | None) -> str | None:
    """The writer id an owner record names (None if absent or unreadable)."""
    if raw is None:
        return None
    try:
        doc = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    writer = doc.get("writer") if isinstance(doc, dict) else None
    return writer if isinstance(writer, str) else None
