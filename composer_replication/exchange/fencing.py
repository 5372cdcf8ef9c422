"""Run generations: one writer per rank after a driver crash and a `--resume`.

Every launch of a run (the first one and each `--resume`) writes the run's generation to the
store, one counter that only grows::

    <prefix>/run_generation.json
    {"format": 1, "kind": "generation", "generation": 3, "time": 1732233600.5,
     "pid": 4242, "host": "laptop"}

The driver hands its generation to the replicas it launches. A replica whose generation is
older than the store's belongs to a launch that has been superseded (its driver crashed and the
run was resumed): `Fence` raises `FencedError` before it writes anything, and the replica stops.
The document is written with a plain overwrite (object stores have no compare-and-swap on every
backend); two drivers resuming the same run at the same moment are refused earlier, by the run
folder's driver record and the liveness check of `--resume`.

`Fence` is a callable so that writers take it without knowing this module (`ObjectStore`'s write
guard, the exchange's ``fence=``). Each check is one GET. The document is untrusted input: a
value that is not a format-1 generation document raises ValueError naming the key.

With the run's slot secret (``secret``: every launch of the run and every replica holds it, a
party with only bucket access does not) the document carries ``"mac"``, an HMAC of the
generation under it, and a `Fence` given the secret trips only on a document whose MAC
verifies: a planted or damaged ``run_generation.json`` is ignored (one warning) instead of
stopping every replica. A launch still numbers itself above whatever number the document holds
(a forged high number costs nothing: generations only compare).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import socket
import time

from composer_replication.exchange.store import Store
from composer_replication.json_types import JSONDict

__all__ = [
    "GENERATION_KEY",
    "Fence",
    "FencedError",
    "bump_generation",
    "read_generation",
]

GENERATION_KEY = "run_generation.json"
FORMAT = 1

log = logging.getLogger(__name__)


class FencedError(RuntimeError):
    """A newer launch of the run owns the store: this process must not write anything."""


def _parse(doc: object) -> int:
    if doc is None:
        return 0
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("kind") != "generation":
        raise ValueError(f"{GENERATION_KEY} is not a format-1 generation document")
    g = doc.get("generation")
    if not isinstance(g, int) or isinstance(g, bool) or g < 0:
        raise ValueError(f"{GENERATION_KEY}: generation {g!r} is not an integer >= 0")
    return g


def _mac(secret: bytes, generation: int) -> str:
    return hmac.new(secret, f"generation:{generation}".encode(), hashlib.sha256).hexdigest()


def read_generation(store: Store, secret: bytes | None = None) -> int:
    """The run's current generation (0 when no launch wrote one: a replica started by hand).
    With ``secret``: ValueError unless the document's MAC verifies under it."""
    doc = store.get_json(GENERATION_KEY)
    generation = _parse(doc)
    if secret is not None and doc is not None:
        mac = doc.get("mac") if isinstance(doc, dict) else None
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, generation)):
            raise ValueError(
                f"{GENERATION_KEY}: its MAC does not verify (not written by a launch of this run)"
            )
    return generation


def bump_generation(store: Store, secret: bytes | None = None) -> int:
    """Write generation = current + 1 (what every launch of a run does first); returns it.
    ``secret``: the run's slot secret, to MAC the document with (module docstring)."""
    generation = read_generation(store) + 1
    doc: JSONDict = {
        "format": FORMAT,
        "kind": "generation",
        "generation": generation,
        "time": time.time(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    if secret is not None:
        doc["mac"] = _mac(secret, generation)
    store.put_json(GENERATION_KEY, doc)
    return generation


class Fence:
    """``fence()`` raises `FencedError` when the store's generation is newer than ours.

    ``min_interval_s``: re-read the store at most this often (0: every call); a fence that has
    tripped stays tripped without asking again. A store that cannot be read does not trip it
    (the write that follows meets the same store error). ``secret``: the run's slot secret; then
    only a document whose MAC verifies can trip it (a planted or damaged one is ignored, with
    one warning, and recorded in ``refused``)."""

    def __init__(
        self,
        store: Store,
        generation: int,
        *,
        min_interval_s: float = 0.0,
        secret: bytes | None = None,
    ) -> None:
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise ValueError(f"generation must be an integer >= 0, got {generation!r}")
        if not (math.isfinite(min_interval_s) and min_interval_s >= 0):
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s!r}")
        self.store = store
        self.generation = generation
        self.min_interval_s = float(min_interval_s)
        self.tripped: str | None = None
        self.secret = secret
        self.refused: str | None = None  # why a document was not believed (secret given)
        self._checked_at: float | None = None

    def __call__(self) -> None:
        if self.tripped is not None:
            raise FencedError(self.tripped)
        now = time.monotonic()
        if self._checked_at is not None and now - self._checked_at < self.min_interval_s:
            return
        try:
            current = read_generation(self.store, self.secret)
        except OSError:
            return
        except ValueError as exc:  # a damaged document: nobody can prove a newer launch exists
            if self.secret is None:
                raise FencedError(f"cannot tell whether this launch is current: {exc}") from None
            if self.refused != str(exc):
                log.warning("ignoring %s: %s", GENERATION_KEY, exc)
                self.refused = str(exc)
            self._checked_at = now
            return
        self._checked_at = now
        if current > self.generation:
            self.tripped = (
                f"fenced: this process belongs to launch {self.generation} of the run, but the "
                f"store is at launch {current} (the run was resumed): it stops without writing"
            )
            raise FencedError(self.tripped)
