"""`composer-replication status RUN`: replicas, outer round, lag and health of a run.

Works while the run is going (from another terminal) and after it ended. Sources: the run
folder's driver.json (what the executor said: exit codes, errors) and the replicas' status
documents in the store (what each replica last reported). Health of one replica:

    ok        reported within `stale_after_s` (or finished cleanly)
    stale     running, but silent for longer than `stale_after_s`
    behind    more than one outer round behind the most advanced replica
    failed    the executor reports it failed (its error is shown)

Contributions the exchange left out (refused, screened out, squatted; docs/object-store.md) are
listed with rank and reason for the latest round that had any (``rejections``).
"""

from __future__ import annotations

import json
import time
from typing import Any

from composer_replication.exchange.store import ObjectStore
from composer_replication.run.checkpoint import committed_checkpoints
from composer_replication.run.folder import RunFolder
from composer_replication.run.metrics import status_key

__all__ = ["run_status", "status_text"]


def run_status(folder: RunFolder, *, stale_after_s: float = 120.0) -> dict[str, Any]:
    """A JSON-able description of the run (see the module docstring)."""
    config = json.loads(folder.config_json.read_text())
    driver = folder.read_driver()
    n = int(config["backend"]["n_replicas"])
    store_cfg = config.get("store", {})
    statuses: dict[int, dict[str, Any]] = {}
    checkpoints: list[str] = []
    store_error = None
    try:
        store = ObjectStore(store_cfg["uri"], store_cfg.get("storage_options"))
        for rank in range(n):
            try:
                doc = store.get_json(status_key(rank))
            except ValueError:  # not JSON: shown as not reporting
                continue
            if isinstance(doc, dict):
                statuses[rank] = doc
        checkpoints = [name for name, _ in committed_checkpoints(store)]
    except Exception as exc:  # status must still show what the run folder knows
        store_error = f"{type(exc).__name__}: {exc}"
    handles = {int(h["replica_id"]): h for h in driver.get("replicas", [])}
    now = time.time()
    top_round = max((int(s.get("round") or 0) for s in statuses.values()), default=0)
    reports = [s["rejections"] for s in statuses.values() if isinstance(s.get("rejections"), dict)]
    rejections = max(reports, key=lambda r: int(r.get("round") or 0), default=None)
    replicas = []
    for rank in range(n):
        doc = statuses.get(rank, {})
        handle = handles.get(rank, {})
        updated = doc.get("updated")
        lag_s = None if updated is None else max(0.0, now - float(updated))
        rnd = int(doc.get("round") or 0)
        executor_state = handle.get("status")
        state = doc.get("state", "unknown")
        if executor_state == "failed":
            health = "failed"
        elif (
            driver.get("status") == "running"
            and state not in ("done",)
            and (lag_s is None or lag_s > stale_after_s)
        ):
            health = "stale"
        elif top_round - rnd > 1:
            health = "behind"
        else:
            health = "ok"
        replicas.append(
            {
                "rank": rank,
                "state": state,
                "executor": executor_state,
                "exit_code": handle.get("exit_code"),
                "step": doc.get("step"),
                "max_steps": doc.get("max_steps"),
                "round": rnd,
                "round_lag": top_round - rnd,
                "seconds_since_update": lag_s,
                "reward": doc.get("reward"),
                "eval_accuracy": doc.get("eval_accuracy"),
                "health": health,
                "error": handle.get("error"),
            }
        )
    return {
        "run": folder.name,
        "folder": str(folder.root),
        "status": driver.get("status", "unknown"),
        "started": driver.get("started"),
        "ended": driver.get("ended"),
        "store": store_cfg.get("uri"),
        "store_error": store_error,
        "round": top_round,
        "checkpoints": checkpoints,
        "replicas": replicas,
        "rejections": rejections,
    }


def status_text(info: dict[str, Any]) -> str:
    lines = [
        f"run {info['run']}: {info['status']}   outer round {info['round']}   store {info['store']}",
    ]
    if info.get("store_error"):
        lines.append(f"  store unreachable: {info['store_error']}")
    lines.append(
        f"  {'rank':>4} {'state':<11} {'step':>9} {'round':>5} {'lag':>4} {'updated':>9} "
        f"{'reward':>7} {'health':<7}"
    )
    for r in info["replicas"]:
        ago = "-" if r["seconds_since_update"] is None else f"{r['seconds_since_update']:.0f}s"
        step = f"{r['step'] if r['step'] is not None else '-'}/{r['max_steps'] or '-'}"
        reward = "-" if r["reward"] is None else f"{r['reward']:.3f}"
        lines.append(
            f"  {r['rank']:>4} {str(r['state']):<11} {step:>9} {r['round']:>5} "
            f"{r['round_lag']:>4} {ago:>9} {reward:>7} {r['health']:<7}"
        )
        if r.get("error"):
            lines.append("       " + str(r["error"]).replace("\n", "\n       "))
    rejections = info.get("rejections")
    if rejections:
        lines.append(f"  rejected in round {rejections.get('round')}:")
        for rank, why in sorted((rejections.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
            lines.append(f"    rank {rank}: {why}")
    if info["checkpoints"]:
        lines.append(f"  checkpoints: {', '.join(info['checkpoints'])}")
    return "\n".join(lines)
