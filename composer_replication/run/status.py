"""`composer-replication status RUN`: replicas, outer round, lag and health of a run.

Works while the run is going (from another terminal) and after it ended. Sources: the run
folder's driver.json (what the executor said: exit codes, errors), the replicas' status
documents in the store (what each replica last reported) and the heartbeats in the store
(exchange/liveness.py). Health of one replica:

    ok        reported within `stale_after_s` (or finished cleanly)
    stale     running, but silent for longer than `stale_after_s`
    behind    more than one outer round behind the most advanced replica
    failed    the executor reports it failed (its error is shown)

The run state (`health_now`, also written to the metrics by the driver) is ``starting |
healthy | degraded | critical`` by `exchange.liveness.run_health`'s rules over the heartbeats of
the replicas (their role is the outer-loop mode's: "replica", decoupled "learner") and, where the
mode has one, the synchronizer, plus "a contribution was rejected recently" (the mode reads its
service's heartbeat: `OuterLoopMode.service_status`, whose row is ``health.synchronizer``). For
`STARTUP_GRACE_S` after a
launch (the driver's start of the current attempt), a replica that has not sent its first
heartbeat yet is starting, not missing: the run is ``starting`` until every replica reports, not
``critical``.

Contributions the exchange left out (refused, screened out, squatted; docs/object-store.md) are
listed with rank and reason for the latest round that had any (``rejections``). A run the driver
stopped because a round can never commit (driver.json ``no_quorum``) is ``critical``, naming
that round and its refusals, whatever the heartbeats say.

Dead or alive: driver.json says ``running`` from launch until the driver ends, so a driver killed
with SIGKILL (or whose machine died) leaves it saying so. `status` reads ``running`` only while
the driver runs: a driver pid of this host that is gone, or (a driver on another host) no replica heartbeat within the liveness window
(`exchange.liveness.STALE_AFTER_S`) and a driver.json not updated for `DEAD_AFTER_S` (the driver
updates it every second while it polls), reads ``stopped (driver gone since ...)``, with what
`train --resume` would do (`driver_gone`, `resume`) and the replicas that still send heartbeats
without a driver (a remote backend's; `--resume` fences them first).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import NotRequired, TypedDict

from composer_replication.assembly.outer import outer_loop_mode
from composer_replication.config import RunConfig, from_dict
from composer_replication.diloco.mode_protocol import OuterLoopMode
from composer_replication.exchange.liveness import DEAD_AFTER_S, read_liveness, run_health
from composer_replication.exchange.store import ObjectStore
from composer_replication.json_types import (
    JSONDict,
    JSONValue,
    as_dict,
    as_float,
    as_int,
    as_list,
    as_number,
)
from composer_replication.run.checkpoint import committed_checkpoints
from composer_replication.run.folder import RunFolder
from composer_replication.run.metrics import status_key
from composer_replication.run.processes import pid_alive
from composer_replication.run.security import secret_files, secrets_warning

__all__ = [
    "DriverGone",
    "HealthDoc",
    "ReplicaRow",
    "ResumeInfo",
    "RunStatus",
    "health_now",
    "run_status",
    "status_text",
]

STARTUP_GRACE_S = 300.0
HEALTH_LEVEL = {"starting": -1, "healthy": 0, "degraded": 1, "critical": 2}


class HealthDoc(TypedDict):
    """The run state (`health_now`): `exchange.liveness.RunHealth` plus its level, each
    member's liveness and the mode's service row."""

    state: str
    reasons: list[str]
    level: int
    # from the heartbeats (absent when the store could not be read and the run is critical
    # only because the driver stopped it on a round that cannot commit)
    alive_workers: NotRequired[int]
    expected_workers: NotRequired[int]
    members: NotRequired[dict[str, str]]  # "role/id" -> its liveness status
    synchronizer: NotRequired[JSONDict | None]  # `OuterLoopMode.service_status`'s row


class DriverGone(TypedDict):
    """A driver that says "running" but no longer runs: when it was last seen, how we know."""

    since: float | None  # epoch seconds
    how: str
    pid: JSONValue
    host: JSONValue


class ResumeInfo(TypedDict):
    """What ``train --resume`` would do for a run whose driver is gone."""

    plan: str | None
    warnings: list[str]
    still_running: list[str]  # workers that still send heartbeats without a driver


class ReplicaRow(TypedDict):
    """One replica's line of `run_status`: its status document's fields (as read), what the
    executor said, its lag and health."""

    rank: int
    state: JSONValue
    executor: JSONValue
    exit_code: JSONValue
    step: JSONValue
    max_steps: JSONValue
    round: int
    round_lag: int
    seconds_since_update: float | None
    reward: float | None
    eval_accuracy: float | None
    steps_per_s: float | None
    wait_fraction: float | None
    health: str  # ok | stale | behind | degraded | failed
    error: JSONValue
    skipped: JSONValue


class RunStatus(TypedDict):
    """`run_status`'s description of a run (`status --json` prints it)."""

    run: str
    folder: str
    status: JSONValue  # driver.json's, or "stopped" when its driver is gone
    driver_gone: DriverGone | None
    driver_damage: str | None
    resume: ResumeInfo | None
    lost: list[int]
    started: JSONValue
    ended: JSONValue
    store: str
    store_error: str | None
    round: int
    checkpoints: list[str]
    secrets: list[str]
    replicas: list[ReplicaRow]
    health: HealthDoc | None
    rejections: JSONDict | None  # {"round", "ranks": {rank: reason}}


def health_now(
    store: ObjectStore,
    *,
    mode: OuterLoopMode,
    n_replicas: int,
    now: float | None = None,
    started: float | None = None,
) -> HealthDoc:
    """The run state from the store's heartbeats (see the module docstring), JSON-able:
    ``{"state", "level", "reasons", "members": {"role/id": status}, "synchronizer": {...}}``.
    ``mode``: the run's outer-loop mode (its replicas' role, its quorum, its synchronizer).
    `started`: when the replicas were launched (epoch seconds; None: not known, no start-up
    window)."""
    now = time.time() if now is None else now
    starting = started is not None and 0 <= now - started < STARTUP_GRACE_S
    role = mode.worker_role
    service_roles = mode.service_roles  # decoupled: its synchronizer
    sync_role = service_roles[0] if service_roles else None
    quorum = mode.quorum(n_replicas)
    members = read_liveness(store, now, roles=[role, *service_roles])
    syncs = sorted(
        (m for m in members.values() if m.role in service_roles),
        key=lambda m: (m.status == "alive", -(m.age_s or 1e18)),
    )
    synchronizer: JSONDict | None = None
    rejections = 0
    if syncs and syncs[-1].heartbeat is not None:  # the newest alive one's row
        synchronizer, rejected = mode.service_status(syncs[-1], now)
        rejections = int(rejected)
    health = run_health(
        members,
        worker_role=role,
        n_workers=n_replicas,
        quorum=max(1, min(quorum, n_replicas)),
        synchronizer_role=sync_role,
        rejections=rejections,
        starting=starting,
    )
    return {
        "state": health.state,
        "reasons": list(health.reasons),
        "alive_workers": health.alive_workers,
        "expected_workers": health.expected_workers,
        "level": HEALTH_LEVEL[health.state],
        "members": {k: m.status for k, m in sorted(members.items())},
        "synchronizer": synchronizer,
    }


def _live_workers(store: ObjectStore, role: str, now: float) -> list[str]:
    """role/id of the workers whose heartbeat is fresh and whose process may still run (one of
    this host whose pid is gone does not)."""
    here = socket.gethostname()
    out = []
    for key, member in read_liveness(store, now, roles=[role]).items():
        hb = member.heartbeat
        if member.status != "alive" or hb is None:
            continue
        if hb.host == here and hb.pid is not None and not pid_alive(hb.pid):
            continue
        out.append(f"{key} (pid {hb.pid} on {hb.host})")
    return out


def driver_gone(
    driver: JSONDict,
    *,
    live_workers: list[str],
    now: float | None = None,
    window_s: float = DEAD_AFTER_S,
) -> DriverGone | None:
    """None while the driver of a run that says "running" may still run; else when it was last
    seen (epoch seconds), how we know, and its pid and host. A driver of this host: its pid is
    gone. Of another host: no replica heartbeat within the liveness window (`live_workers`
    empty) and driver.json (updated every poll) older than `window_s`."""
    if driver.get("status") != "running":
        return None
    now = time.time() if now is None else now
    seen = driver.get("updated") or driver.get("started")
    seen = float(seen) if isinstance(seen, int | float) else None
    pid, host = driver.get("pid"), driver.get("host")
    if host == socket.gethostname() and isinstance(pid, int) and pid > 0:
        if pid_alive(pid):
            return None
        how = f"pid {pid} on {host} no longer exists"
    else:
        if live_workers or seen is None or now - seen <= window_s:
            return None
        how = (
            f"driver.json not updated for {now - seen:.0f} s and no heartbeat within {window_s:g} s"
        )
    return {"since": seen, "how": how, "pid": pid, "host": host}


def run_status(folder: RunFolder, *, stale_after_s: float = 120.0) -> RunStatus:
    """A JSON-able description of the run (see the module docstring)."""
    config = json.loads(folder.config_json.read_text())
    driver, driver_damage = folder.read_driver(), folder.driver_damage()
    n = int(config["backend"]["n_replicas"])
    own_uri = folder.configured_store(config)  # "" in config.json: the folder's store/
    store, statuses, checkpoints, store_error = _read_store(
        own_uri, config.get("store", {}).get("storage_options"), n
    )
    run_state: HealthDoc | None = None
    mode: OuterLoopMode | None = None
    try:  # the config `train` wrote and checked (an older release's may no longer load)
        mode = outer_loop_mode(from_dict(RunConfig, config))
    except ValueError as exc:
        store_error = store_error or f"config.json: {exc}"
    if store is not None and store_error is None and mode is not None:
        try:
            started = driver.get("started") if driver.get("status") == "running" else None
            run_state = health_now(
                store,
                mode=mode,
                n_replicas=n,
                started=started if isinstance(started, int | float) else None,
            )
        except Exception as exc:  # status must still show the rest
            store_error = f"{type(exc).__name__}: {exc}"
    gone, resume, store_error = _driver_gone(driver, mode, store, n, store_error)
    handles = {
        as_int(h["replica_id"]): h for h in map(as_dict, as_list(driver.get("replicas", [])))
    }
    now = time.time()
    top_round = max((as_int(s.get("round") or 0) for s in statuses.values()), default=0)
    reports = [r for s in statuses.values() if isinstance(r := s.get("rejections"), dict)]
    rejections = max(reports, key=lambda r: as_int(r.get("round") or 0), default=None)
    stuck = driver.get("no_quorum")
    if isinstance(stuck, dict):  # the run stopped on a round that can never commit
        run_state = _stopped(run_state, str(stuck.get("reason")))
        rejections = {"round": stuck.get("round"), "ranks": stuck.get("rejected") or {}}
    replicas = [
        _replica_row(
            rank,
            statuses.get(rank, {}),
            handles.get(rank, {}),
            top_round,
            running=driver.get("status") == "running",
            now=now,
            stale_after_s=stale_after_s,
        )
        for rank in range(n)
    ]
    return {
        "run": folder.name,
        "folder": str(folder.root),
        "status": "stopped" if gone is not None else driver.get("status", "unknown"),
        "driver_gone": gone,
        "driver_damage": driver_damage,
        "resume": resume,
        "lost": [r for r in as_list(driver.get("lost")) if isinstance(r, int)],
        "started": driver.get("started"),
        "ended": driver.get("ended"),
        "store": own_uri,
        "store_error": store_error,
        "round": top_round,
        "checkpoints": checkpoints,
        "secrets": secret_files(folder.root),
        "replicas": replicas,
        "health": run_state,
        "rejections": rejections,
    }


def _stopped(health: HealthDoc | None, reason: str) -> HealthDoc:
    """The run state of a run the driver stopped on a round that can never commit: critical
    for ``reason`` (first), whatever the heartbeats say."""
    reasons = [reason, *(health["reasons"] if health is not None else [])]
    if health is None:
        return {"state": "critical", "level": 2, "reasons": reasons}
    return {**health, "state": "critical", "level": 2, "reasons": reasons}


_Statuses = dict[int, JSONDict]  # rank -> its status document


def _read_store(
    uri: str, options: JSONValue, n: int
) -> tuple[ObjectStore | None, _Statuses, list[str], str | None]:
    """(the store, each reporting rank's status document, the committed checkpoints, the error
    that stopped the reading): status shows what the run folder knows even when the store fails."""
    statuses: _Statuses = {}
    checkpoints: list[str] = []
    store: ObjectStore | None = None
    try:
        store = ObjectStore(uri, as_dict(options))
        for rank in range(n):
            try:
                doc = store.get_json(status_key(rank))
            except ValueError:  # not JSON: shown as not reporting
                continue
            if isinstance(doc, dict):
                statuses[rank] = doc
        checkpoints = [name for name, _ in committed_checkpoints(store)]
    except Exception as exc:  # status must still show what the run folder knows
        return store, statuses, checkpoints, f"{type(exc).__name__}: {exc}"
    return store, statuses, checkpoints, None


def _driver_gone(
    driver: JSONDict,
    mode: OuterLoopMode | None,
    store: ObjectStore | None,
    n: int,
    store_error: str | None,
) -> tuple[DriverGone | None, ResumeInfo | None, str | None]:
    """For a run whose driver.json says running: whether its driver is gone (`driver_gone`),
    and if so what `--resume` would do and which workers still run; with the store error, if
    reading the store failed on the way."""
    gone: DriverGone | None = None
    resume: ResumeInfo | None = None
    if driver.get("status") != "running":
        return gone, resume, store_error
    readable = store if store_error is None and mode is not None else None
    live: list[str] = []
    if readable is not None and mode is not None:
        try:
            live = _live_workers(readable, mode.worker_role, time.time())
        except Exception as exc:  # an unreadable store: the driver check still stands
            store_error = f"{type(exc).__name__}: {exc}"
    gone = driver_gone(driver, live_workers=live)
    if gone is not None:
        resume = {"plan": None, "warnings": [], "still_running": live}
        if readable is not None and mode is not None and store_error is None:
            try:
                resume["plan"], resume["warnings"] = mode.resume_plan(readable, n)
            except Exception as exc:  # what is known about the driver is still shown
                resume["plan"] = f"unknown ({type(exc).__name__}: {exc})"
    return gone, resume, store_error


def _replica_row(
    rank: int,
    doc: JSONDict,
    handle: JSONDict,
    top_round: int,
    *,
    running: bool,
    now: float,
    stale_after_s: float,
) -> ReplicaRow:
    """One replica's line of `run_status`: its last status document, what the executor said,
    and its health (failed / stale / behind / degraded: observability writes skipped within
    ``stale_after_s`` / ok)."""
    updated = doc.get("updated")
    lag_s = None if updated is None else max(0.0, now - as_float(updated))
    rnd = as_int(doc.get("round") or 0)
    executor_state = handle.get("status")
    state = doc.get("state", "unknown")
    if executor_state == "failed":
        health = "failed"
    elif running and state not in ("done",) and (lag_s is None or lag_s > stale_after_s):
        health = "stale"
    elif top_round - rnd > 1:
        health = "behind"
    elif now - as_float(doc.get("last_skip_time") or 0.0) < stale_after_s:
        health = "degraded"  # its metrics or status writes were skipped lately (metrics.py)
    else:
        health = "ok"
    return {
        "rank": rank,
        "state": state,
        "executor": executor_state,
        "exit_code": handle.get("exit_code"),
        "step": doc.get("step"),
        "max_steps": doc.get("max_steps"),
        "round": rnd,
        "round_lag": top_round - rnd,
        "seconds_since_update": lag_s,
        "reward": as_number(doc.get("reward")),
        "eval_accuracy": as_number(doc.get("eval_accuracy")),
        "steps_per_s": as_number(doc.get("steps_per_s")),
        "wait_fraction": as_number(doc.get("wait_fraction")),
        "health": health,
        "error": handle.get("error"),
        "skipped": doc.get("last_skip") if health == "degraded" else None,
    }


def status_text(info: RunStatus) -> str:
    lost = len(info.get("lost") or [])
    status = str(info["status"]) + (
        f", {lost} replica{'s' if lost != 1 else ''} lost" if lost else ""
    )
    gone = info.get("driver_gone")
    if gone:
        since = gone["since"]
        when = "-" if since is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        status += f" (driver gone since {when}: {gone['how']})"
    lines = [
        f"run {info['run']}: {status}   outer round {info['round']}   store {info['store']}",
    ]
    if info.get("driver_damage"):
        lines.append(f"  {info['driver_damage']}")
    resume = info.get("resume")
    if resume:
        if resume.get("still_running"):
            lines.append(
                f"  still running without a driver: {', '.join(resume['still_running'])}"
                " (`--resume` fences them first)"
            )
        for warning in resume["warnings"]:
            lines.append(f"  resume would skip: {warning}")
        lines.append(
            f"  `composer-replication train --resume {info['folder']}` would "
            f"{resume.get('plan') or 'resume from the newest global state'}"
        )
    if info.get("store_error"):
        lines.append(f"  store unreachable: {info['store_error']}")
    health = info.get("health")
    if health:
        why = "; ".join(health["reasons"])
        lines.append(f"  health: {health['state']}" + (f" ({why})" if why else ""))
        sync = health.get("synchronizer")
        if sync:
            lines.append(
                f"  synchronizer {sync['id']}: {sync['status']}, epoch {sync['epoch']}, "
                f"{sync['merges']} merges, fragment versions {sync['versions']}, refused "
                f"{sync['refused']}, rejected {sync['rejected']}, late dropped "
                f"{sync['dropped_late']} / carried {sync['carried_late']}"
            )
    lines.append(
        f"  {'rank':>4} {'state':<11} {'step':>9} {'round':>5} {'lag':>4} {'updated':>9} "
        f"{'reward':>7} {'steps/s':>7} {'wait':>5} {'health':<7}"
    )
    for r in info["replicas"]:
        ago = "-" if r["seconds_since_update"] is None else f"{r['seconds_since_update']:.0f}s"
        step = f"{r['step'] if r['step'] is not None else '-'}/{r['max_steps'] or '-'}"
        reward = "-" if r["reward"] is None else f"{r['reward']:.3f}"
        steps_per_s, wait_fraction = r.get("steps_per_s"), r.get("wait_fraction")
        pace = "-" if steps_per_s is None else f"{steps_per_s:.2f}"
        wait = "-" if wait_fraction is None else f"{100 * wait_fraction:.0f}%"
        lines.append(
            f"  {r['rank']:>4} {str(r['state']):<11} {step:>9} {r['round']:>5} "
            f"{r['round_lag']:>4} {ago:>9} {reward:>7} {pace:>7} {wait:>5} {r['health']:<7}"
        )
        if r.get("error"):
            lines.append("       " + str(r["error"]).replace("\n", "\n       "))
        if r.get("skipped"):
            lines.append(f"       writes skipped: {r['skipped']}")
    rejections = info.get("rejections")
    if rejections:
        lines.append(f"  rejected in round {rejections.get('round')}:")
        ranks = as_dict(rejections.get("ranks"))
        for rank, refusal in sorted(ranks.items(), key=lambda kv: int(kv[0])):
            lines.append(f"    rank {rank}: {refusal}")
    if info["checkpoints"]:
        lines.append(f"  checkpoints: {', '.join(info['checkpoints'])}")
    if info.get("secrets"):
        lines.append("  " + secrets_warning(Path(info["folder"]), info["secrets"]))
    return "\n".join(lines)
