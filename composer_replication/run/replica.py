"""The module every DiLoCo replica runs (what executors launch for `composer-replication train`).

    python -m composer_replication.run.replica --rendezvous URI

1. Rank from `--rank`, else the variable named by `--rank_env` (the seed recipes' argument),
   else REPLICA_RANK; the run's store URI from `--rendezvous`, else DILOCO_RENDEZVOUS; fsspec
   options from COMPOSER_STORAGE_OPTIONS (JSON; credentials stay in each SDK's usual places).
2. The resolved run configuration from the store (`run_config.json`, written by the driver).
   Launched directly (no driver: an executor, a cluster job, a seed recipe snippet), a replica
   that finds no run config takes it from its own arguments, `--config FILE.toml` (else
   $COMPOSER_CONFIG, else the embedded default) plus `section.key=value` overrides, with
   `backend.n_replicas` = $WORLD_SIZE when set; the first replica to start publishes it with
   put-if-absent and every replica then trains with the stored one, so they all agree.
3. The task, the model (tiny: built locally from the config; else `from_pretrained`), the
   channel-3 teachers (configured endpoints, else the task oracle) and the
   `ComposerReplicationTrainer` with all three loss channels (`assembly/build.py`).
4. The outer loop of the run's `OuterLoopMode` (`[diloco] mode` / `manager`, picked once by
   the registry in diloco/mode_registry.py; `assembly/outer.py` builds it): sync DiLoCo over
   the object store, screening contributions as `[diloco] aggregate*` / `screen*` say
   (assembly/screening.py) and, with `[security] sign`, signing with this rank's key from its
   environment (run/security.py); the torchft path, a torchft Manager dialling the lighthouse
   `[diloco] lighthouse` (else $TORCHFT_LIGHTHOUSE, which the driver sets when it runs one
   itself); or a Decoupled DiLoCo learner. A replica (re)joins where its mode says: a lockstep
   mode from the latest published round, training only the remaining inner steps, exactly when
   it finds its own resume state of that round in the store (`diloco/replica_state.py`, written
   after every committed round), else with fresh inner state; a decoupled learner from its
   own state at its last push (`diloco/decoupled/learner_state.py`), else from its progress document and the
   newest global versions.
5. Train; metrics, status, evaluations and checkpoints go to the store (`run/reporter.py`).

Fencing: the driver hands the replica its launch's run generation ($COMPOSER_RUN_GENERATION;
launched by hand: the store's current one). Every write to the store checks it first
(exchange/fencing.py): once a newer launch (`--resume`) has written a higher generation, the
replica stops without writing anything more, at its next write or heartbeat at the latest.

Exit code 0 when the replica finished, 1 on an error (its status document says which), 2 when
the arguments or environment are unusable, 3 when it was fenced by a newer launch of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from composer_replication.lazy import lazy_getattr
from composer_replication.run.replica_env import ENV_STORAGE_OPTIONS, EXIT_UNUSABLE

# The replica's work (torch, the trainer) loads only once its arguments check out.
_LAZY = {
    "device_record": "composer_replication.run.replica_training",
    "run_replica": "composer_replication.run.replica_training",
    "weights_digest": "composer_replication.run.replica_training",
}

__all__ = ["main", *sorted(_LAZY)]

__getattr__ = lazy_getattr(__name__, _LAZY)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m composer_replication.run.replica",
        description="Run one DiLoCo replica of a composer-replication run.",
    )
    p.add_argument("--rendezvous", help="the run's store URI (default: $DILOCO_RENDEZVOUS)")
    p.add_argument("--rank", type=int, default=None, help="this replica's rank")
    p.add_argument(
        "--rank_env",
        "--rank-env",
        dest="rank_env",
        default=None,
        help="environment variable holding the rank (default: REPLICA_RANK)",
    )
    p.add_argument(
        "--config-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the run config to appear in the store when it "
        "must come from a driver (--wait-for-driver)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="run config TOML when launched without a driver (default: "
        "$COMPOSER_CONFIG, else the embedded default)",
    )
    p.add_argument(
        "--wait-for-driver",
        action="store_true",
        help="never publish a config: wait for `composer-replication train` to",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="overrides of the run config (launched without a driver)",
    )
    return p.parse_args(argv)


def _rank(ns: argparse.Namespace) -> int:
    if ns.rank is not None:
        return int(ns.rank)
    name = ns.rank_env or "REPLICA_RANK"
    value = os.environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        raise ValueError(f"no replica rank: set ${name} (or pass --rank); got {value!r}")
    return int(value)


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parse(argv)
    try:
        rank = _rank(ns)
        uri = ns.rendezvous or os.environ.get("DILOCO_RENDEZVOUS")
        if not uri:
            raise ValueError("no store URI: pass --rendezvous URI or set $DILOCO_RENDEZVOUS")
        storage_options = json.loads(os.environ.get(ENV_STORAGE_OPTIONS) or "{}")
        if not isinstance(storage_options, dict):
            raise ValueError(f"${ENV_STORAGE_OPTIONS} must be a JSON object")
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"replica: error: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    from composer_replication.run.replica_training import start  # torch, the trainer

    return start(ns, rank, uri, storage_options)


if __name__ == "__main__":
    sys.exit(main())
