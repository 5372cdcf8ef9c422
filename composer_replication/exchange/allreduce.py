"""ObjectStoreAllReduce: average pseudo-gradients of N replicas that meet only in a bucket.

Each step, every replica uploads one immutable contribution (put-if-absent), downloads and
validates the others', and then obeys the step's single commit record: the first replica that
sees all ``world_size`` contributions settled (or, after ``timeout_s``, at least
``min_replicas`` valid ones) writes it with put-if-absent; everybody, including replicas that
were too late to be listed, aggregates exactly the listed contributions in rank order in float32.
That makes the result bit-identical on every replica (docs/object-store.md explains why).

Timeouts are ordered: ``upload_timeout_s < timeout_s < run_timeout_s``. ``cancel()`` aborts
any wait. Nothing read from the store is unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from composer_replication.exchange import codecs, wire
from composer_replication.exchange.aggregate import average_in_rank_order, check_inputs
from composer_replication.exchange.documents import RunDocuments
from composer_replication.exchange.protocol import (
    Contribution,
    CorruptContributionError,
    ExchangeCancelledError,
    ModelMismatchError,
    StepResult,
    StoreTimeoutError,
    commit_key,
    contrib_key,
    decode_contribution,
    dtype_name,
    encode_contribution,
    make_commit,
    parse_commit,
    parse_contrib_name,
    parse_step_dir,
    step_prefix,
)
from composer_replication.exchange.state import model_fingerprint
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.wire import Buffer

__all__ = [
    "ObjectStoreAllReduce",
    "StepResult",
    "StoreTimeoutError",
    "CorruptContributionError",
    "ModelMismatchError",
    "ExchangeCancelledError",
    "model_fingerprint",
]

log = logging.getLogger(__name__)


class ObjectStoreAllReduce(RunDocuments):
    """Pseudo-gradient exchange through ``uri`` (``file://``, ``memory://``, ``s3://``, ``gs://``).

    ``rank=None`` gives a driver/observer handle (manifest, states, run documents) that cannot
    call :meth:`allreduce` unless ``world_size == 1`` (a passthrough needs no rank).
    ``checksum`` is the algorithm this replica's contributions are checksummed with:
    ``"xxh3-128"`` (default when the ``xxhash`` package is installed: fast, detects truncation
    and corruption) or ``"sha256"`` (default otherwise; also resists deliberate forgery by
    someone with write access to the bucket). Replicas of one run may differ: headers and commit
    records name the algorithm, and readers verify with it (xxh3-128 needs xxhash everywhere).
    """

    def __init__(
        self,
        uri: str,
        world_size: int = 1,
        rank: int | None = None,
        *,
        timeout_s: float = 600.0,
        upload_timeout_s: float | None = None,
        run_timeout_s: float | None = None,
        codec: str = "fp32",
        min_replicas: int | None = None,
        weighting: str = "equal",
        storage_options: dict[str, Any] | None = None,
        keep_steps: int = 4,
        poll_interval_s: float = 0.1,
        checksum: str | None = None,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if rank is not None and (not isinstance(rank, int) or not 0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        upload_timeout_s = timeout_s / 4 if upload_timeout_s is None else upload_timeout_s
        if not 0 < upload_timeout_s < timeout_s:
            raise ValueError(
                f"timeouts must be ordered upload < step: upload_timeout_s={upload_timeout_s} "
                f"is not in (0, timeout_s={timeout_s})"
            )
        if run_timeout_s is not None and not run_timeout_s > timeout_s:
            raise ValueError(
                f"timeouts must be ordered step < run: run_timeout_s={run_timeout_s} must exceed "
                f"timeout_s={timeout_s} (or be None for no overall limit)"
            )
        min_replicas = world_size if min_replicas is None else min_replicas
        if not isinstance(min_replicas, int) or not 1 <= min_replicas <= world_size:
            raise ValueError(f"min_replicas must be in [1, {world_size}], got {min_replicas!r}")
        if weighting not in ("equal", "tokens"):
            raise ValueError(f"weighting must be 'equal' or 'tokens', got {weighting!r}")
        if not isinstance(keep_steps, int) or keep_steps < 1:
            raise ValueError(f"keep_steps must be an int >= 1, got {keep_steps!r}")
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        super().__init__(
            ObjectStore(uri, storage_options),
            world_size=world_size,
            codec=codecs.check_codec(codec),
            keep_steps=keep_steps,
            poll_interval_s=float(poll_interval_s),
        )
        self.rank = rank
        # what this replica writes; readers verify whatever algorithm each header names
        self.checksum = (
            wire.default_checksum() if checksum is None else wire.check_checksum(checksum)
        )
        self.timeout_s = float(timeout_s)
        self.upload_timeout_s = float(upload_timeout_s)
        self.run_timeout_s = run_timeout_s
        self.min_replicas = min_replicas
        self.weighting = weighting
        self.last_result: StepResult | None = None
        self._run_deadline = None if run_timeout_s is None else time.monotonic() + run_timeout_s
        self._uploader: ThreadPoolExecutor | None = None
        self._fetcher: ThreadPoolExecutor | None = None

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
        Raises StoreTimeoutError (who is missing, which timeout), CorruptContributionError
        (the commit lists an object this replica cannot verify) or ExchangeCancelledError.
        """
        check_inputs(tensors, step, tokens, inner_steps, self.weighting)
        start = time.monotonic()
        if self.world_size == 1:
            self.last_result = StepResult(step, [0], [], {0: 1.0}, 0, 0, 0.0, self.codec, 0)
            return dict(tensors)
        if self.rank is None:
            raise ValueError(
                "this ObjectStoreAllReduce is a driver handle (rank=None); construct it with "
                "rank=<this replica's index> to call allreduce()"
            )
        result, commit, nbytes_up, nbytes_down = self._exchange(tensors, step, tokens, inner_steps)
        included = commit["included_ranks"]
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
            rejected=dict(commit["excluded"]),
        )
        if commit.get("committed_by") == self.rank:
            self._gc(step)
        return result

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
        fut = self._uploader.submit(self.store.put_if_absent, contrib_key(step, self.rank), payload)
        try:
            return fut.result(timeout=self.upload_timeout_s)
        except FutureTimeout:
            raise StoreTimeoutError(
                f"step {step}: rank {self.rank}'s upload of {nbytes} bytes did not finish "
                f"within upload_timeout_s={self.upload_timeout_s} (to {self.uri})"
            ) from None

    def _exchange(
        self,
        tensors: dict[str, torch.Tensor],
        step: int,
        tokens: int | None,
        inner_steps: int | None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], int, int]:
        assert self.rank is not None
        ref = {n: (list(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()}
        payload, own = encode_contribution(
            tensors, rank=self.rank, step=step, tokens=tokens, inner_steps=inner_steps,
            codec=self.codec, checksum=self.checksum,
        )  # fmt: skip
        up = down = 0
        valid: dict[int, Contribution] = {}
        rejected: dict[int, str] = {}
        commit = self._read_commit(step)
        if commit is None:
            self._check_not_stale(step)
            if self._upload(step, payload, own.nbytes):
                up += own.nbytes
                valid[self.rank] = own
            # else: an earlier incarnation of this rank uploaded; it is fetched like any other
        del payload  # the header + views of our tensors; keep memory to one copy per peer
        # The step clock starts once our contribution is in (the upload has its own timeout),
        # so a slow client start-up or upload does not eat into the wait for the others.
        deadline = time.monotonic() + self.timeout_s
        last_error = ""
        while commit is None:
            self._check_cancel_and_run(step)
            try:
                commit = self._read_commit(step)
                if commit is not None:
                    break
                present = {
                    r
                    for r in map(
                        parse_contrib_name, self.store.list(f"{step_prefix(step)}contrib/")
                    )
                    if r is not None and 0 <= r < self.world_size
                }
                new = sorted(present - valid.keys() - rejected.keys())
                for r, (c, nbytes) in zip(new, self._fetch_many(step, new, ref)):
                    down += nbytes
                    if isinstance(c, Contribution):
                        valid[r] = c
                    elif c is not None:
                        log.warning("rejecting %s", c)
                        rejected[r] = c
            except (OSError, RuntimeError) as e:  # transient store errors: retry until deadline
                last_error = f"; last store error: {e!r}"
                log.warning("step %d: store error while polling: %r", step, e)
                time.sleep(self.poll_interval_s)
                continue
            settled = len(valid) + len(rejected) == self.world_size
            timed_out = time.monotonic() >= deadline
            if (settled or timed_out) and len(valid) >= self.min_replicas:
                try:
                    commit = self._write_commit(step, valid, rejected)
                    break
                except OSError as e:  # transient: put-if-absent is safe to retry next poll
                    last_error = f"; last store error: {e!r}"
                    log.warning("step %d: writing the commit record failed: %r", step, e)
                    if timed_out and time.monotonic() >= deadline + self.timeout_s:
                        raise
                    time.sleep(self.poll_interval_s)
                    continue
            if settled:
                raise CorruptContributionError(
                    f"step {step}: only {len(valid)} valid contributions, min_replicas="
                    f"{self.min_replicas}; rejected: {rejected}; nothing committed"
                )
            if timed_out:
                commit = self._read_commit(step)
                if commit is not None:
                    break
                missing = sorted(set(range(self.world_size)) - valid.keys() - rejected.keys())
                raise StoreTimeoutError(
                    f"step {step}: timeout_s={self.timeout_s} elapsed with {len(valid)} valid "
                    f"contributions (ranks {sorted(valid)}), min_replicas={self.min_replicas}; "
                    f"missing ranks {missing}, rejected {sorted(rejected)}; nothing committed by "
                    f"rank {self.rank}{last_error}"
                )
            if self.cancelled.wait(self.poll_interval_s):
                raise ExchangeCancelledError(f"step {step}: exchange cancelled")
        result, d = self._aggregate(step, commit, valid, tensors, ref)
        return result, commit, up, down + d

    def _read_commit(self, step: int) -> dict[str, Any] | None:
        raw = self.store.get(commit_key(step))
        return None if raw is None else parse_commit(raw, step=step, world_size=self.world_size)

    def _write_commit(
        self, step: int, valid: dict[int, Contribution], rejected: dict[int, str]
    ) -> dict[str, Any]:
        excluded = {r: "missing (not uploaded in time)" for r in range(self.world_size)}
        excluded.update(rejected)
        for r in valid:
            excluded.pop(r)
        assert self.rank is not None
        record = make_commit(
            step=step, world_size=self.world_size, included=list(valid.values()),
            weighting=self.weighting, committed_by=self.rank, excluded=excluded,
        )  # fmt: skip
        raw = json.dumps(record, sort_keys=True).encode()
        if self.store.put_if_absent(commit_key(step), raw):
            log.info("step %d: rank %d committed ranks %s", step, self.rank, sorted(valid))
            return parse_commit(raw, step=step, world_size=self.world_size)
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
        commit: dict[str, Any],
        valid: dict[int, Contribution],
        tensors: dict[str, torch.Tensor],
        ref: dict[str, tuple[list[int], str]],
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Fetch whatever the commit lists that we lack, then average it (see aggregate.py)."""
        down = 0
        ranks = commit["included_ranks"]
        pinned = commit["checksums"]
        refetch = [r for r in ranks if r not in valid or valid[r].checksum != pinned[r]]
        for r, (c, nbytes) in zip(refetch, self._fetch_many(step, refetch, ref)):
            down += nbytes
            if not isinstance(c, Contribution):
                raise CorruptContributionError(
                    f"step {step}: the commit lists rank {r} but its contribution "
                    + ("is gone (garbage-collected? keep_steps too small)" if c is None else
                       f"cannot be used: {c}")
                )  # fmt: skip
            if c.checksum != pinned[r]:
                raise CorruptContributionError(
                    f"step {step}: rank {r}'s stored contribution does not match the "
                    "checksum in the commit record"
                )
            valid[r] = c
        acc = average_in_rank_order(commit, valid)
        out = {n: acc[n].to(device=t.device, dtype=t.dtype) for n, t in tensors.items()}
        return out, down

    def _fetch_many(
        self, step: int, ranks: list[int], ref: dict[str, tuple[list[int], str]]
    ) -> list[tuple[Contribution | str | None, int]]:
        """Download and validate ``ranks``' contributions concurrently.

        Per rank: (Contribution, or the rejection reason, or None if absent; bytes read).
        Threads overlap network latency and checksumming (hashlib and xxhash release the GIL).
        """
        if not ranks:
            return []
        if self._fetcher is None:
            # Remote stores: overlap request latency. Local files: reads are memcpy and
            # hashing is CPU, so threads only help with spare cores (measured: on 2 cores with
            # 4 replicas, 3 fetch threads made the step 2x slower than 1).
            spare = max(1, (os.cpu_count() or 1) // 2)
            workers = min(self.world_size, spare if self.store.is_local else 8)
            self._fetcher = ThreadPoolExecutor(workers, thread_name_prefix="store-fetch")

        def fetch(r: int) -> tuple[Contribution | str | None, int]:
            raw = self.store.get(contrib_key(step, r))
            if raw is None:
                return None, 0
            try:
                c = decode_contribution(raw, step=step, rank=r, reference=ref)
            except CorruptContributionError as e:
                return str(e), len(raw)
            if self.weighting == "tokens" and c.tokens is None:
                return f"contribution of rank {r}: no token count for weighting='tokens'", len(raw)
            return c, len(raw)

        return list(self._fetcher.map(fetch, ranks))

    def _check_not_stale(self, step: int) -> None:
        latest = self.latest_committed_step()
        if latest is not None and latest > step:
            raise StoreTimeoutError(
                f"step {step} was never committed or was garbage-collected, and the run is "
                f"already at step {latest}: fetch the latest global state and rejoin there"
            )

    def _gc(self, step: int) -> None:
        """Delete steps older than the ``keep_steps`` most recent (done by the committer)."""
        try:
            for name in self.store.list("steps/"):
                s = parse_step_dir(name)
                if s is not None and s <= step - self.keep_steps:
                    self.store.delete_prefix(step_prefix(s))
        except OSError as e:  # GC is housekeeping; never fail a committed step for it
            log.warning("garbage collection of old steps failed: %r", e)
