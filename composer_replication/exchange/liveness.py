"""Heartbeats in the run's store, who is alive, and the run-level health state.

Every member of a run (a sync-mode replica, a decoupled learner, the synchronizer, the driver)
proves it is alive by overwriting one small JSON document::

    <prefix>/health/<role>/<member id>.json
    {"format": 1, "kind": "heartbeat", "role": "learner", "id": "2", "time": 1732233600.5,
     "state": "running", "pid": 4242, "host": "node-3", "fields": {"step": 120, ...}}

``time`` is the writer's wall clock (``time.time()``). Readers judge a member by the age of its
last heartbeat measured on *their* wall clock, so the thresholds must exceed the clock skew
between machines (seconds with NTP; the defaults are tens of seconds):

    alive   heartbeat younger than ``stale_after_s``
    stale   older than ``stale_after_s`` but younger than ``dead_after_s`` (a stopped, swapping
            or partitioned member: it may come back)
    dead    older than ``dead_after_s``, or its document is not a valid heartbeat (the reason is
            in ``error``)
    done    the member said it finished (``state="done"``) or failed (``state="failed"``):
            it is not expected to write again, whatever its age

A heartbeat is written from a thread of the member's process, so a process stopped by SIGSTOP
or killed stops writing at once. What the member is doing (its step, round, fragment versions)
goes in ``fields``; readers treat fields as untrusted JSON.

A member that is gone for good, or gone while it is being restarted, can be declared *departed*
by whoever watches its process (the run driver)::

    <prefix>/departed/<role>/<member id>.json
    {"format": 1, "kind": "departure", "role": "replica", "id": "1", "time": 1732233600.5,
     "reason": "killed by signal SIGKILL; restarts exhausted (0 of 0)"}

Peers stop waiting for a departed member at once (the sync exchange treats it as not expected;
its contribution still counts if one arrives). A restarted incarnation deletes its record when
it is ready to take part again (`clear_departure`). A record that is not a valid departure
document is ignored (the member stays expected), so a damaged record never drops anyone.

`run_health` turns the members' liveness into the run-level state ``starting | healthy |
degraded | critical`` (rules in its docstring and in docs/diloco.md). Everything here is a pure function of
the store's documents and the clock; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from composer_replication.exchange.store import Store
from composer_replication.json_types import JSONDict, JSONValue

__all__ = [
    "DEAD_AFTER_S",
    "DEPARTED_PREFIX",
    "HEALTH_PREFIX",
    "HEARTBEAT_EVERY_S",
    "LEARNER_ROLE",
    "REPLICA_ROLE",
    "STALE_AFTER_S",
    "Heartbeat",
    "HealthState",
    "MemberLiveness",
    "RunHealth",
    "clear_departure",
    "departure_key",
    "heartbeat_key",
    "parse_heartbeat",
    "read_departure",
    "read_liveness",
    "run_health",
    "write_departure",
    "write_heartbeat",
]

HEALTH_PREFIX = "health/"
DEPARTED_PREFIX = "departed/"
REPLICA_ROLE = "replica"  # the role of a sync-mode replica
LEARNER_ROLE = "learner"  # the role of a decoupled learner
FORMAT = 1
STALE_AFTER_S = 30.0
HEARTBEAT_EVERY_S = 5.0  # how often a run's replicas and learners write theirs
DEAD_AFTER_S = 120.0
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
STATES = ("running", "done", "failed")

Status = Literal["alive", "stale", "dead", "done"]
HealthState = Literal["starting", "healthy", "degraded", "critical"]


def _check_name(label: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value) or value.startswith("."):
        raise ValueError(
            f"heartbeat {label} {value!r} must be 1-64 characters of [A-Za-z0-9_.-] "
            "(e.g. role 'learner', id '3')"
        )
    return value


def heartbeat_key(role: str, member_id: str | int) -> str:
    """``health/<role>/<id>.json`` (ValueError for a role or id that is not a plain name)."""
    return f"{HEALTH_PREFIX}{_check_name('role', role)}/{_check_name('id', str(member_id))}.json"


@dataclass(frozen=True)
class Heartbeat:
    """One validated heartbeat document."""

    role: str
    id: str
    time: float
    state: str
    pid: int | None = None
    host: str | None = None
    fields: JSONDict = field(default_factory=dict)


def write_heartbeat(
    store: Store,
    role: str,
    member_id: str | int,
    *,
    state: str = "running",
    now: float | None = None,
    **fields: JSONValue,
) -> Heartbeat:
    """Overwrite this member's heartbeat (``fields`` must be JSON-able); returns what was written.

    ``state`` is "running", "done" (finished cleanly: readers stop expecting heartbeats) or
    "failed". Raises ValueError for an unknown state, a bad role/id or non-JSON fields.
    """
    if state not in STATES:
        raise ValueError(f"heartbeat state must be one of {STATES}, got {state!r}")
    key = heartbeat_key(role, member_id)
    hb = Heartbeat(
        role=role,
        id=str(member_id),
        time=time.time() if now is None else float(now),
        state=state,
        pid=os.getpid(),
        host=socket.gethostname(),
        fields=dict(fields),
    )
    doc: JSONDict = {
        "format": FORMAT,
        "kind": "heartbeat",
        "role": hb.role,
        "id": hb.id,
        "time": hb.time,
        "state": hb.state,
        "pid": hb.pid,
        "host": hb.host,
        "fields": hb.fields,
    }
    try:
        store.put_json(key, doc)
    except TypeError as e:  # json.dumps of something that is not JSON
        raise ValueError(f"heartbeat fields must be JSON-serialisable ({e})") from None
    return hb


def parse_heartbeat(doc: object, *, role: str, member_id: str) -> Heartbeat:
    """Validate a heartbeat read from ``health/<role>/<member_id>.json`` (ValueError says why)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("kind") != "heartbeat":
        raise ValueError("not a format-1 heartbeat document")
    if doc.get("role") != role or doc.get("id") != member_id:
        raise ValueError(
            f"document names role {doc.get('role')!r} id {doc.get('id')!r}, not its key's"
        )
    t = doc.get("time")
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t):
        raise ValueError(f"heartbeat time {t!r} is not a finite number")
    if doc.get("state") not in STATES:
        raise ValueError(f"heartbeat state {doc.get('state')!r} is not one of {STATES}")
    pid, host, fields = doc.get("pid"), doc.get("host"), doc.get("fields", {})
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool)):
        raise ValueError("heartbeat pid is not an int")
    if host is not None and not isinstance(host, str):
        raise ValueError("heartbeat host is not a string")
    if not isinstance(fields, dict):
        raise ValueError("heartbeat fields is not an object")
    return Heartbeat(role, member_id, float(t), doc["state"], pid, host, fields)


def departure_key(role: str, member_id: str | int) -> str:
    """``departed/<role>/<id>.json`` (ValueError for a role or id that is not a plain name)."""
    return f"{DEPARTED_PREFIX}{_check_name('role', role)}/{_check_name('id', str(member_id))}.json"


def _departure_mac(secret: bytes, role: str, member_id: str, reason: str) -> str:
    body = f"departure:{role}:{member_id}:{reason}".encode()
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def write_departure(
    store: Store,
    role: str,
    member_id: str | int,
    *,
    reason: str,
    now: float | None = None,
    secret: bytes | None = None,
) -> None:
    """Declare a member departed (overwrites an earlier record); ``reason`` says why.
    ``secret``: the run's slot secret, to MAC the record with (`read_departure`)."""
    if not isinstance(reason, str) or not reason:
        raise ValueError("a departure needs a reason (e.g. 'exit code 1; restarts exhausted')")
    doc: JSONDict = {
        "format": FORMAT,
        "kind": "departure",
        "role": role,
        "id": str(member_id),
        "time": time.time() if now is None else float(now),
        "reason": reason[:500],
    }
    if secret is not None:
        doc["mac"] = _departure_mac(secret, role, str(member_id), reason[:500])
    store.put_json(departure_key(role, member_id), doc)


def read_departure(
    store: Store, role: str, member_id: str | int, *, secret: bytes | None = None
) -> str | None:
    """The reason a member departed, or None when it has not (or the record is not valid).

    One GET. The record is untrusted input: anything but a format-1 departure document naming
    this very member is ignored (the member stays expected); with ``secret`` (the run's slot
    secret), so is one whose MAC does not verify (a record planted by a bucket writer)."""
    key = departure_key(role, member_id)
    try:
        doc = store.get_json(key)
    except ValueError:  # not JSON
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None
    if doc.get("kind") != "departure" or doc.get("role") != role:
        return None
    reason = doc.get("reason")
    if doc.get("id") != str(member_id) or not isinstance(reason, str) or not reason:
        return None
    if secret is not None:
        mac = doc.get("mac")
        want = _departure_mac(secret, role, str(member_id), reason)
        if not isinstance(mac, str) or not hmac.compare_digest(mac, want):
            return None
    return reason


def clear_departure(store: Store, role: str, member_id: str | int) -> bool:
    """Delete a member's departure record (it is back); True if there was one."""
    key = departure_key(role, member_id)
    if store.get(key) is None:
        return False
    store.delete(key)
    return True


@dataclass(frozen=True)
class MemberLiveness:
    """What a reader concluded about one member at time ``now``."""

    role: str
    id: str
    status: Status
    age_s: float | None  # seconds since its last heartbeat (None: unreadable document)
    heartbeat: Heartbeat | None
    error: str | None = None

    @property
    def key(self) -> str:
        return f"{self.role}/{self.id}"


def _status(hb: Heartbeat, age: float, stale_after_s: float, dead_after_s: float) -> Status:
    if hb.state in ("done", "failed"):
        return "done"
    if age < stale_after_s:
        return "alive"
    return "stale" if age < dead_after_s else "dead"


def read_liveness(
    store: Store,
    now: float | None = None,
    *,
    roles: Iterable[str] | None = None,
    stale_after_s: float = STALE_AFTER_S,
    dead_after_s: float = DEAD_AFTER_S,
) -> dict[str, MemberLiveness]:
    """Every member that ever wrote a heartbeat (of ``roles``; None = all), keyed ``role/id``.

    ``now`` is the reader's wall clock (default ``time.time()``). One LIST per role plus one GET
    per member. A document that is not a valid heartbeat makes its member "dead" with the
    reason in ``error`` (it cannot prove it is alive).
    """
    if not 0 < stale_after_s < dead_after_s:
        raise ValueError(
            f"need 0 < stale_after_s < dead_after_s, got {stale_after_s} and {dead_after_s}"
        )
    now = time.time() if now is None else float(now)
    wanted = list(roles) if roles is not None else store.list(HEALTH_PREFIX)
    out: dict[str, MemberLiveness] = {}
    for role in wanted:
        if not _NAME_RE.match(role):
            continue
        for name in store.list(f"{HEALTH_PREFIX}{role}/"):
            member_id, dot, ext = name.rpartition(".")
            if ext != "json" or not dot or not _NAME_RE.match(member_id):
                continue
            key = f"{role}/{member_id}"
            try:
                hb = parse_heartbeat(
                    store.get_json(heartbeat_key(role, member_id)), role=role, member_id=member_id
                )
            except ValueError as e:  # not JSON, or JSON that is not a heartbeat
                out[key] = MemberLiveness(role, member_id, "dead", None, None, f"invalid: {e}")
                continue
            age = max(0.0, now - hb.time)  # a clock ahead of ours counts as "just now"
            status = _status(hb, age, stale_after_s, dead_after_s)
            out[key] = MemberLiveness(role, member_id, status, age, hb)
    return out


@dataclass(frozen=True)
class RunHealth:
    """The run-level state and why (``reasons`` is empty when healthy)."""

    state: HealthState
    reasons: list[str]
    alive_workers: int
    expected_workers: int

    def as_dict(self) -> JSONDict:
        return {
            "state": self.state,
            "reasons": list(self.reasons),
            "alive_workers": self.alive_workers,
            "expected_workers": self.expected_workers,
        }


def run_health(
    members: Mapping[str, MemberLiveness],
    *,
    worker_role: str,
    n_workers: int,
    quorum: int,
    synchronizer_role: str | None = None,
    rejections: int = 0,
    starting: bool = False,
) -> RunHealth:
    """The run state from the members' liveness (rules, in order):

    - **critical** when fewer workers are alive than can make progress: alive workers <
      min(quorum, workers that have not finished) (a worker id that never wrote a heartbeat
      counts as not alive); or, when a synchronizer is required (``synchronizer_role``), none
      is alive or stale while workers are still training (nothing gets merged);
    - **degraded** when any unfinished worker is stale or dead (or missing), a synchronizer is
      stale, or ``rejections`` > 0 (contributions were rejected since the caller last looked);
    - **healthy** otherwise (also once every worker has finished).

    With ``starting`` (the caller's start-up window, e.g. the first minutes after a launch), a
    worker or synchronizer that has not written its first heartbeat yet is starting, not
    missing: it counts toward neither rule above, and the state is **starting** when such
    members are all that keep the run from healthy.
    """
    if n_workers < 1 or not 1 <= quorum <= n_workers:
        raise ValueError(
            f"need n_workers >= 1 and 1 <= quorum <= n_workers, got {n_workers}, {quorum}"
        )
    workers = {m.id: m for m in members.values() if m.role == worker_role}
    status = {
        str(i): workers[str(i)].status if str(i) in workers else "missing" for i in range(n_workers)
    }
    unfinished = [i for i, s in status.items() if s != "done"]
    alive = [i for i in unfinished if status[i] == "alive"]
    coming = [i for i in unfinished if starting and status[i] == "missing"]
    critical: list[str] = []
    degraded: list[str] = []
    need = min(quorum, len(unfinished))
    if len(alive) + len(coming) < need:
        critical.append(
            f"{len(alive)} of {len(unfinished)} unfinished {worker_role}s alive, "
            f"fewer than the quorum of {need}"
        )
    for i in unfinished:
        if status[i] != "alive" and i not in coming:
            degraded.append(f"{worker_role} {i} is {status[i]}")
    sync_coming = False
    if synchronizer_role is not None and unfinished:
        syncs = [m for m in members.values() if m.role == synchronizer_role]
        if any(m.status == "alive" for m in syncs):
            pass
        elif any(m.status == "stale" for m in syncs):
            degraded.append(f"{synchronizer_role} is stale (stopped or partitioned?)")
        elif starting and not syncs:
            sync_coming = True
        else:
            critical.append(
                f"no {synchronizer_role} alive ("
                + (", ".join(f"{m.id}: {m.status}" for m in syncs) or "none ever started")
                + "): nothing is merged"
            )
    if rejections > 0:
        degraded.append(f"{rejections} contribution(s) rejected")
    state: HealthState = "critical" if critical else "degraded" if degraded else "healthy"
    reasons = critical + degraded
    if state == "healthy" and (coming or sync_coming):
        state = "starting"
        waiting = [f"{worker_role} {', '.join(coming)}"] if coming else []
        waiting += [f"the {synchronizer_role}"] if sync_coming else []
        reasons = [
            f"{len(alive)} of {len(unfinished)} {worker_role}s up; waiting for the first "
            f"heartbeat of {' and '.join(waiting)}"
        ]
    return RunHealth(state, reasons, len(alive), n_workers)
