"""Drive a composer-replication run as Monarch actors on a local process mesh.

    python -m composer_replication.recipes.monarch.train CONFIG.toml [section.key=value ...]
        [--summary FILE.json]

CONFIG is a run configuration (the same TOML as `composer-replication train`, docs/cli.md);
overrides follow the same `section.key=value` syntax. The driver (this process, Monarch's single
controller):

1. loads and checks the config (`actors.check_supported`), resolves the object store: `store.uri`,
   else ``<run.runs_dir>/<run.name>/store/`` (``run.name`` empty: ``monarch-YYYYmmdd-HHMMSS``),
   which must not already hold a run;
2. spawns ``backend.n_replicas`` processes on this host (`this_host().spawn_procs`), and on them a
   `GeneratorActor`, a `RewarderActor` and a `TrainerActor` per process and ONE `TeacherPoolActor`
   (on process 0) that every trainer shares;
3. calls ``TrainerActor.train`` on every process at once and waits: the replicas train and
   synchronise through the object store (DiLoCo); each returns its per-round global-weight
   digests and mean rewards;
4. prints one line per round (mean reward per replica, whether the replicas' global weights
   agree), writes the summary JSON (``--summary``) and stops the mesh.

Exit code 0 when every replica finished with the same global weights after every round, 1 when
they disagree, an actor failed or a mesh process died (Monarch's failure report and the remote
traceback are printed; the mesh is stopped), 2 when the config or the arguments are unusable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

if TYPE_CHECKING:
    from composer_replication.config import RunConfig
    from composer_replication.json_types import JSONDict
    from composer_replication.recipes.monarch.actors import ReplicaResult

__all__ = ["agreement", "main", "resolve_store", "run"]


class RoundAgreement(TypedDict):
    """One outer round of `agreement`."""

    round: int
    agree: bool  # every replica reported it, with the same global-weight digest
    reward_mean: list[float | None]  # per replica (None: it did not report the round)


class RunSummary(TypedDict):
    """What `run` returns (and ``--summary`` writes)."""

    store: str
    n_replicas: int
    seconds: float
    rounds: list[RoundAgreement]
    replicas: list[ReplicaResult]
    teacher_pool: JSONDict  # `TeacherPoolActor.stats`
    agree: bool


class _Failure(Protocol):
    """What Monarch hands its unhandled-fault hook (a supervision event)."""

    def report(self) -> str: ...


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m composer_replication.recipes.monarch.train",
        description="Train a composer-replication run as Monarch actors on a local process mesh.",
    )
    p.add_argument("config", help="run config TOML (docs/cli.md)")
    p.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="overrides of the run config"
    )
    p.add_argument("--summary", default=None, help="write the run's summary JSON here")
    return p.parse_args(argv)


def resolve_store(config: RunConfig) -> str:
    """The run's store URI: ``store.uri``, else ``<runs_dir>/<run name>/store/``; ValueError
    when it already holds a run (its rounds would be mistaken for this run's)."""
    from composer_replication.exchange.store import ObjectStore

    uri = config.store.uri
    if not uri:
        name = config.run.name or time.strftime("monarch-%Y%m%d-%H%M%S")
        uri = str(Path(config.run.runs_dir) / name / "store")
    store = ObjectStore(uri, config.store.storage_options)
    if store.list(""):
        raise ValueError(
            f"the store {store.uri} already holds a run: set a fresh store.uri or run.name"
        )
    return store.uri


def agreement(results: Sequence[ReplicaResult]) -> list[RoundAgreement]:
    """Per round (in order), each replica's mean reward and whether every replica reported the
    same global-weight digest; a round some replica did not report counts as disagreeing."""
    rounds = sorted({r["round"] for res in results for r in res["rounds"]})
    out: list[RoundAgreement] = []
    for k in rounds:
        rows = [next((r for r in res["rounds"] if r["round"] == k), None) for res in results]
        digests = {r["global_sha256"] for r in rows if r is not None}
        out.append(
            {
                "round": k,
                "agree": None not in rows and len(digests) == 1,
                "reward_mean": [None if r is None else r["reward_mean"] for r in rows],
            }
        )
    return out


def run(config: RunConfig, store_uri: str) -> RunSummary:
    """Spawn the mesh and actors, train, stop the mesh; the run's summary (see `main`)."""
    import monarch.actor
    from monarch.actor import this_host

    from composer_replication.config import to_dict
    from composer_replication.recipes.monarch.actors import (
        GeneratorActor,
        RewarderActor,
        TeacherPoolActor,
        TrainerActor,
    )

    doc = json.loads(json.dumps(to_dict(config)))
    n = config.backend.n_replicas
    t0 = time.monotonic()
    # A failed actor or a dead process is a supervision event. Monarch's default for events
    # nobody handles interrupts this (the main) thread; reported here and dropped instead, the
    # pending call raises ActorError, so the mesh is stopped and the run ends with exit code 1.
    previous_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = _report_fault
    procs = this_host().spawn_procs(per_host={"procs": n})
    try:
        generators = procs.spawn("generator", GeneratorActor, doc)
        rewarders = procs.spawn("rewarder", RewarderActor, doc)
        teacher_pool = procs.slice(procs=0).spawn("teacher_pool", TeacherPoolActor, doc)
        trainers = procs.spawn(
            "trainer", TrainerActor, doc, store_uri, generators, rewarders, teacher_pool
        )
        results = sorted(trainers.train.call().get().values(), key=lambda r: r["rank"])
        pool_stats = teacher_pool.stats.call_one().get()
    finally:
        try:
            procs.stop().get()
        finally:
            monarch.actor.unhandled_fault_hook = previous_hook
    table = agreement(results)
    return {
        "store": store_uri,
        "n_replicas": n,
        "seconds": time.monotonic() - t0,
        "rounds": table,
        "replicas": results,
        "teacher_pool": pool_stats,
        "agree": bool(table)
        and all(r["agree"] for r in table)
        and len({res["final_sha256"] for res in results}) == 1,
    }


def _report_fault(failure: _Failure) -> None:
    """Monarch's unhandled-fault hook for the run: print the failure's report (which actor or
    process failed, and its traceback) and drop the event; the pending call then fails."""
    print(f"monarch: actor failure: {failure.report()}", file=sys.stderr, flush=True)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parse(argv)
    from composer_replication.config import ConfigError, load_config

    try:
        config = load_config(ns.config, ns.overrides)
        from composer_replication.recipes.monarch.actors import check_supported

        check_supported(config)
        store_uri = resolve_store(config)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"monarch: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"monarch: {config.backend.n_replicas} replicas on a local process mesh, store {store_uri}",
        flush=True,
    )
    try:
        summary = run(config, store_uri)
    except Exception as exc:  # an actor failed: Monarch's ActorError carries its traceback
        print(f"monarch: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for r in summary["rounds"]:
        rewards = " ".join(_fmt(x) for x in r["reward_mean"])
        state = "agree" if r["agree"] else "DISAGREE"
        print(f"round {r['round']:3d}  mean reward per replica: {rewards}  global weights {state}")
    if ns.summary:
        Path(ns.summary).write_text(json.dumps(summary, indent=2))
    if not summary["agree"]:
        print("monarch: error: the replicas' global weights disagree", file=sys.stderr)
        return 1
    print(
        f"monarch: done in {summary['seconds']:.0f}s; the replicas' global weights agree "
        f"after every round",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
