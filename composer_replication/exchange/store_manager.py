"""ObjectStoreManager: the part of `torchft.Manager` that `torchft.local_sgd.DiLoCo` uses, over an
object store instead of a process group.

`DiLoCo` (torchft 0.2.0, pinned) talks to its manager through a small surface (the `Manager`
protocol in ``composer_replication.diloco.manager``, which this class satisfies structurally):
``_use_async_quorum``, ``register_state_dict_fn``,
``allow/disallow_state_dict_read``, ``start_quorum``, ``current_step``, ``allreduce`` (in-place
average, returns a Work with ``wait`` / ``get_future``) and ``should_commit``. Serverless replicas
cannot open sockets to each other, so here:

- ``allreduce(t)`` only *queues* t. The whole round's tensors go to the store as one contribution
  (`ObjectStoreAllReduce.allreduce`) when the first Work is waited on, or, with
  ``fragment_sync_delay > 0``, in a background thread started at the next inner step so the
  exchange overlaps computation (Streaming DiLoCo's tau).
- ``should_commit()`` is True when the store produced a committed average for the round. That is
  also the case for a replica that arrived after the commit record was written: it is left out
  of the average but receives it, applies the same outer step and stays bit-identical. It is
  False when the exchange failed (fewer than ``min_replicas`` within the step timeout); DiLoCo then
  rolls the model back to the last global weights and the round's local work is dropped. A step
  that can never commit (`QuorumLostError`: every rank judged, too few valid) is raised to the
  caller instead, with its refusals in the round's record: retrying it would meet the same
  objects, and training on without it would pass for success.
- A round that committed but lists a contribution this replica cannot read or verify (it rotted
  or was overwritten after the committer read it: `ListedContributionError`) is not retried:
  the retry would meet the same record and the same object until the run moved past it. The
  replica *adopts* the committed round instead: it waits (up to ``state_timeout_s``) for the
  round's published outer state, loads it as a heal does and trains the next round in lockstep
  with the others (``should_commit()`` is False, as nothing is averaged here, and
  `current_step` has advanced). The committer always holds every contribution it listed, and
  publishes that state. If the state does not appear in time (or is not due: ``checkpoint_every
  > 1``), or does not load, the round fails as any failed exchange does, with a log line saying
  why.
- Membership is the store's commit record, so ``start_quorum`` only checks that this replica has
  not missed a committed round: one GET of the head hint (a listing only when the hint says it
  is behind, or after a failed round), so a steady-state round sends no LIST request. If it has
  missed one (it was stalled, or restarted), it *heals*: loads the
  latest published outer state (global weights, outer momentum, round), sits this round out, and
  trains the next round from the new global weights without stopping anyone.
- Every replica starts from the same published global weights: `initial_sync` checks the run
  manifest against the model's parameters, publishes this replica's state as round 0 if the
  store holds none (first writer wins), then loads the latest stored state. The same call
  resumes a whole-run restart exactly.
- After each committed round its committer (the lowest included rank when the result does not
  name one) publishes the outer state (``states/global/<round>``), so restarts and adopting
  replicas find it (``checkpoint_every`` rounds apart).

Store step k is the exchange that produces outer round k, so the commit chain has no gaps: a failed
exchange is retried at the same step next round. Contributions are immutable, so the retry reuses
what each replica uploaded the first time (a pseudo-gradient from the same global weights, only
older); never moving on to a new step without a commit is what guarantees that a late replica
cannot commit a step the others have given up on.

The seed constructor form works unchanged: ``MockManager(allreduce=rendezvous)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TypedDict

import torch
import torch.distributed as dist

from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.contribution_screening import norm_outlier, tensor_stats
from composer_replication.exchange.document_format import model_fingerprint, state_key
from composer_replication.exchange.outer_state import (
    STATE_NAME,
    LoadStateFn,
    OuterState,
    SaveStateFn,
    StateFns,
    fetch_outer_state,
    outer_state_exists,
    publish_outer_state,
    state_nbytes,
    wait_for_outer_state,
)
from composer_replication.exchange.retry import STATE_WRITE_RETRY_S, retry_write
from composer_replication.exchange.vocabulary import (
    CorruptContributionError,
    ListedContributionError,
    RoundStoppedError,
    StepResult,
    StoreTimeoutError,
    UpdateRefusedError,
)

__all__ = ["MockManager", "ObjectStoreManager", "RoundRecord", "round_record"]

RECENT_UPDATES = 8  # committed updates a new one is judged against (unsigned runs)

logger = logging.getLogger(__name__)


class RoundRecord(TypedDict):
    """One exchange as a manager saw it (a plain dict, so it logs as JSON).

    round: the outer round it would produce; store_step: the exchange step (object store; equal
    to round); committed; included_ranks / excluded_ranks (object store; [] when the manager
    does not know replica identities); participants: how many replicas the average included;
    tokens / inner_steps: what this replica trained for the round (tokens None if not
    reported); bytes_uploaded / bytes_downloaded; seconds; healed: this record is a heal, not an
    exchange; error: why the round failed (None if it did not); rejected: rank (as a string) ->
    why its contribution was left out of the round (missing, refused, screened out, squatted);
    aggregate: the merge method of the commit; requests: store requests this replica sent for
    the round, by kind (put/get/head/list/delete; object store only, else {});
    upload_seconds / wait_seconds / merge_seconds: where the exchange's time went (object store:
    uploading this replica's contribution, waiting for the peers' and the commit, merging);
    refused: why the round's committed update was not applied (unsigned runs: non-finite, or a
    norm outlier against the recent rounds), else None; objects_refused: object key -> why
    this replica refused an object it read to decide where the run is (a planted head hint),
    since its previous record.
    """

    round: int
    store_step: int
    committed: bool
    included_ranks: list[int]
    excluded_ranks: list[int]
    participants: int
    tokens: int | None
    inner_steps: int
    bytes_uploaded: int
    bytes_downloaded: int
    seconds: float
    healed: bool
    error: str | None
    rejected: dict[str, str]
    aggregate: str
    requests: dict[str, int]
    upload_seconds: float
    wait_seconds: float
    merge_seconds: float
    refused: str | None
    objects_refused: dict[str, str]


def round_record(round_: int, *, committed: bool = False, healed: bool = False) -> RoundRecord:
    """A `RoundRecord` with nothing measured yet."""
    return RoundRecord(
        round=round_,
        store_step=round_,
        committed=committed,
        included_ranks=[],
        excluded_ranks=[],
        participants=0,
        tokens=None,
        inner_steps=0,
        bytes_uploaded=0,
        bytes_downloaded=0,
        seconds=0.0,
        healed=healed,
        error=None,
        rejected={},
        aggregate="mean",
        requests={},
        upload_seconds=0.0,
        wait_seconds=0.0,
        merge_seconds=0.0,
        refused=None,
        objects_refused={},
    )


class _StoreWork(dist.Work):
    """The Work DiLoCo waits on: waiting runs (or joins) the round's single store exchange."""

    def __init__(self, manager: ObjectStoreManager, tensor: torch.Tensor) -> None:
        super().__init__()
        self._manager = manager
        self._tensor = tensor
        self._future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._manager._finish_exchange()
        return True

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        return self._future


class _DoneWork(dist.Work):
    """An already-completed Work (the tensor is left as it is)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self._future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._future.set_result(tensor)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        return self._future


class ObjectStoreManager:
    """torchft-Manager stand-in backed by an `ObjectStoreAllReduce` (see the module docstring).

    Args:
        allreduce: the replica's `ObjectStoreAllReduce` handle (must have a rank).
        checkpoint_every: publish the outer state every this many committed rounds (1 = every
            round; a restarted replica waits for the next published state, so larger values
            trade store traffic for slower rejoin).
        state_timeout_s: how long a healing replica waits for the state of the latest committed
            round to be published (default: the store's step timeout).
    """

    # torchft's name for the quorum mode, read by DiLoCo; the object store's is synchronous
    _use_async_quorum: bool = False

    def __init__(
        self,
        allreduce: ObjectStoreAllReduce,
        *,
        checkpoint_every: int = 1,
        state_timeout_s: float | None = None,
    ) -> None:
        if not isinstance(allreduce, ObjectStoreAllReduce):
            raise TypeError(
                f"ObjectStoreManager needs an ObjectStoreAllReduce, got {type(allreduce).__name__}"
            )
        if allreduce.rank is None:
            raise ValueError(
                "ObjectStoreManager needs a replica handle: build the ObjectStoreAllReduce with "
                "rank=<this replica's rank> (a rank=None handle is for drivers/observers)"
            )
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self.exchange = allreduce
        self.rank: int = allreduce.rank
        self.checkpoint_every = checkpoint_every
        self.state_timeout_s = (
            float(state_timeout_s) if state_timeout_s is not None else allreduce.timeout_s
        )
        self._state = StateFns()
        self._heal_hooks: list[Callable[[], None]] = []

        self._round = 0  # committed outer steps applied to our global weights
        self._batches_committed = 0
        self._tokens: int | None = None
        self._inner_steps = 0
        # Snapshot of the counters when the round's first tensor was queued: with
        # fragment_sync_delay > 0 the exchange runs while the next round's steps are counted.
        self._round_tokens: int | None = None
        self._round_inner_steps = 0
        self._fatal: BaseException | None = None

        self._pending: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]] = []
        self._thread: threading.Thread | None = None
        # (committed, the step's result or the exception that failed it)
        self._outcome: tuple[bool, StepResult | BaseException | None] | None = None
        self._skip_round = False
        self._publish_due = False
        self._last_failed = False  # the last exchange failed: look for missed rounds by listing
        self._requests_at_quorum = allreduce.store.requests.snapshot()
        self._last_included: list[int] = []
        self._last_committer: int | None = None  # who wrote the last applied round's record
        self.history: list[RoundRecord] = []
        # norms of the last committed updates applied (the reference of `_screen_update`)
        self._update_norms: deque[float] = deque(maxlen=RECENT_UPDATES)
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0
        self.checkpoint_bytes = 0

    # ------------------------------------------------------------------ torchft Manager surface
    def register_state_dict_fn(
        self, key: str, load_state_dict: LoadStateFn, state_dict: SaveStateFn
    ) -> None:
        """Register a (load, save) pair; DiLoCo registers one per fragment."""
        self._state.register(key, load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        """No-op: nothing reads our state concurrently (torchft serves it to healing peers)."""

    def disallow_state_dict_read(self) -> None:
        """Called before every inner optimizer step: start a queued exchange in the background."""
        if self._pending and self._thread is None and self._outcome is None:
            self._thread = threading.Thread(
                target=self._exchange, name="diloco-store-exchange", daemon=True
            )
            self._thread.start()

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Begin a round: heal first if this replica missed a committed round (see the module)."""
        self._skip_round = False
        self._requests_at_quorum = self.exchange.store.requests.snapshot()
        latest = None
        if allow_heal:
            hint = self.exchange.head_step()
            if self._last_failed or (hint is not None and hint > self._round + 1):
                latest = self.exchange.latest_committed_step()  # a listing, off the steady state
        if latest is not None and latest > self._round + 1:
            # We missed at least one whole committed round (latest == round + 1 only means the
            # round we are joining is decided already: we still read its result and keep up).
            self._heal(latest)
            self._skip_round = True
        else:
            self._ensure_published()

    def current_step(self) -> int:
        """Committed outer rounds so far (DiLoCo picks the fragment to sync from this)."""
        return self._round

    def batches_committed(self) -> int:
        return self._batches_committed

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: object = None
    ) -> dist.Work:
        """Queue `tensor` for this round's exchange; it is averaged in place when waited on.

        should_quantize is ignored: the wire codec is the store's (``codec=`` on
        ObjectStoreAllReduce). Only averaging is supported (DiLoCo's use).
        """
        if reduce_op is not None and str(reduce_op).split(".")[-1].upper() not in ("AVG", "0"):
            raise ValueError(f"ObjectStoreManager only averages; got reduce_op={reduce_op}")
        if self._skip_round:
            return _DoneWork(tensor)
        if self._outcome is not None or self._thread is not None:
            raise RuntimeError(
                "allreduce() called while the previous exchange is still unresolved; "
                "call should_commit() once per round"
            )
        if not self._pending:
            self._round_tokens, self._round_inner_steps = self._tokens, self._inner_steps
            self._tokens, self._inner_steps = None, 0
        work = _StoreWork(self, tensor)
        self._pending.append((tensor, work.get_future()))
        return work

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """True if this round's averaged pseudo-gradient may be applied (advances the round)."""
        if self._skip_round:
            self._skip_round = False
            return False
        if self._pending or self._outcome is not None or self._thread is not None:
            self._finish_exchange()
        assert self._outcome is not None
        committed, result = self._outcome
        self._outcome = None
        if committed:
            included = list(result.included_ranks) if isinstance(result, StepResult) else []
            self._round += 1
            self._batches_committed += len(included) or 1
            self._last_included = included
            self._last_committer = result.committed_by if isinstance(result, StepResult) else None
            self._publish_due = self._round % self.checkpoint_every == 0
        elif isinstance(result, ListedContributionError):
            self._adopt(result)  # False all the same: nothing averaged to step with
        return committed

    def errored(self) -> None:
        return None

    def report_error(self, e: Exception) -> None:
        logger.warning("ObjectStoreManager: error reported by the outer loop: %s", e)

    def num_participants(self) -> int:
        return len(self._last_included) or self.exchange.world_size

    def participating_rank(self) -> int | None:
        return self.rank

    def is_participating(self) -> bool:
        return True

    def state_dict(self) -> dict[str, int]:
        return {"step": self._round, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._round = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def shutdown(self, wait: bool = True) -> None:
        """torchft's name for `drain` (``wait=False``: publish without joining an exchange)."""
        if wait:
            self.drain()
        else:
            self.publish_if_due()

    # ------------------------------------------------------------------ outer-loop hooks
    def record_tokens(self, n: int) -> None:
        """Add `n` trained tokens to this round's contribution (for weighting="tokens")."""
        if n < 0:
            raise ValueError(f"token count must be >= 0, got {n}")
        self._tokens = (self._tokens or 0) + int(n)

    def record_inner_step(self) -> None:
        self._inner_steps += 1

    def drain(self) -> None:
        """End of training: finish a background exchange (if any) and publish a due state."""
        if self._thread is not None:
            self._thread.join()
        self.publish_if_due()

    def close(self) -> None:
        """Release the exchange's upload/fetch threads (the manager is done)."""
        self.exchange.close()

    def add_heal_hook(self, fn: Callable[[], None]) -> None:
        """`fn` runs after a heal loaded new global weights (the outer loop copies them in)."""
        self._heal_hooks.append(fn)

    def initial_sync(self, named_parameters: Mapping[str, torch.Tensor]) -> int:
        """Make this replica start from the run's global state; returns the round it resumes at.

        Checks the run manifest (same parameter names/shapes/dtypes, world size, codec),
        publishes our own state as round 0 if the store holds none (first writer wins, so
        replicas that raced agree), then loads the newest stored state: round 0 on a fresh run,
        round r on a restart.
        """
        self.exchange.ensure_manifest(model_fingerprint(dict(named_parameters)))
        state = fetch_outer_state(self.exchange)
        if state is None:
            own = OuterState(round=0, user=self._state.collect(), batches_committed=0)
            self._put_state(own, stride=1)
            state = fetch_outer_state(self.exchange)
            if state is None:
                raise RuntimeError(
                    f"published the initial state to {self.exchange.uri} but cannot read it"
                )
        self._load(state)
        return self._round

    def publish_if_due(self) -> bool:
        """Publish the outer state after a committed round if this replica is the publisher.

        The publisher is the round's committer, which holds every contribution its record lists
        (a replica that cannot read one of them waits for this state: `_adopt`), or the lowest
        included rank when the result names no committer; exactly one replica uploads, others
        skip. Returns True if this call wrote the state.
        """
        if not self._publish_due:
            return False
        self._publish_due = False
        publisher = self._last_committer
        if publisher is None and self._last_included:
            publisher = min(self._last_included)
        if publisher is not None and self.rank != publisher:
            return False
        return self._publish()

    def _publish(self) -> bool:
        state = OuterState(
            round=self._round,
            user=self._state.collect(),
            batches_committed=self._batches_committed,
            update_norms=tuple(self._update_norms),
        )
        before = self.exchange.store.requests.snapshot()
        wrote = self._put_state(state, stride=self.checkpoint_every)
        if wrote:
            self.checkpoint_bytes += state_nbytes(state.user)
        last = self.history[-1] if self.history else None
        if last is not None and last["round"] == self._round and not last["healed"]:
            spent = self.exchange.store.requests.since(before)
            last["requests"] = {k: last["requests"].get(k, 0) + v for k, v in spent.items()}
        return wrote

    # ------------------------------------------------------------------ internals
    def _put_state(self, state: OuterState, *, stride: int) -> bool:
        """Publish ``state`` (False: that round was there), through a store that refuses writes
        for a while (put-if-absent: safe to repeat), then loudly: the replica fails and is
        restarted."""
        return retry_write(
            lambda _left: publish_outer_state(self.exchange, state, stride=stride),
            what=f"rank {self.rank}: publishing the global state of round {state.round}",
            within_s=STATE_WRITE_RETRY_S,
        )

    def _load(self, state: OuterState) -> None:
        self._state.load(state)
        self._round = state.round
        self._batches_committed = state.batches_committed
        # the tripwire's reference: the run's recent updates, not this process's
        self._update_norms.clear()
        self._update_norms.extend(state.update_norms)

    def _ensure_published(self) -> None:
        """Publish our current round's state if nobody has (its publisher may have died)."""
        if self._state and not outer_state_exists(self.exchange, self._round):
            self._publish()

    def _heal(self, latest: int) -> None:
        """Load the newest published outer state (waiting for round `latest` to appear)."""
        state = wait_for_outer_state(self.exchange, latest, self.state_timeout_s)
        if state is None or state.round <= self._round:
            raise StoreTimeoutError(
                f"rank {self.rank} is at round {self._round} but the run committed step "
                f"{latest}, and no newer outer state was published within state_timeout_s="
                f"{self.state_timeout_s}; restart this replica to resume from the store"
            )
        logger.info("rank %s healing: round %s -> %s", self.rank, self._round, state.round)
        self._take_state(state)

    def _adopt(self, failed: ListedContributionError) -> bool:
        """The round's exchange committed a record listing a contribution we cannot read or
        verify: load the round's published outer state instead (module docstring). True if
        it was loaded; False leaves the round failed, to be retried as before."""
        step = failed.step
        why = self._cannot_adopt(step)
        state = None
        if why is None:
            state, why = self._wait_for_round(step)
        if state is None:
            logger.warning(
                "rank %s: store step %s committed but cannot be applied here, and its result "
                "cannot be adopted (%s): the round fails and is retried as before",
                self.rank,
                step,
                why,
            )
            return False
        logger.warning(
            "rank %s: store step %s committed (by rank %s) but cannot be applied here (%s); "
            "adopting its published outer state",
            self.rank,
            step,
            failed.committed_by,
            failed,
        )
        self._take_state(state)
        self._last_included = list(failed.included_ranks)
        self._last_failed = False
        return True

    def _cannot_adopt(self, step: int) -> str | None:
        """Why round ``step``'s published state cannot stand for it here, or None."""
        if not self._state:
            return "no outer state is registered with this manager"
        if step != self._round + 1:
            return f"this replica is at round {self._round}, not {step - 1}"
        if step % self.checkpoint_every != 0:
            return f"round {step} is not published (checkpoint_every={self.checkpoint_every})"
        return None

    def _wait_for_round(self, step: int) -> tuple[OuterState | None, str]:
        """Round ``step``'s published state, polled by key within ``state_timeout_s`` (no
        listing, one download), or (None, why not)."""
        ex = self.exchange
        deadline = time.monotonic() + self.state_timeout_s
        while not outer_state_exists(ex, step):
            if time.monotonic() >= deadline:
                return None, (
                    f"its outer state was not published within state_timeout_s="
                    f"{self.state_timeout_s}"
                )
            if ex.cancelled.wait(ex.poll_interval_s):
                return None, "the exchange was cancelled"
        try:
            state = fetch_outer_state(ex, step)
        except ValueError as e:  # damaged, forged or malformed (CorruptContributionError too)
            why = f"its published outer state is refused: {e}"
            ex.refusals.append((state_key(STATE_NAME, step), why))  # a "rejected" event
            return None, why
        if state is None or state.round != step:
            return None, f"its published outer state of round {step} is gone"
        return state, ""

    def _take_state(self, state: OuterState) -> None:
        """Load a newer round's published state in place of this replica's (heal, adopt)."""
        self._load(state)
        self.bytes_downloaded += state_nbytes(state.user)
        for fn in self._heal_hooks:
            fn()
        self.history.append(round_record(state.round, committed=True, healed=True))

    def _exchange(self) -> None:
        """Run the store allreduce for the queued tensors and record the outcome (any thread)."""
        pending = self._pending
        step = self._round + 1
        tensors = {f"p{i:06d}": t for i, (t, _) in enumerate(pending)}
        t0 = time.monotonic()
        record = round_record(step)
        record["tokens"], record["inner_steps"] = self._round_tokens, self._round_inner_steps
        try:
            out = self.exchange.allreduce(
                tensors,
                step=step,
                tokens=self._round_tokens,
                inner_steps=self._round_inner_steps or None,
            )
            self._screen_update(step, out)
            with torch.no_grad():
                for key, (t, _) in zip(tensors, pending):
                    t.copy_(out[key])
            result = self.exchange.last_result
            self._outcome = (True, result)
            self._last_failed = False
            record["committed"] = True
            if result is not None:
                record["rejected"] = {str(r): why for r, why in sorted(result.rejected.items())}
                record["aggregate"] = result.aggregate
                record["included_ranks"] = list(result.included_ranks)
                record["excluded_ranks"] = list(result.excluded_ranks)
                record["participants"] = len(result.included_ranks)
                record["bytes_uploaded"] = int(result.bytes_uploaded)
                record["bytes_downloaded"] = int(result.bytes_downloaded)
                record["upload_seconds"] = result.upload_seconds
                record["wait_seconds"] = result.wait_seconds
                record["merge_seconds"] = result.merge_seconds
                self.bytes_uploaded += int(result.bytes_uploaded)
                self.bytes_downloaded += int(result.bytes_downloaded)
        except RoundStoppedError as e:
            # Every rank is judged and too few are valid (the step can never commit: a retry
            # would meet the same immutable objects), or the committed update is refused.
            # Stop, with the refusals on record.
            logger.error("rank %s: store step %s stops the run: %s", self.rank, step, e)
            record["error"] = f"{type(e).__name__}: {e}"
            record["rejected"] = {str(r): why for r, why in sorted(e.rejected.items())}
            if isinstance(e, UpdateRefusedError):
                record["refused"] = str(e)
            self._outcome = (False, e)
            self._fatal = e
        except (StoreTimeoutError, CorruptContributionError) as e:
            # Nothing was committed for this step (too few replicas in time), or the commit lists
            # a contribution we cannot verify (ListedContributionError: should_commit then
            # adopts the round's published state, or the round fails too). DiLoCo rolls back to
            # the global weights and the step is retried next round (see the module docstring).
            logger.warning("rank %s: store step %s failed: %s", self.rank, step, e)
            record["error"] = f"{type(e).__name__}: {e}"
            self._outcome = (False, e)
            self._last_failed = True
        except BaseException as e:  # programming/config errors: surface them in the caller
            record["error"] = f"{type(e).__name__}: {e}"
            self._outcome = (False, e)
            self._fatal = e
        finally:
            record["seconds"] = time.monotonic() - t0
            record["requests"] = self.exchange.store.requests.since(self._requests_at_quorum)
            record["objects_refused"] = self._take_refusals()
            self.history.append(record)
            for t, fut in pending:
                if not fut.done():
                    fut.set_result(t)

    def _take_refusals(self) -> dict[str, str]:
        """The exchange's refusals of objects since the last record (they are cleared)."""
        refusals = dict(self.exchange.refusals)
        self.exchange.refusals.clear()
        return refusals

    def _screen_update(self, step: int, update: Mapping[str, torch.Tensor]) -> None:
        """Unsigned runs: refuse a committed global update that is non-finite or whose norm is an
        outlier against the run's recent rounds (`contribution_screening.norm_outlier`, the rule
        that screens contributions, at the exchange's ``aggregate_outlier_ratio``). A tripwire, not
        a security boundary: signing is what keeps forged commit records out (docs/security.md)."""
        if self.exchange.keys is not None:
            return
        stats = tensor_stats(update)
        why = stats.nonfinite and f"non-finite values: {stats.nonfinite}"
        why = why or norm_outlier(
            stats.norm,
            list(self._update_norms),
            self.exchange.policy.aggregate_outlier_ratio,
            against=f"the last {len(self._update_norms)} rounds'",
        )
        if why:
            raise UpdateRefusedError(
                f"step {step}: the committed global update is not applied ({why}); a forged "
                "or broken commit record? (unsigned run: see docs/security.md)",
                step=step,
                rejected=self.exchange.last_result.rejected if self.exchange.last_result else {},
            )
        self._update_norms.append(stats.norm)

    def _finish_exchange(self) -> None:
        """Make sure the queued exchange has run (synchronously if it has not started)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        elif self._pending and self._outcome is None:
            self._fatal = None
            self._exchange()
        self._pending = []
        fatal = self._fatal
        if fatal is not None:
            self._fatal = None
            self._outcome = None
            raise fatal


MockManager = ObjectStoreManager
"""The seed documents' name for `ObjectStoreManager` (same class)."""
