"""Goodput and quality of Decoupled DiLoCo vs synchronous DiLoCo under real faults.

Four learner processes train the same byte-level GPT (benchmarks/diloco_convergence.py's model
and stdlib corpus) for the same number of inner steps each, meeting only in an object store
(SeaweedFS on 127.0.0.1 by default, behind the chaos harness's throttling proxy), in both modes:

- ``sync``: the object-store DiLoCo of `composer-replication train` (ObjectStoreManager, H inner
  steps, every round a barrier that waits up to ``timeout_s`` and commits with >= min_replicas);
- ``decoupled``: DecoupledLearner + the real synchronizer process (P fragments, quorum, grace
  window, late pushes carried).

The failure schedule (run/chaos.py, real signals and bytes; times after every learner is ready;
R = one round = H steps): kill -9 a learner mid inner step (restarted at once), SIGSTOP another
for 2 R, slow a third 3x for 3 R, corrupt a contribution/push, kill and restart the synchronizer
(decoupled only; sync has none), throttle the store for 2 R, kill a learner mid-upload.

Every inner step runs on a *simulated accelerator*: the real forward/backward (a few ms) is padded
to ``--step-s`` of the process's running time, measured so that time while the process is stopped
(SIGSTOP, the 3x duty cycle) does not count. The 2-core machine thus behaves like 4 separate
devices whose speed the harness controls, and CPU contention from other jobs does not masquerade
as protocol cost, as long as the real compute fits in a step: each run reports
``overrun_share``, the share of steps whose real compute alone took longer than ``--step-s`` (on
a machine loaded by other jobs it can reach most steps, and then the goodput measures the load).
A run whose ``overrun_share`` exceeds 0.05 says so on a line of its own (``NOT A PROTOCOL
FIGURE``) and in its row (``protocol_figure`` false). ``--protocol`` takes a model small enough
(d 16, ctx 32: about 7 ms of real compute a step alone) and a step long enough (0.25 s unless
``--step-s``) that the real compute stays within 10% of the step (``compute_share``: the mean
real compute over ``--step-s``; ``over_budget_share``: steps above 10%); the default model (d 64,
ctx 64, 0.1 s steps) stays the default.

A learner restarted after a kill downloads only the newest version of each fragment merged
while it was down: each decoupled row lists its ``rejoins`` (rank, step, ``rejoin_bytes``,
``rejoin_objects``) and ``rejoin_bytes_max``, against ``model_bytes``.

Goodput = (useful inner steps x step_s) / replica-seconds, counting only work that reached the
final model. Replica-seconds: N learners x the time from the common start to ONE event, the same
in both modes: the last committed merge that the final model contains (sync: the last round's
commit, as its earliest learner sees it; decoupled: the newest of the final versions' merge
records, by the synchronizer's clock on the same machine), dead time after a kill included.
Useful steps: sync, H per included rank per committed round (commit records); decoupled, per
fragment and merge record up to the final version, each INCLUDED push's `steps_since_push`
(the steps since that learner's previous push of the fragment or since a newer global replaced
the fragment, whichever is later: work overwritten by a newer global does not count) plus the
steps of the pushes it superseded (same learner, same base: their work is inside it), summed
over fragments / P. Work lost to a kill, a dropped, refused or excluded push, a round that
fails, a stalled or waiting learner is not useful. The sync baseline runs at each timeout of
``--sync-timeouts`` (1, 2, 4 rounds) and its best goodput is the one compared. Eval loss: mean
cross-entropy (nats/byte) of the final global model on held-out files.

The decoupled runs are audited by `run.chaos.check_decoupled_run` with every learner's report
(the versions it started from at each start, the globals it loaded, the pushes it wrote, its
final versions and weights): ``rounds_lost`` counts lost merge records, pushes written but never
consumed or refused, and pushes merged twice.

    python benchmarks/decoupled_goodput.py            # ~20-30 min on 2 cores
    python benchmarks/decoupled_goodput.py --quick    # half the steps
    python benchmarks/decoupled_goodput.py --protocol # the model that fits the simulated step

Last line: JSON with sync_goodput (at the best timeout; ``sync_goodput_by_timeout`` has each),
decoupled_goodput, sync_eval_loss, decoupled_eval_loss, loss_gap_vs_sync (no failures,
relative), rounds_lost, byzantine_loss_gap, byzantine_mean_diverged, protocol_figure (and
not_protocol_runs), decoupled_rejoin_bytes_max and the other figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

N = 4
COMPUTE_BUDGET = 0.1  # the real compute a step, as a share of --step-s, --protocol aims at
OVERRUN_LIMIT = 0.05  # a run with more overrun steps than this is not a protocol figure
# --protocol: a model small enough that its real step takes <= COMPUTE_BUDGET of the simulated
# one on a shared 2-core machine (about 7 ms of forward/backward/AdamW alone, 18k parameters),
# and a longer simulated step unless --step-s is given
PROTOCOL = {"d": 16, "layers": 4, "ctx": 32, "step_s": 0.25}


# --------------------------------------------------------------------------- the learner process


def busy(seconds: float, tick: float = 0.005) -> None:
    """Occupy the simulated accelerator for ``seconds`` of running time (stopped time excluded:
    a gap much longer than a tick means the process was stopped, and counts as one tick)."""
    done, last = 0.0, time.monotonic()
    while done < seconds:
        time.sleep(min(tick, seconds - done))
        now = time.monotonic()
        dt, last = now - last, now
        done += dt if dt < 0.08 else tick


def learner_main(a: argparse.Namespace) -> None:
    import torch
    from diloco_convergence import Batches, TinyGPT, eval_loss, load_corpus, loss_of

    from composer_replication.exchange.protocol import tensors_digest
    from composer_replication.exchange.store import ObjectStore

    torch.set_num_threads(1)
    rank = int(os.environ["REPLICA_RANK"])
    out = Path(a.out)
    train, evals = load_corpus(max_train_bytes=2_000_000, max_eval_bytes=200_000)
    batches = Batches(train, 8, a.ctx, seed=1)
    torch.manual_seed(0)
    model = TinyGPT(a.d, a.layers, 4, a.ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    options = json.loads(os.environ.get("COMPOSER_STORAGE_OPTIONS") or "{}")
    store = ObjectStore(a.uri, options)
    if a.mode == "sync":
        from composer_replication.diloco import make_diloco_outer_loop
        from composer_replication.exchange import ObjectStoreAllReduce, ObjectStoreManager

        ex = ObjectStoreAllReduce(
            a.uri,
            world_size=N,
            rank=rank,
            timeout_s=a.timeout,
            min_replicas=a.min_replicas,
            storage_options=options,
            keep_steps=100_000,
            poll_interval_s=0.05,
        )
        outer: Any = make_diloco_outer_loop(opt, ObjectStoreManager(ex), a.h, model=model)
        start = outer.round * a.h
    else:
        from composer_replication.diloco.decoupled import DecoupledLearner

        outer = DecoupledLearner(
            store,
            learner=rank,
            n_learners=N,
            sync_every_h=a.h,
            num_fragments=a.p,
            model=model,
            inner_optimizer=opt,
            poll_interval_s=0.05 if store.is_local else 0.1,
            drain_timeout_s=600,
            heartbeat_every_s=1.0,
        )
        start = outer.start_step
        if a.attack != 1.0 and rank == N - 1:  # the byzantine learner: every push scaled
            honest = outer.docs.push

            def push(tensors: dict, **kw: Any) -> Any:
                return honest({k: v * a.attack for k, v in tensors.items()}, **kw)

            outer.docs.push = push
    (out / f"ready{rank}").write_text("1")
    go = out / "go"
    while not go.exists():
        time.sleep(0.01)
    t0 = float(go.read_text())
    while time.time() < t0:
        time.sleep(0.005)
    events = open(out / f"learner{rank}.jsonl", "a")
    versions = list(outer.start_versions) if a.mode == "decoupled" else None
    start_event: dict[str, Any] = {
        "kind": "start",
        "t": time.time(),
        "step": start,
        "versions": versions,
        "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    if a.mode == "decoupled" and outer.rejoin is not None:  # what binding downloaded
        start_event.update(
            rejoin_bytes=outer.rejoin["bytes"],
            rejoin_objects=outer.rejoin["objects"],
            rejoin_merged_meanwhile=outer.rejoin["merged_meanwhile"],
        )
    events.write(json.dumps(start_event) + "\n")
    events.flush()
    overruns = 0  # steps whose real compute alone took longer than the simulated step
    over_budget = 0  # steps whose real compute took more than COMPUTE_BUDGET of it
    compute_s = 0.0
    with outer:
        for t in range(start, a.steps):
            s0 = time.monotonic()
            x, y = batches.get(rank, t)
            loss = loss_of(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            spent = time.monotonic() - s0
            overruns += spent > a.step_s
            over_budget += spent > COMPUTE_BUDGET * a.step_s
            compute_s += spent
            busy(max(0.0, a.step_s - spent))
    t_end = time.time() if a.mode == "sync" else outer.trained_until
    outer.load_global_weights()
    report = {
        "kind": "end",
        "t": time.time(),
        "t_end": t_end,
        "step": a.steps,
        "steps_run": a.steps - start,
        "overruns": overruns,
        "over_budget": over_budget,
        "compute_s": compute_s,
        "digest": tensors_digest({k: v.detach() for k, v in model.state_dict().items()}),
    }
    if a.mode == "decoupled":  # what check_decoupled_run compares with the store
        report.update(
            final_versions=outer.final_versions,
            loaded=dict(outer.loaded),
            written=list(outer.written),
        )
    if rank == 0:
        report["eval_loss"] = eval_loss(model, evals, a.ctx, 128)
    events.write(json.dumps(report) + "\n")
    events.close()


# --------------------------------------------------------------------------- one run


def _schedule(mode: str, s3: bool, run_s: float, round_s: float) -> list[Any]:
    from composer_replication.config.schema import ChaosEventConfig as E

    ev = [
        E(at_s=0.15 * run_s, action="kill", target="1"),
        E(at_s=0.30 * run_s, action="stop", target="2", duration_s=2 * round_s),
        E(at_s=0.45 * run_s, action="slow", target="3", factor=3.0, duration_s=3 * round_s),
        E(
            at_s=0.55 * run_s,
            action="corrupt",
            target="push:0" if mode == "decoupled" else "contribution:0",
        ),
        E(at_s=0.85 * run_s, action="kill", target="0", during="upload"),
    ]
    if mode == "decoupled":
        ev.append(E(at_s=0.65 * run_s, action="kill_synchronizer", restart_after_s=1.0))
    if s3:
        ev.append(
            E(at_s=0.75 * run_s, action="throttle", duration_s=2 * round_s, rate_bytes_s=300_000.0)
        )
    return ev


def run_once(
    a: argparse.Namespace,
    mode: str,
    *,
    faults: bool,
    attack: float = 1.0,
    aggregate: str = "mean",
    outlier_ratio: float | None = None,
    s3: tuple[str, str, dict] | None = None,
) -> dict[str, Any]:
    from composer_replication.config import to_dict
    from composer_replication.config.schema import (
        BackendConfig,
        DilocoConfig,
        ModelConfig,
        RunConfig,
        StoreConfig,
        TrainConfig,
    )
    from composer_replication.exchange.store import ObjectStore
    from composer_replication.run.chaos import ThrottleProxy, check_decoupled_run, run_local

    tmp = Path(tempfile.mkdtemp(prefix=f"ddgoodput-{mode}-"))
    out = tmp / "out"
    out.mkdir()
    proxy = None
    if s3 is not None:
        endpoint, bucket, options = s3
        proxy = ThrottleProxy(endpoint)
        uri, options = f"s3://{bucket}/{uuid.uuid4().hex}", dict(options)
        learner_options = {**options, "endpoint_url": proxy.endpoint}
    else:
        uri, options = (tmp / "store").as_uri(), {}
        learner_options = {}
    store = ObjectStore(uri, options)
    config = RunConfig(
        train=TrainConfig(max_steps=a.steps),
        model=ModelConfig(num_layers=a.layers),  # the benchmark's GPT: its blocks are fragmented
        # robust merges need several pushes per merge: the byzantine runs wait for all 4
        diloco=DilocoConfig(
            sync_every_h=a.h,
            mode="decoupled",
            fragments=a.p,
            quorum=N if attack != 1.0 else a.quorum,
            late=a.late,
            lease_ttl_s=3.0,
            aggregate=aggregate,
            aggregate_outlier_ratio=10.0 if outlier_ratio is None else outlier_ratio,
        ),
        backend=BackendConfig(n_replicas=N),
        store=StoreConfig(),
    )
    store.put_json("run_config.json", to_dict(config))
    env = {"PYTHONPATH": str(ROOT), "COMPOSER_STORAGE_OPTIONS": json.dumps(learner_options)}
    round_s = a.h * a.step_s
    run_s = a.steps * a.step_s
    args = [
        "--role",
        "learner",
        "--mode",
        mode,
        "--uri",
        uri,
        "--out",
        out,
        "--steps",
        a.steps,
        "--h",
        a.h,
        "--p",
        a.p,
        "--step-s",
        a.step_s,
        "--d",
        a.d,
        "--layers",
        a.layers,
        "--ctx",
        a.ctx,
        "--lr",
        a.lr,
        "--timeout",
        a.timeout,
        "--min-replicas",
        a.min_replicas,
        "--attack",
        attack,
    ]
    t_go: list[float] = []

    def go() -> None:
        t_go.append(time.time() + 0.5)
        (out / "go").write_text(repr(t_go[0]))
        time.sleep(0.5)

    events = _schedule(mode, s3 is not None, run_s, round_s) if faults else []
    result = run_local(
        n=N,
        entrypoint=str(HERE / "decoupled_goodput.py"),
        args=args,
        env=env,
        store=store,
        events=events,
        log_dir=tmp / "logs",
        synchronizer=mode == "decoupled",
        proxy=proxy,
        ready=lambda: all((out / f"ready{r}").exists() for r in range(N)),
        on_ready=go,
        timeout_s=20 * run_s + 600,
        seed=a.seed,
        upload_wait_s=0.1 * run_s,
    )
    if proxy is not None:
        proxy.close()
    if result.exit_codes != [0] * N:
        raise RuntimeError(f"{mode} run failed: {result.exit_codes}\n{result.logs}")
    ends = {}
    eval_loss = None
    digests = set()
    reports: dict[int, dict[str, Any]] = {}
    ran = overran = over_budget = 0
    compute_s = 0.0
    rejoins: list[dict[str, Any]] = []  # every start after the first one of a learner
    model_bytes = None
    for r in range(N):
        recs = [json.loads(line) for line in open(out / f"learner{r}.jsonl")]
        ran += sum(x.get("steps_run", 0) for x in recs if x["kind"] == "end")
        overran += sum(x.get("overruns", 0) for x in recs if x["kind"] == "end")
        over_budget += sum(x.get("over_budget", 0) for x in recs if x["kind"] == "end")
        compute_s += sum(x.get("compute_s", 0.0) for x in recs if x["kind"] == "end")
        starts = [x for x in recs if x["kind"] == "start"]
        model_bytes = starts[0].get("model_bytes", model_bytes) if starts else model_bytes
        rejoins += [{"rank": r, **x} for x in starts[1:] if "rejoin_bytes" in x]
        end = [x for x in recs if x["kind"] == "end"][-1]
        ends[r] = end["t_end"]
        digests.add(end["digest"])
        if r == 0:
            eval_loss = end["eval_loss"]
        reports[r] = {
            "starts": [x["versions"] for x in recs if x["kind"] == "start"],
            "final_versions": end.get("final_versions"),
            "digest": end["digest"],
            "loaded": end.get("loaded") or {},
            "written": end.get("written") or [],
        }
    t_final = _final_commit_time(store, mode, a, ends)
    slot = N * (t_final - t_go[0])
    useful = _useful_steps(store, mode, a)
    out_row: dict[str, Any] = {
        "mode": mode,
        "faults": faults,
        "attack": attack,
        "aggregate": aggregate,
        "timeout_s": a.timeout if mode == "sync" else None,
        "eval_loss": eval_loss,
        "useful_steps": useful,
        "slot_seconds": slot,
        "goodput": useful * a.step_s / slot,
        "wall_s": t_final - t_go[0],
        "learners_done_s": max(ends.values()) - t_go[0],
        # share of (finished incarnations') steps whose real compute exceeded step_s: the
        # simulated accelerator was overrun by the machine's load, the goodput is not the
        # protocol's (docs/benchmarks-notebook.md: figures with more than a few % are not reported)
        "overrun_share": overran / ran if ran else None,
        # the real compute against the simulated step: COMPUTE_BUDGET (10%) at most, for the
        # step to be the simulated accelerator's and not the machine's (`--protocol`)
        "compute_share": compute_s / (ran * a.step_s) if ran else None,
        "over_budget_share": over_budget / ran if ran else None,
        "model_bytes": model_bytes,
        # a restarted decoupled learner downloads only the newest version of each fragment
        # merged while it was down: at most model_bytes per rejoin, however many were merged
        "rejoins": [
            {k: x[k] for k in ("rank", "step", "rejoin_bytes", "rejoin_objects")} for x in rejoins
        ],
        "rejoin_bytes_max": max((x["rejoin_bytes"] for x in rejoins), default=None),
        "protocol_figure": bool(ran) and overran / ran <= OVERRUN_LIMIT,
        "same_final": len(digests) == 1,
        "restarts": result.restarts,
        "events": [(e["action"], e.get("outcome")) for e in result.log],
    }
    if mode == "decoupled":
        kills = [e for e in result.log if e["action"] == "kill"]
        check = check_decoupled_run(store, reports, kills)
        out_row["rounds_lost"] = (
            check["rounds_lost"] + check["pushes_unaccounted"] + check["applied_twice"]
        )
        out_row["check_ok"] = check["ok"]
        out_row["check_problems"] = check["problems"]
        out_row["merges"] = check["merges"]
        out_row["synchronizer_restarts"] = result.synchronizer_restarts
    return out_row


def _final_commit_time(
    store: Any, mode: str, a: argparse.Namespace, ends: dict[int, float]
) -> float:
    """When the last committed merge that the final model contains was made (module
    docstring): decoupled, the newest merge record among the final versions (its "time");
    sync, the last round's commit as the first learner saw it (every learner waits for it)."""
    if mode == "sync":
        return min(ends.values())
    from composer_replication.exchange.push_store import DecoupledStore

    docs = DecoupledStore(store)
    final = docs.read_final(a.p)
    if final is None:
        raise RuntimeError("the decoupled run has no final.json: it did not finish")
    times = []
    for p, v in enumerate(final["versions"]):
        rec = docs.read_merge(p, v) if v > 0 else None
        if rec is not None:
            times.append(float(rec["time"]))
    if not times:
        raise RuntimeError("the decoupled run merged nothing")
    return max(times)


def _useful_steps(store: Any, mode: str, a: argparse.Namespace) -> float:
    """Inner steps whose work reached the global model (see the module docstring)."""
    if mode == "sync":
        total = 0
        for name in store.list("steps/"):
            c = store.get_json(f"steps/{name}/commit.json")
            if c is not None:
                total += a.h * len(c["included_ranks"])
        return float(total)
    from composer_replication.exchange.push_store import DecoupledStore, PushId

    docs = DecoupledStore(store)
    final = docs.read_final(a.p)
    total = 0.0
    for p in range(a.p):
        last = final["versions"][p] if final is not None else None
        for v in docs.versions(p, "merge"):
            if last is not None and v > last:  # not in the final model
                continue
            rec = docs.read_merge(p, v)
            if rec is None:
                continue
            included = [e for e in rec["inputs"] if rec["decisions"][e["push"]]["included"]]
            total += sum(int(e["steps_since_push"]) for e in included)
            # a superseded push's work is inside the newer push of the same learner and base
            inside = {(int(e["learner"]), int(e["base"])) for e in included}
            for name, steps in (rec.get("superseded_steps") or {}).items():
                pid = PushId.parse(name)
                if pid is not None and (pid.learner, pid.base) in inside:
                    total += int(steps)
    return total / a.p


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description="Decoupled vs sync DiLoCo goodput under faults")
    ap.add_argument("--role", default="bench", choices=["bench", "learner"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--store", default="s3", choices=["s3", "file"])
    ap.add_argument("--mode", default="decoupled")
    ap.add_argument("--uri", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--steps", type=int, default=960)
    ap.add_argument("--h", type=int, default=24)
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=None, help="default 0.1 (--protocol 0.25)")
    ap.add_argument("--d", type=int, default=None, help="default 64 (--protocol 16)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=None, help="default 64 (--protocol 32)")
    ap.add_argument(
        "--protocol",
        action="store_true",
        help="the protocol runs: a model whose real step is <= 10%% of --step-s (PROTOCOL)",
    )
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--timeout", type=float, default=0.0, help="(learner role) sync timeout_s")
    ap.add_argument(
        "--sync-timeouts",
        default="1,2,4",
        help="the sync timeouts swept under faults, in rounds (its best is compared)",
    )
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument(
        "--quorum", type=int, default=N - 1, help="the run config's default: all but one"
    )
    ap.add_argument("--late", default="carry", choices=["carry", "drop"])
    ap.add_argument("--attack", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma list of runs (tuning aid)")
    a = ap.parse_args()
    defaults = PROTOCOL if a.protocol else {"d": 64, "ctx": 64, "step_s": 0.1}
    for key in ("d", "ctx", "step_s"):
        if getattr(a, key) is None:
            setattr(a, key, defaults[key])
    if a.role == "learner":
        learner_main(a)
        return
    sweep = [float(x) for x in a.sync_timeouts.split(",") if x.strip()]
    if not sweep or any(x <= 0 for x in sweep):
        ap.error("--sync-timeouts: a comma list of rounds > 0")
    if a.quick:
        a.steps = 480
    from s3_servers import run_seaweedfs

    t_start = time.time()
    rows: dict[str, dict[str, Any]] = {}
    server = run_seaweedfs() if a.store == "s3" else contextlib.nullcontext(None)
    with server as s3:
        wanted = lambda name: not a.only or name in a.only.split(",")  # noqa: E731
        by_timeout: dict[float, dict[str, Any]] = {}
        if wanted("sync_faults"):
            for rounds in sweep:
                a.timeout = rounds * a.h * a.step_s
                by_timeout[rounds] = run_once(a, "sync", faults=True, s3=s3)
                print(
                    json.dumps({f"sync_faults_timeout_{rounds:g}": by_timeout[rounds]}), flush=True
                )
                _say_if_not_protocol(f"sync_faults_timeout_{rounds:g}", by_timeout[rounds])
            best = max(by_timeout, key=lambda r: by_timeout[r]["goodput"])
            rows["sync_faults"] = by_timeout[best]
        else:
            best = 2.0
        a.timeout = best * a.h * a.step_s  # the sync baseline at its best timeout from here on
        plan = [
            ("decoupled_faults", "decoupled", True),
            ("sync_clean", "sync", False),
            ("decoupled_clean", "decoupled", False),
        ]
        for name, mode, faults in plan:
            if not wanted(name):
                continue
            rows[name] = run_once(a, mode, faults=faults, s3=s3)
            print(json.dumps({name: rows[name]}), flush=True)
            _say_if_not_protocol(name, rows[name])
        if not a.only or "byzantine" in a.only:
            rows["byz_trimmed"] = run_once(
                a,
                "decoupled",
                faults=False,
                attack=1e6,
                aggregate="trimmed_mean",
                outlier_ratio=0.0,
                s3=s3,
            )
            print(json.dumps({"byz_trimmed": rows["byz_trimmed"]}), flush=True)
            rows["byz_mean"] = run_once(
                a, "decoupled", faults=False, attack=1e6, aggregate="mean", outlier_ratio=0.0, s3=s3
            )
            print(json.dumps({"byz_mean": rows["byz_mean"]}), flush=True)
    print()
    print(f"{'run':<18}{'goodput':>9}{'eval loss':>11}{'useful':>9}{'slot s':>9}{'wall s':>8}")
    for name, r in rows.items():
        print(
            f"{name:<18}{r['goodput']:>9.3f}{(r['eval_loss'] or math.nan):>11.4f}"
            f"{r['useful_steps']:>9.0f}{r['slot_seconds']:>9.1f}{r['wall_s']:>8.1f}"
        )
    get = lambda k, f: rows[k][f] if k in rows else None  # noqa: E731
    clean_s, clean_d = get("sync_clean", "eval_loss"), get("decoupled_clean", "eval_loss")
    byz_t, byz_m = get("byz_trimmed", "eval_loss"), get("byz_mean", "eval_loss")
    not_protocol = [name for name, r in rows.items() if not r["protocol_figure"]]
    if not_protocol:
        print(
            f"NOT A PROTOCOL FIGURE: {', '.join(not_protocol)} overran the simulated step in more "
            f"than {OVERRUN_LIMIT:.0%} of their steps; their goodput measures this machine's "
            "load, not the protocol (use --protocol on a quieter machine)"
        )
    result = {
        "overrun_share": max((r["overrun_share"] or 0.0) for r in rows.values()) if rows else None,
        "protocol_figure": not not_protocol,
        "not_protocol_runs": not_protocol,
        "compute_share": _r(max((r["compute_share"] or 0.0) for r in rows.values()))
        if rows
        else None,
        "model_bytes": next((r["model_bytes"] for r in rows.values()), None),
        "decoupled_rejoins": len(get("decoupled_faults", "rejoins") or []),
        "decoupled_rejoin_bytes_max": get("decoupled_faults", "rejoin_bytes_max"),
        "sync_goodput": _r(get("sync_faults", "goodput")),
        "sync_goodput_by_timeout": {f"{r:g}": _r(row["goodput"]) for r, row in by_timeout.items()},
        "sync_best_timeout_rounds": best if by_timeout else None,
        "decoupled_goodput": _r(get("decoupled_faults", "goodput")),
        "sync_eval_loss": _r(get("sync_faults", "eval_loss")),
        "decoupled_eval_loss": _r(get("decoupled_faults", "eval_loss")),
        "sync_clean_eval_loss": _r(clean_s),
        "decoupled_clean_eval_loss": _r(clean_d),
        "loss_gap_vs_sync": _r((clean_d - clean_s) / clean_s) if clean_s and clean_d else None,
        "sync_clean_goodput": _r(get("sync_clean", "goodput")),
        "decoupled_clean_goodput": _r(get("decoupled_clean", "goodput")),
        "rounds_lost": get("decoupled_faults", "rounds_lost"),
        "chaos_check_ok": get("decoupled_faults", "check_ok"),
        "chaos_check_problems": get("decoupled_faults", "check_problems"),
        "byzantine_loss_gap": _r((byz_t - clean_d) / clean_d) if byz_t and clean_d else None,
        "byzantine_mean_diverged": None
        if byz_m is None
        else bool(not math.isfinite(byz_m) or byz_m > 10 * clean_d),
        "steps": a.steps,
        "h": a.h,
        "p": a.p,
        "step_s": a.step_s,
        "model": {"d": a.d, "layers": a.layers, "ctx": a.ctx, "protocol": a.protocol},
        "quorum": a.quorum,
        "late": a.late,
        "sync_timeout_s": a.timeout,
        "sync_timeouts_rounds": sweep,
        "sync_min_replicas": a.min_replicas,
        "store": a.store,
        "seconds": round(time.time() - t_start, 1),
        "quick": a.quick,
    }
    print(json.dumps(result))


def _say_if_not_protocol(name: str, row: dict[str, Any]) -> None:
    """One plain line for a run whose steps the machine overran (module docstring)."""
    if not row["protocol_figure"]:
        print(
            f"{name}: NOT A PROTOCOL FIGURE (overrun_share {row['overrun_share']:.3f} > "
            f"{OVERRUN_LIMIT}; real compute {row['compute_share'] or 0.0:.0%} of each step)",
            flush=True,
        )


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)


if __name__ == "__main__":
    main()
