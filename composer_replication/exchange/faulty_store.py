"""`FaultyStore`: a `Store` that wraps a real one and injects faults by rule.

Fault injection through the interface, as torchft does with its process-group wrappers: the
component under test (`ObjectStoreAllReduce(..., store=...)`, `DecoupledStore`, `RunDocuments`,
the synchronizer, ...) is handed a `FaultyStore` instead of its store, and nothing is patched
process-wide. Each `Fault` names the operation and the keys it hits (a glob), which matching
call it hits first and how many times, and what it does::

    faulty = FaultyStore(ObjectStore(uri), [
        Fault("put_if_absent", "steps/*/commit.json", "fail"),     # the first commit write fails
        Fault("get", "steps/*/contrib/*", "fail", times=2),        # two peer reads fail
        Fault("get", "states/global/*", "corrupt", after=1),       # the 2nd state read: bit rot
        Fault("list", "steps/*", "drop"),                          # a listing misses the steps
    ])

Actions:

- ``fail``: raise ``error`` (default `OSError`, what a transient store error looks like) before
  the request is sent: a write does not happen.
- ``fail_after``: send the request, then raise: a write happened but its answer was lost.
- ``corrupt``: ``get`` returns the object with one byte flipped; ``put`` / ``put_if_absent``
  store it so (bit rot).
- ``delay``: sleep ``delay_s`` seconds, then send the request.
- ``drop``: ``get`` answers None (the object looks absent); ``list`` leaves out the entries the
  glob matches (their full keys); ``put`` / ``put_if_absent`` / ``delete`` / ``delete_many``
  do nothing and answer as if they had succeeded (a lost write or delete).

A rule counts the calls it matches (``seen``) and the ones it hit (``hits``), thread-safely, so
one rule may be shared by the stores of several replicas (a fault that hits whichever replica
gets there first). Rules are tried in order; a call gets at most one fault.
"""

from __future__ import annotations

import fnmatch
import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from composer_replication.exchange.store import Payload, RequestCounter, Store

__all__ = ["ACTIONS", "OPS", "Action", "Fault", "FaultyStore", "Op"]

Op = Literal[
    "put_if_absent",
    "put",
    "get",
    "exists",
    "has_object",
    "list",
    "delete",
    "delete_many",
    "delete_prefix",
]
Action = Literal["fail", "fail_after", "corrupt", "delay", "drop"]
OPS: tuple[str, ...] = get_args(Op)
ACTIONS: tuple[str, ...] = get_args(Action)
_CAN: dict[str, frozenset[str]] = {
    "corrupt": frozenset({"get", "put", "put_if_absent"}),
    "drop": frozenset({"get", "list", "put", "put_if_absent", "delete", "delete_many"}),
}


@dataclass
class Fault:
    """One rule of a `FaultyStore` (see the module docstring).

    ``op``: the operation it hits; ``key``: a glob on the key (``list``: on each listed entry's
    full key; ``delete_prefix``: on the prefix; ``delete_many``: on any of the keys); ``after``:
    matching calls let through before the first hit; ``times``: hits in all (None: every
    matching call from then on); ``error``: what ``fail`` raises (called with a message).
    """

    op: Op
    key: str = "*"
    action: Action = "fail"
    after: int = 0
    times: int | None = 1
    delay_s: float = 0.0
    error: type[Exception] = OSError
    seen: int = field(default=0, init=False)
    hits: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Fault: unknown op {self.op!r}; choose one of {', '.join(OPS)}")
        if self.action not in ACTIONS:
            raise ValueError(
                f"Fault: unknown action {self.action!r}; choose one of {', '.join(ACTIONS)}"
            )
        can = _CAN.get(self.action)
        if can is not None and self.op not in can:
            raise ValueError(
                f"Fault: {self.action!r} applies to {', '.join(sorted(can))}, not {self.op!r}"
            )
        if not isinstance(self.after, int) or self.after < 0:
            raise ValueError(f"Fault: after must be an int >= 0, got {self.after!r}")
        if self.times is not None and (not isinstance(self.times, int) or self.times < 1):
            raise ValueError(f"Fault: times must be an int >= 1 or None, got {self.times!r}")
        if self.action == "delay" and not self.delay_s > 0:
            raise ValueError(f"Fault: a delay needs delay_s > 0, got {self.delay_s!r}")

    def matches(self, key: str) -> bool:
        return fnmatch.fnmatchcase(key, self.key)

    def fire(self) -> bool:
        """Count one matching call; True when this one is hit."""
        with self._lock:
            self.seen += 1
            due = self.seen > self.after and (self.times is None or self.hits < self.times)
            if due:
                self.hits += 1
            return due

    def raise_error(self, op: str, key: str) -> None:
        raise self.error(f"injected fault: {op} {key!r} ({self.action}, hit {self.hits})")


def _corrupt(data: bytes) -> bytes:
    """``data`` with its middle byte flipped (empty data stays empty)."""
    if not data:
        return data
    out = bytearray(data)
    out[len(out) // 2] ^= 0xFF
    return bytes(out)


def _joined(data: Payload) -> bytes:
    return data if isinstance(data, bytes) else b"".join(data)


class FaultyStore:
    """A `Store` over ``inner`` that injects the faults of ``faults`` (see the module)."""

    def __init__(self, inner: Store, faults: Iterable[Fault] = ()) -> None:
        self.inner = inner
        self.faults: list[Fault] = list(faults)

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r}, {len(self.faults)} faults)"

    def add(self, fault: Fault) -> Fault:
        """Add a rule (after the others); returns it, to read its counters later."""
        self.faults.append(fault)
        return fault

    @property
    def uri(self) -> str:
        return self.inner.uri

    @property
    def is_local(self) -> bool:
        return self.inner.is_local

    @property
    def requests(self) -> RequestCounter:
        """The inner store's counter: a request a fault stopped was never sent."""
        return self.inner.requests

    def _fault(self, op: str, keys: Sequence[str]) -> Fault | None:
        """The rule that hits this call (delays are served here), or None."""
        for fault in self.faults:
            if fault.op == op and any(fault.matches(k) for k in keys) and fault.fire():
                if fault.action == "fail":
                    fault.raise_error(op, keys[0] if keys else "")
                if fault.action == "delay":
                    time.sleep(fault.delay_s)
                    return None
                return fault
        return None

    # ------------------------------------------------------------------ bytes
    def put_if_absent(self, key: str, data: Payload) -> bool:
        fault = self._fault("put_if_absent", [key])
        if fault is not None and fault.action == "drop":
            return True
        if fault is not None and fault.action == "corrupt":
            data = _corrupt(_joined(data))
        wrote = self.inner.put_if_absent(key, data)
        if fault is not None and fault.action == "fail_after":
            fault.raise_error("put_if_absent", key)
        return wrote

    def put(self, key: str, data: Payload) -> None:
        fault = self._fault("put", [key])
        if fault is not None and fault.action == "drop":
            return
        if fault is not None and fault.action == "corrupt":
            data = _corrupt(_joined(data))
        self.inner.put(key, data)
        if fault is not None and fault.action == "fail_after":
            fault.raise_error("put", key)

    def get(self, key: str) -> bytes | memoryview | None:
        fault = self._fault("get", [key])
        if fault is not None and fault.action == "drop":
            return None
        raw = self.inner.get(key)
        if fault is not None and fault.action == "fail_after":
            fault.raise_error("get", key)
        if fault is not None and fault.action == "corrupt" and raw is not None:
            return _corrupt(bytes(raw))
        return raw

    def exists(self, key: str) -> bool:
        fault = self._fault("exists", [key])
        found = self.inner.exists(key)
        if fault is not None:  # fail_after
            fault.raise_error("exists", key)
        return found

    def has_object(self, key: str) -> bool:
        fault = self._fault("has_object", [key])
        found = self.inner.has_object(key)
        if fault is not None:  # fail_after
            fault.raise_error("has_object", key)
        return found

    def list(self, prefix: str) -> list[str]:
        names = self.inner.list(prefix)
        base = prefix.rstrip("/")
        full = [f"{base}/{n}" if base else n for n in names]
        fault = self._fault("list", full or [base])
        if fault is not None and fault.action == "drop":
            return [n for n, k in zip(names, full) if not fault.matches(k)]
        if fault is not None:  # fail_after
            fault.raise_error("list", prefix)
        return names

    def delete(self, key: str) -> None:
        fault = self._fault("delete", [key])
        if fault is not None and fault.action == "drop":
            return
        self.inner.delete(key)
        if fault is not None:  # fail_after
            fault.raise_error("delete", key)

    def delete_many(self, keys: Sequence[str]) -> None:
        fault = self._fault("delete_many", list(keys))
        if fault is not None and fault.action == "drop":
            return
        self.inner.delete_many(keys)
        if fault is not None:  # fail_after
            fault.raise_error("delete_many", keys[0])

    def delete_prefix(self, prefix: str) -> None:
        fault = self._fault("delete_prefix", [prefix])
        self.inner.delete_prefix(prefix)
        if fault is not None:  # fail_after
            fault.raise_error("delete_prefix", prefix)

    # ------------------------------------------------------------------ JSON documents
    def put_json(self, key: str, obj: object, *, exclusive: bool = False) -> bool:
        """As `ObjectStore.put_json`, through this store's faults."""
        raw = json.dumps(obj, indent=1).encode()
        if exclusive:
            return self.put_if_absent(key, raw)
        self.put(key, raw)
        return True

    def get_json(self, key: str) -> Any:
        """As `ObjectStore.get_json`, through this store's faults."""
        raw = self.get(key)
        if raw is None:
            return None
        try:
            return json.loads(bytes(raw))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.uri}{key} is not a JSON document ({e})") from None


if TYPE_CHECKING:  # mypy proves that FaultyStore is a Store

    def _is_a_store(s: FaultyStore) -> Store:
        return s
