"""A lease in an object store: at most one active holder of a role (the run's synchronizer).

Object stores give us put-if-absent and overwrite, not compare-and-swap, so the lease is a chain
of *epochs*, each one document written with put-if-absent::

    <prefix>/leases/<name>/<epoch:010d>.json
    {"format": 1, "kind": "lease", "name": "synchronizer", "epoch": 3, "owner": "host-4242-ab12",
     "ttl_s": 10.0, "renewals": 57, "released": false, "time": 1732233600.0}

- **Acquire**: with no epoch yet, write epoch 1. Otherwise watch the newest epoch: it is free when
  its holder released it, or when its document has not changed (no renewal) for ``ttl_s`` on
  the *candidate's own monotonic clock*. Then write epoch + 1 with put-if-absent: of several
  candidates exactly one wins; the others watch the new epoch. No wall clocks are compared, so
  clock skew between machines does not matter.
- **Renew**: the holder first checks that epoch + 1 does not exist (if it does, it has been
  fenced: a candidate took over while it was stopped or cut off, and `renew` returns False),
  then overwrites its own epoch's document with ``renewals + 1``.
- **Holding**: `held()` is True only while the last successful renewal started less than
  ``ttl_s * safety`` ago (default half the TTL). A candidate cannot take over before the holder's
  last renewal plus ``ttl_s``, so a holder that acts only while `held()` never overlaps a
  successor, provided one action (a put of a decision record) takes less than the remaining
  margin. Decisions written with put-if-absent stay single even if that assumption fails.
- **Release**: the holder marks its epoch released, so a successor need not wait for the TTL.

The holder deletes epochs older than its predecessor. Nothing read is unpickled; a lease document
that is not valid JSON of this format is treated as a lease that never renews (it expires).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from composer_replication.exchange.store import Store
from composer_replication.json_types import JSONDict

__all__ = ["Lease", "LeaseState", "lease_prefix"]

log = logging.getLogger(__name__)

FORMAT = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def lease_prefix(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.startswith("."):
        raise ValueError(f"lease name {name!r} must be 1-64 characters of [A-Za-z0-9_.-]")
    return f"leases/{name}/"


def _epoch_name(epoch: int) -> str:
    return f"{epoch:010d}.json"


def _parse_epoch(name: str) -> int | None:
    stem, dot, ext = name.partition(".")
    return int(stem) if dot and ext == "json" and stem.isdigit() and len(stem) == 10 else None


@dataclass(frozen=True)
class LeaseState:
    """One epoch's document as read (``None`` fields: unreadable document)."""

    epoch: int
    owner: str | None
    renewals: int | None
    released: bool
    raw: bytes


class Lease:
    """See the module docstring. ``owner`` defaults to ``<host>-<pid>-<random>``.

    Thread-safe: one thread may renew while another asks `held()`.
    """

    def __init__(
        self,
        store: Store,
        name: str = "synchronizer",
        *,
        owner: str | None = None,
        ttl_s: float = 10.0,
        poll_interval_s: float = 0.25,
        safety: float = 0.5,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if not 0 < poll_interval_s < ttl_s:
            raise ValueError(
                f"poll_interval_s must be in (0, ttl_s={ttl_s}), got {poll_interval_s}"
            )
        if not 0 < safety < 1:
            raise ValueError(f"safety must be in (0, 1), got {safety!r}")
        self.store = store
        self.name = name
        self.prefix = lease_prefix(name)
        self.owner = owner or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.ttl_s = float(ttl_s)
        self.poll_interval_s = float(poll_interval_s)
        self.safety = float(safety)
        self.epoch: int | None = None  # the epoch we hold (None: not holding)
        self._renewals = 0
        self._renewed_at = 0.0  # monotonic time at which the last successful renewal started
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Lease({self.name!r}, owner={self.owner!r}, epoch={self.epoch})"

    # ------------------------------------------------------------------ reading
    def _key(self, epoch: int) -> str:
        return self.prefix + _epoch_name(epoch)

    def newest_epoch(self) -> int | None:
        """The highest epoch written so far (one LIST), or None."""
        epochs = [e for e in map(_parse_epoch, self.store.list(self.prefix)) if e is not None]
        return max(epochs, default=None)

    def read(self, epoch: int) -> LeaseState | None:
        raw = self.store.get(self._key(epoch))
        if raw is None:
            return None
        raw = bytes(raw)
        try:
            doc = json.loads(raw)
            ok = (
                isinstance(doc, dict)
                and doc.get("format") == FORMAT
                and doc.get("kind") == "lease"
                and doc.get("epoch") == epoch
                and isinstance(doc.get("owner"), str)
                and isinstance(doc.get("renewals"), int)
                and isinstance(doc.get("released"), bool)
            )
        except (UnicodeDecodeError, json.JSONDecodeError):
            ok = False
        if not ok:
            log.warning("lease %s epoch %d: not a valid lease document", self.name, epoch)
            return LeaseState(epoch, None, None, False, raw)
        return LeaseState(epoch, doc["owner"], doc["renewals"], doc["released"], raw)

    def _doc(self, epoch: int, renewals: int, released: bool = False) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "kind": "lease",
                "name": self.name,
                "epoch": epoch,
                "owner": self.owner,
                "ttl_s": self.ttl_s,
                "renewals": renewals,
                "released": released,
                "time": time.time(),
            },
            sort_keys=True,
        ).encode()

    # ------------------------------------------------------------------ holding
    def held(self) -> bool:
        """True while we hold the lease and our last renewal is recent enough to act on."""
        with self._lock:
            return (
                self.epoch is not None
                and time.monotonic() - self._renewed_at < self.ttl_s * self.safety
            )

    def try_acquire(self, observed: dict[int, tuple[bytes, float]] | None = None) -> bool:
        """One acquisition attempt (see the module docstring); True if we now hold the lease.

        ``observed`` carries what this candidate saw between calls: epoch -> (document bytes,
        monotonic time first seen unchanged). `acquire` passes its own dict.
        """
        observed = {} if observed is None else observed
        newest = self.newest_epoch()
        target = 1 if newest is None else newest + 1
        if newest is not None:
            state = self.read(newest)
            if state is None:  # deleted between LIST and GET: look again next time
                return False
            now = time.monotonic()
            raw, since = observed.get(newest, (b"", now))
            if raw != state.raw:
                since = now  # it changed (a renewal): the TTL restarts from now
            observed.clear()
            observed[newest] = (state.raw, since)
            if state.owner == self.owner and not state.released:
                # our own epoch from an earlier incarnation of this object: never reuse it
                pass
            elif not state.released and now - since < self.ttl_s:
                return False
        started = time.monotonic()
        if not self.store.put_if_absent(self._key(target), self._doc(target, 0)):
            return False  # another candidate won this epoch
        with self._lock:
            self.epoch = target
            self._renewals = 0
            self._renewed_at = started
        log.info("lease %s: %s holds epoch %d", self.name, self.owner, target)
        self._gc(target)
        return True

    def acquire(
        self, timeout_s: float | None = None, cancelled: threading.Event | None = None
    ) -> bool:
        """Block until we hold the lease (True), ``timeout_s`` passes or ``cancelled`` is set
        (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        observed: dict[int, tuple[bytes, float]] = {}
        while True:
            try:
                if self.try_acquire(observed):
                    return True
            except OSError as e:  # transient store error: keep trying
                log.warning("lease %s: acquire attempt failed: %r", self.name, e)
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if cancelled is not None:
                if cancelled.wait(self.poll_interval_s):
                    return False
            else:
                time.sleep(self.poll_interval_s)

    def renew(self) -> bool:
        """Extend the lease; False (and no longer holding) if a successor has taken over."""
        with self._lock:
            epoch = self.epoch
        if epoch is None:
            return False
        started = time.monotonic()
        if self.store.exists(self._key(epoch + 1)):
            log.warning(
                "lease %s: epoch %d superseded; %s steps down", self.name, epoch, self.owner
            )
            with self._lock:
                self.epoch = None
            return False
        with self._lock:
            self._renewals += 1
            renewals = self._renewals
        self.store.put(self._key(epoch), self._doc(epoch, renewals))
        with self._lock:
            if self.epoch == epoch:
                self._renewed_at = started
        return True

    def release(self) -> None:
        """Give the lease up now (a successor need not wait for the TTL)."""
        with self._lock:
            epoch, self.epoch = self.epoch, None
            renewals = self._renewals
        if epoch is not None and not self.store.exists(self._key(epoch + 1)):
            self.store.put(self._key(epoch), self._doc(epoch, renewals + 1, released=True))

    def _gc(self, epoch: int) -> None:
        try:
            for name in self.store.list(self.prefix):
                e = _parse_epoch(name)
                if e is not None and e < epoch - 1:
                    self.store.delete(self.prefix + name)
        except OSError as e:  # housekeeping only
            log.warning("lease %s: deleting old epochs failed: %r", self.name, e)

    def info(self) -> JSONDict:
        """JSON-able view for status documents."""
        with self._lock:
            return {
                "name": self.name,
                "owner": self.owner,
                "epoch": self.epoch,
                "renewals": self._renewals,
                "ttl_s": self.ttl_s,
            }
