"""The driver's end-of-run check: before a run reports success, the store must hold its last
round. Sync mode over the object store: the newest commit record is round ``steps / H`` (and
reads back as that round's); decoupled mode: ``final.json`` is there and every fragment's final
version has its merge record and no merge beyond it. A torchft run keeps no rounds in the
store, nor does a run of one replica (it exchanges nothing): nothing to check. `end_of_run_problem` says what is wrong (None when nothing is); the
driver then fails the run with that reason (driver.json, `status`, a health record and an
``"incomplete"`` event in metrics.jsonl) and exits non-zero.
"""

from __future__ import annotations

import json

from composer_replication.config import RunConfig
from composer_replication.diloco.outer_mode import OuterLoopMode
from composer_replication.exchange.protocol import commit_key
from composer_replication.exchange.push_store import DecoupledStore
from composer_replication.exchange.store import ObjectStore

__all__ = ["end_of_run_problem"]


def end_of_run_problem(store: ObjectStore, mode: OuterLoopMode, config: RunConfig) -> str | None:
    """Why the store does not hold the run's last round (see the module docstring), or None."""
    if mode.has_synchronizer:
        return _decoupled_problem(store, config.diloco.fragments)
    # rounds committed in the store: the peers meet there (store_departures), more than one
    if mode.lockstep and mode.store_departures and config.backend.n_replicas > 1:
        return _sync_problem(store, config.n_rounds)
    return None


def _committed_rounds(store: ObjectStore) -> list[int]:
    """Rounds with a commit record in the store, oldest first."""
    rounds = [int(name) for name in store.list("steps") if name.isdigit()]
    return sorted(r for r in rounds if store.exists(commit_key(r)))


def _sync_problem(store: ObjectStore, n_rounds: int) -> str | None:
    rounds = _committed_rounds(store)
    last = rounds[-1] if rounds else 0
    if last != n_rounds:
        return (
            f"end-of-run check: the store's last committed round is {last}, the run has "
            f"{n_rounds} (train.max_steps / diloco.sync_every_h)"
        )
    try:
        record = json.loads(bytes(store.get(commit_key(last)) or b""))
    except ValueError:
        record = None
    if not isinstance(record, dict) or record.get("step") != last:
        return f"end-of-run check: the commit record of the last round ({last}) is not readable"
    return None


def _decoupled_problem(store: ObjectStore, n_fragments: int) -> str | None:
    docs = DecoupledStore(store)
    final = docs.read_final(n_fragments)
    if final is None:
        return "end-of-run check: the store has no final.json (the final merges are missing)"
    for p, v in enumerate(final["versions"]):
        merges = docs.versions(p, "merge")
        if v > 0 and v not in merges:
            return (
                f"end-of-run check: fragment {p}'s final version {v} (final.json) has no merge "
                "record"
            )
        if merges and max(merges) > v:
            return (
                f"end-of-run check: fragment {p} has a merge record {max(merges)} after its "
                f"final version {v} (final.json)"
            )
    return None
