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
The real compute is timed from the step's start to the end of the inner optimizer step (an
optimizer hook registered before the outer loop's), so sync's round exchange and barrier, which
run inside the step, are not counted as compute; a step during which the harness held the
process (stopped, slowed, probed for an upload) is left out of the overrun (its time is the
fault's). Every step of every incarnation counts, killed ones included. A run whose
``overrun_share`` exceeds 0.05 says so on a line of its own (``NOT A PROTOCOL FIGURE``) and in
its row (``protocol_figure`` false). ``--protocol`` takes a model small enough (d 16, ctx 32:
about 10 ms of real compute a step alone) and a step long enough (1 s unless ``--step-s``) that
the real compute stays within 10% of the step with 16 learners on a shared 2-core machine
(``compute_share``: the mean real compute over ``--step-s``; ``over_budget_share``: steps above
10%); the default model (d 64, ctx 64, 0.1 s steps) stays the default.

**The grid** (``--learners 4,8,16``): per seed of ``--seeds`` and per M, one fault schedule
(`grid_schedule`: kill mid-step, kill mid-upload, SIGSTOP for 2 R and 3x slower for 3 R, each at
``FAULTS_PER_LEARNER_HOUR`` per learner-hour, so twice the learners see twice the faults; a
corrupted push / contribution and, decoupled only, a killed synchronizer once a run), and sync
(timeout ``--sync-timeout-rounds``) and decoupled (alpha 0; at M = ``--alpha-at`` also each of
``--alphas``) under it, on file:// by default (the throttled-store fault needs S3 and is not in
the grid). Two goodputs per run, over the same denominator, each learner's time from the common
start to its own end (a learner that finished is released; sync's last barrier counts):
``paper_goodput``, the Decoupled DiLoCo paper's, the steps a learner ran and kept (a step lost
to a kill and redone, time waiting at a barrier, stopped, slowed or restarting does not count;
a sync learner restarted past steps it never ran does not count them), x step_s; and
``merged_goodput``, ours, the steps whose work reached the final model (below), x step_s. Eval
loss of the final model at equal steps (every learner runs ``--steps``). Each row keeps the
faults as they happened (``chaos_log``), the commit / merge times, the recovery times
(``recoveries_s``: a kill to the next incarnation's first step) and each learner's first start
after the common one (``start_offsets``; each learner's time counts from its own): what
benchmarks/goodput_sim.py --check replays; and, decoupled, ``overwrite_lag_steps`` (the mean
steps a learner trained on a fragment between two of its merged pushes that the later push did
not carry: the work alpha 0 overwrote).

A learner restarted after a kill runs in a warm spare (`LocalProcessExecutor(warm_spares=...)`:
a process started ahead with torch and the learner's modules imported, waiting to take a
restart) unless ``--warm-spares 0``, which restarts it cold (a fresh interpreter), as every run
before the option did. Both modes get the same spares (``--warm-spares``, default 2; ``SPARE_PRELOAD``),
and each row records ``warm_spares`` and ``spare_takeovers`` (the restarts a spare took).

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
    python benchmarks/decoupled_goodput.py --protocol --learners 16,8,4 --steps 96 --h 8 \
        --store file --json-out grid.json --plot docs/decoupled_goodput.png   # ~60 min

Grid last line: ``decoupled_goodput_m{M}`` and ``sync_goodput_m{M}`` (the paper's goodput, mean
over seeds), ``decoupled_merged_goodput_m{M}`` (and sync's), ``loss_gap_vs_sync_m{M}`` (mean over
seeds of (decoupled - sync) / sync eval loss, same schedule), ``alpha{a}_merged_goodput_m8`` and
``alpha{a}_eval_loss_m8``, ``rounds_lost`` (all decoupled runs), ``overrun_share`` (the largest),
``protocol_figure``, ``cut`` (runs not started within ``--budget-s``), ``machine`` (CPU, flags,
commit, load) and every run's row.

Last line: JSON with sync_goodput (at the best timeout; ``sync_goodput_by_timeout`` has each),
decoupled_goodput, sync_eval_loss, decoupled_eval_loss, loss_gap_vs_sync (no failures,
relative), rounds_lost, byzantine_loss_gap, byzantine_mean_diverged, protocol_figure (and
not_protocol_runs), decoupled_rejoin_bytes_max and the other figures.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import math
import os
import statistics
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

N = 4  # learners of the single-M runs (the grid takes --learners)
COMPUTE_BUDGET = 0.1  # the real compute a step, as a share of --step-s, --protocol aims at
OVERRUN_LIMIT = 0.05  # a run with more overrun steps than this is not a protocol figure
# --protocol: a model small enough that its real step takes <= COMPUTE_BUDGET of the simulated
# one on a shared 2-core machine (about 7 ms of forward/backward/AdamW alone, 18k parameters),
# and a longer simulated step unless --step-s is given
PROTOCOL = {"d": 16, "layers": 4, "ctx": 32, "step_s": 1.0}
# the learner faults of the schedule, per learner-hour each (the single-M schedule's rate: one
# of each among 4 learners in a 96 s run), so more learners see more faults; corrupt and
# kill_synchronizer stay once a run (they hit the store and the synchronizer, not a learner)
FAULTS_PER_LEARNER_HOUR = 3600.0 / (4 * 96.0)
LEARNER_FAULTS = ("kill", "kill_upload", "stop", "slow")
# what a warm spare imports before it takes a restart: what learner_main imports in both modes,
# and torch._dynamo, which torch imports lazily when the first optimizer is built (most of a
# restart's setup after the imports)
SPARE_PRELOAD = (
    "torch",
    "torch._dynamo",
    "numpy",
    "diloco_convergence",
    "composer_replication.exchange.protocol",
    "composer_replication.exchange.store",
    "composer_replication.exchange.settings",
    "composer_replication.exchange.allreduce",
    "composer_replication.exchange.store_manager",
    "composer_replication.diloco.outer_loop",
    "composer_replication.diloco.decoupled.learner",
)


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


CORPUS_BYTES = (2_000_000, 200_000)  # the learners' train and eval corpus sizes


def _corpus(out: Path, load: Any) -> tuple[Any, Any]:
    """The stdlib corpus as a tokenized shard: built once per run into ``out`` (raw bytes), then
    read by every learner start, as a trainer memory-maps its tokenized data. Re-reading the
    stdlib took 2.4 s of a restarted learner's ~4 s recovery on the quiet 2-core machine."""
    import numpy as np
    import torch

    paths = out / "corpus-train.u8", out / "corpus-eval.u8"
    if not all(p.exists() for p in paths):
        built = load(max_train_bytes=CORPUS_BYTES[0], max_eval_bytes=CORPUS_BYTES[1])
        for path, t in zip(paths, built):
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            t.to(torch.uint8).numpy().tofile(tmp)
            os.replace(tmp, path)  # atomic: a learner never reads half a shard
        return built
    train, evals = (torch.from_numpy(np.fromfile(p, dtype=np.uint8)).long() for p in paths)
    return train, evals


def learner_main(a: argparse.Namespace) -> None:
    import torch
    from diloco_convergence import Batches, TinyGPT, eval_loss, load_corpus, loss_of

    from composer_replication.exchange.protocol import tensors_digest
    from composer_replication.exchange.store import ObjectStore

    torch.set_num_threads(1)
    rank = int(os.environ["REPLICA_RANK"])
    out = Path(a.out)
    train, evals = _corpus(out, load_corpus)
    batches = Batches(train, 8, a.ctx, seed=1)
    torch.manual_seed(0)
    model = TinyGPT(a.d, a.layers, 4, a.ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    # registered before the outer loop's own hooks, so it runs first: when the inner step
    # (forward, backward, AdamW) is done, before the protocol's part of the step (sync: the
    # round's exchange and barrier; decoupled: taking globals, queueing pushes)
    inner_done = [0.0]
    opt.register_step_post_hook(lambda *_: inner_done.__setitem__(0, time.monotonic()))
    options = json.loads(os.environ.get("COMPOSER_STORAGE_OPTIONS") or "{}")
    store = ObjectStore(a.uri, options)
    if a.mode == "sync":
        from composer_replication.diloco import make_diloco_outer_loop
        from composer_replication.exchange import (
            AllReduceConfig,
            ObjectStoreAllReduce,
            ObjectStoreManager,
        )

        # as `composer-replication train` does (run/security.py): each rank keeps one writer
        # secret across restarts and the run has one slot secret, so a restarted learner finds
        # its earlier upload of the round its own instead of reporting its slot squatted (which
        # left it out of that round)
        run_secret = bytes.fromhex(os.environ["GOODPUT_RUN_SECRET"])
        ex = ObjectStoreAllReduce(
            a.uri,
            world_size=a.n,
            rank=rank,
            config=AllReduceConfig(
                timeout_s=a.timeout,
                min_replicas=a.min_replicas,
                keep_rounds=100_000,
                poll_interval_s=0.05,
                # the schedule corrupts a stored contribution: the committer checks its own
                # (decoupled's synchronizer only ever reads pushes from the store)
                verify_own_upload=True,
            ),
            storage_options=options,
            writer_secret=hmac.new(run_secret, f"writer:{rank}".encode(), "sha256").digest(),
            slot_secret=hmac.new(run_secret, b"slot", "sha256").digest(),
        )
        outer: Any = make_diloco_outer_loop(opt, ObjectStoreManager(ex), a.h, model=model)
        start = outer.round * a.h
    else:
        from composer_replication.diloco.decoupled import DecoupledLearner, LearnerConfig

        outer = DecoupledLearner(
            store,
            learner=rank,
            n_learners=a.n,
            config=LearnerConfig(
                sync_every_h=a.h,
                fragments=a.p,
                alpha=a.alpha,
                poll_interval_s=0.05 if store.is_local else 0.1,
                drain_timeout_s=600,
                heartbeat_every_s=1.0,
            ),
            model=model,
            inner_optimizer=opt,
        )
        start = outer.start_step
        if a.attack != 1.0 and rank == a.n - 1:  # the byzantine learner: every push scaled
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
    t, local = start, 0
    with outer:
        while t < a.steps:
            s0, w0 = time.monotonic(), time.time()
            x, y = batches.get(rank, t)
            loss = loss_of(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            spent = time.monotonic() - s0  # the step's time so far (its protocol part too)
            compute = inner_done[0] - s0  # the real compute alone (the machine's share)
            overruns += compute > a.step_s
            over_budget += compute > COMPUTE_BUDGET * a.step_s
            compute_s += compute
            busy(max(0.0, a.step_s - spent))
            # each finished step (the paper's goodput: which steps a later start kept)
            line = f'{{"kind": "step", "step": {t}, "c": {compute:.5f}, "t": {w0:.3f}}}'
            events.write(line + "\n")
            events.flush()
            t, local = t + 1, local + 1
            if a.mode == "sync" and local == a.h:
                # sync ends at the run's last round, as a real run does: a learner that healed
                # past rounds it missed goes on from the run's round (the steps in between
                # nobody of it ran), one whose round failed and is retried trains it again, one
                # whose round committed listing a contribution it could not read adopts that
                # round (its manager loads the committer's published state) and goes on
                t, local = outer.round * a.h, 0
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
    alpha: float = 0.0,
    schedule: list[Any] | None = None,
) -> dict[str, Any]:
    from composer_replication.config import from_dict, to_dict
    from composer_replication.config.schema import (
        BackendConfig,
        DilocoConfig,
        RunConfig,
        StoreConfig,
        TrainConfig,
    )
    from composer_replication.exchange.store import ObjectStore
    from composer_replication.models.model_config import ModelConfig
    from composer_replication.run.chaos import ThrottleProxy, check_decoupled_run, run_local

    tmp = Path(tempfile.mkdtemp(prefix=f"ddgoodput-{mode}-"))
    out = tmp / "out"
    out.mkdir()
    from diloco_convergence import load_corpus

    _corpus(out, load_corpus)  # the learners' shard, before any of them starts
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
        diloco=from_dict(
            DilocoConfig,
            dict(
                sync_every_h=a.h,
                mode="decoupled",
                fragments=a.p,
                quorum=a.n if attack != 1.0 else min(a.quorum, a.n),
                late=a.late,
                lease_ttl_s=3.0,
                aggregate=aggregate,
                aggregate_outlier_ratio=10.0 if outlier_ratio is None else outlier_ratio,
            ),
        ),
        backend=BackendConfig(n_replicas=a.n),
        store=StoreConfig(),
    )
    store.put_json("run_config.json", to_dict(config))
    env = {
        # benchmarks/ too, so that a warm spare preloads diloco_convergence (SPARE_PRELOAD)
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
        "COMPOSER_STORAGE_OPTIONS": json.dumps(learner_options),
        "GOODPUT_RUN_SECRET": os.urandom(32).hex(),  # sync: the run's writer and slot secrets
    }
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
        "--n",
        a.n,
        "--alpha",
        alpha,
    ]
    t_go: list[float] = []

    def go() -> None:
        t_go.append(time.time() + 0.5)
        # written whole, then renamed: a learner polling for "go" never reads it empty
        (out / "go.tmp").write_text(repr(t_go[0]))
        (out / "go.tmp").replace(out / "go")
        time.sleep(0.5)

    if schedule is not None:  # the grid's: scaled with the learners, the same in both modes
        events = _for_mode(schedule, mode) if faults else []
    else:
        events = _schedule(mode, s3 is not None, run_s, round_s) if faults else []
    result = run_local(
        n=a.n,
        entrypoint=str(HERE / "decoupled_goodput.py"),
        args=args,
        env=env,
        store=store,
        events=events,
        log_dir=tmp / "logs",
        synchronizer=mode == "decoupled",
        proxy=proxy,
        ready=lambda: all((out / f"ready{r}").exists() for r in range(a.n)),
        on_ready=go,
        timeout_s=20 * run_s + 600,
        seed=a.seed,
        upload_wait_s=0.1 * run_s,
        warm_spares=a.warm_spares,
        preload=SPARE_PRELOAD,
    )
    if proxy is not None:
        proxy.close()
    if result.exit_codes != [0] * a.n:
        raise RuntimeError(f"{mode} run failed: {result.exit_codes}\n{result.logs}")
    ends = {}
    eval_loss = None
    digests = set()
    reports: dict[int, dict[str, Any]] = {}
    ran = overran = over_budget = 0
    compute_s = 0.0
    rejoins: list[dict[str, Any]] = []  # every start after the first one of a learner
    model_bytes = None
    held = _held_windows(result.log, events)
    kept_steps = 0  # the paper's goodput: steps a learner ran and kept (below)
    # its denominator: each learner's time from its own first start to its own end (a
    # process that the loaded machine starts late is not the protocol's; in sync the others'
    # wait for it at the first barrier still counts)
    learner_s = 0.0
    for r in range(a.n):
        recs = [json.loads(line) for line in open(out / f"learner{r}.jsonl")]
        # every step of every incarnation, killed ones included
        # (a step the harness stopped or slowed the process in took longer than its compute:
        # the fault's time, not the machine's load, so it does not count for the overrun)
        steps = [x for x in recs if x["kind"] == "step"]
        steps = [x for x in steps if not _held(x, held.get(r, []), t_go[0])]
        ran += len(steps)
        overran += sum(x["c"] > a.step_s for x in steps)
        over_budget += sum(x["c"] > COMPUTE_BUDGET * a.step_s for x in steps)
        compute_s += sum(x["c"] for x in steps)
        kept_steps += _kept_steps(recs, a.steps)
        starts = [x for x in recs if x["kind"] == "start"]
        model_bytes = starts[0].get("model_bytes", model_bytes) if starts else model_bytes
        rejoins += [{"rank": r, **x} for x in starts[1:] if "rejoin_bytes" in x]
        end = [x for x in recs if x["kind"] == "end"][-1]
        ends[r] = end["t_end"]
        learner_s += end["t_end"] - max(t_go[0], starts[0]["t"] if starts else t_go[0])
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
    slot = a.n * (t_final - t_go[0])
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
        # the single-M figure: merged work over N x the common clock to the final commit
        "goodput": useful * a.step_s / slot,
        # the grid's two goodputs, over each learner's time from the start to its own end (a
        # learner that finished is released; sync's wait for the last barrier counts):
        # the paper's, steps each learner ran and kept (not lost to a kill, not waiting,
        # stopped, slowed or restarting) ...
        "paper_goodput": kept_steps * a.step_s / learner_s,
        "kept_steps": kept_steps,
        "learner_seconds": learner_s,
        # ... and ours, the steps whose work reached the final model (an overwrite discards)
        "merged_goodput": useful * a.step_s / learner_s,
        "recoveries_s": _recoveries(result.log, out, a.n, t_go[0]),
        # each learner's first step after the common start (a process slow to start on a
        # loaded machine holds the first sync round; the simulator replays it)
        "start_offsets": _start_offsets(out, a.n, t_go[0]),
        # what the simulator replays (benchmarks/goodput_sim.py --check): the faults as they
        # happened (seconds from the start) and when each round / merge was committed
        "chaos_log": [
            {k: v for k, v in e.items() if k in ("event", "action", "target", "outcome", "t")}
            for e in result.log
        ],
        "commit_times": _commit_times(store, mode, a, t_go[0]),
        "schedule": [
            {"at_s": round(e.at_s, 2), "action": e.action, "target": e.target}
            | ({"during": e.during} if e.action == "kill" else {})
            | ({"duration_s": e.duration_s} if e.action in ("stop", "slow") else {})
            | ({"factor": e.factor} if e.action == "slow" else {})
            for e in events
        ],
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
        "warm_spares": a.warm_spares,
        "spare_takeovers": result.spare_takeovers,
        "events": [(e["action"], e.get("outcome")) for e in result.log],
    }
    if mode == "sync":
        out_row["rounds"] = sync_rounds(store, t_go[0])
        # a replica that cannot read a contribution its round's record lists adopts the
        # round's published state (exchange/store_manager.py) instead of training it again:
        # the rule goodput_sim.py replays these rows by (rows without the key predate it)
        out_row["sync_adopts_listed"] = True
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
        out_row["overwrite_lag_steps"] = overwrite_lag_steps(store, a.p)
        sync_log = tmp / "logs" / "synchronizer.log"
        out_row["synchronizer_outages"] = synchronizer_outages(
            result.log, events, sync_log, t_go[0]
        )
    return out_row


def synchronizer_outages(
    log: list[dict[str, Any]], events: list[Any], sync_log: Path, t_go: float
) -> list[dict[str, Any]]:
    """Decoupled: each time the harness froze the synchronizer (a corrupted push: from the
    event's start until the push was corrupted and it was continued) or killed it, and when it
    was merging again: its first "resumed at versions" log line after the fault (a restart, or
    a freeze longer than its lease's safety margin: it takes the lease again and reloads the
    store), else, frozen, when it was continued; seconds from the start (goodput_sim.py
    replays them)."""
    import datetime

    resumed: list[float] = []  # the synchronizer's log lines (its logging.basicConfig times)
    with contextlib.suppress(OSError):
        for line in sync_log.read_text(errors="replace").splitlines():
            if "resumed at versions" in line:
                with contextlib.suppress(ValueError):
                    at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                    resumed.append(at.timestamp() - t_go)
    ordered = sorted(events, key=lambda e: e.at_s)
    out: list[dict[str, Any]] = []
    for e in log:
        if e.get("action") == "kill_synchronizer" and e.get("outcome") == "killed":
            cause, start, went_on = "killed", float(e["t"]), None
        elif e.get("action") == "corrupt" and str(e.get("target", "")).startswith("push"):
            cause, start, went_on = "frozen", ordered[int(e["event"])].at_s, float(e["t"])
        else:
            continue
        back = next((x for x in sorted(resumed) if x >= (went_on or start)), None)
        if went_on is not None and (back is None or back > went_on + 1.0):
            back = went_on  # it kept its lease: merging again as it was continued
        until = None if back is None else round(back, 3)
        out.append({"cause": cause, "t": round(start, 3), "until": until})
    return out


def _commit_times(store: Any, mode: str, a: argparse.Namespace, t_go: float) -> list[float]:
    """Seconds from the start at which each sync round was committed (its commit record's
    modification time; file:// only) or each decoupled merge record was made (its "time")."""
    times: list[float] = []
    if mode == "sync":
        root = store.local_path
        if root is None:
            return times
        for name in store.list("steps/"):
            path = Path(root) / "steps" / name / "commit.json"
            if path.exists():
                times.append(round(path.stat().st_mtime - t_go, 3))
        return sorted(times)
    from composer_replication.exchange.push_store import DecoupledStore

    docs = DecoupledStore(store)
    for p in range(a.p):
        for v in docs.versions(p, "merge"):
            rec = docs.read_merge(p, v)
            if rec is not None:
                times.append(round(float(rec["time"]) - t_go, 3))
    return sorted(times)


def sync_rounds(store: Any, t_go: float) -> list[dict[str, Any]]:
    """Sync, file:// only: each committed round as it happened, for checking the simulator's
    barrier against the real one: when it was committed, which ranks it merged and why the
    others were left out, and when each rank's contribution arrived (its object's modification
    time), seconds from the start."""
    from composer_replication.exchange.protocol import parse_contrib_name

    root = store.local_path
    rounds: list[dict[str, Any]] = []
    if root is None:
        return rounds
    for name in sorted(store.list("steps/")):
        folder = Path(root) / "steps" / name
        commit = folder / "commit.json"
        if not commit.exists():
            continue
        record = json.loads(commit.read_text())
        arrivals: dict[str, float] = {}
        for path in (
            (folder / "contrib").glob("*.safetensors") if (folder / "contrib").is_dir() else []
        ):
            rank = parse_contrib_name(path.name)
            if rank is not None:
                arrivals[str(rank)] = round(path.stat().st_mtime - t_go, 3)
        rounds.append(
            {
                "step": int(name.strip("/")),
                "t": round(commit.stat().st_mtime - t_go, 3),
                "included": record.get("included_ranks"),
                "excluded": record.get("excluded"),
                "arrivals": arrivals,
            }
        )
    return rounds


def overwrite_lag_steps(store: Any, p: int) -> float | None:
    """Decoupled: the mean inner steps a learner trained on a fragment after pushing it and
    before the merged version replaced it (alpha 0 throws them away): per learner and fragment,
    between two consecutive merged pushes, the steps it took minus the steps the later push
    carried (merge records: ``learner_step``, ``steps_since_push``). The simulator's merge lag."""
    from composer_replication.exchange.push_store import DecoupledStore

    docs = DecoupledStore(store)
    lost: list[int] = []
    for frag in range(p):
        pushes: dict[int, list[tuple[int, int]]] = {}
        for v in docs.versions(frag, "merge"):
            rec = docs.read_merge(frag, v)
            if rec is None:
                continue
            for e in rec["inputs"]:
                if rec["decisions"][e["push"]]["included"] and e.get("learner_step") is not None:
                    pushes.setdefault(int(e["learner"]), []).append(
                        (int(e["learner_step"]), int(e["steps_since_push"]))
                    )
        for seq in pushes.values():
            seq.sort()
            lost += [max(0, (s2 - s1) - n2) for (s1, _), (s2, n2) in zip(seq, seq[1:])]
    return sum(lost) / len(lost) if lost else None


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


def grid_schedule(
    n: int, run_s: float, round_s: float, seed: int, rate: float = FAULTS_PER_LEARNER_HOUR
) -> list[Any]:
    """The grid's fault schedule for ``n`` learners: ``round(rate * n * run_s / 3600)`` of each
    learner fault (kill mid-step, kill mid-upload, SIGSTOP for 2 rounds, 3x slower for 3
    rounds) at seeded times in [0.1, 0.85] of the run, on seeded learners (each learner hit
    once before any twice); a corrupted push or contribution at 0.55 and, decoupled only, the
    synchronizer killed at 0.65 (`_for_mode`). The same list serves both modes."""
    import random

    from composer_replication.config.schema import ChaosEventConfig as E

    rng = random.Random(1000 + seed)
    each = max(1, round(rate * n * run_s / 3600.0))
    kinds = [k for k in LEARNER_FAULTS for _ in range(each)]
    targets: list[int] = []
    while len(targets) < len(kinds):
        targets += rng.sample(range(n), n)
    ev = []
    for kind, target in zip(kinds, targets):
        at = rng.uniform(0.1, 0.85) * run_s
        if kind == "kill":
            ev.append(E(at_s=at, action="kill", target=str(target)))
        elif kind == "kill_upload":
            ev.append(E(at_s=at, action="kill", target=str(target), during="upload"))
        elif kind == "stop":
            ev.append(E(at_s=at, action="stop", target=str(target), duration_s=2 * round_s))
        else:
            ev.append(
                E(at_s=at, action="slow", target=str(target), factor=3.0, duration_s=3 * round_s)
            )
    ev.append(E(at_s=0.55 * run_s, action="corrupt", target="push:0"))
    ev.append(E(at_s=0.65 * run_s, action="kill_synchronizer", restart_after_s=1.0))
    return sorted(ev, key=lambda e: e.at_s)


def _start_offsets(out: Path, n: int, t_go: float) -> list[float]:
    """Seconds from the common start to each learner's first incarnation's start."""
    offsets = []
    for r in range(n):
        recs = [json.loads(line) for line in open(out / f"learner{r}.jsonl")]
        first = next((x["t"] for x in recs if x["kind"] == "start"), t_go)
        offsets.append(round(max(0.0, first - t_go), 2))
    return offsets


def _held_windows(
    log: list[dict[str, Any]], events: list[Any]
) -> dict[int, list[tuple[float, float]]]:
    """Per learner, the times (seconds from the start) the harness held its process: stopped,
    slowed, or probed for an upload to kill it in."""
    opened: dict[tuple[int, str], float] = {}
    held: dict[int, list[tuple[float, float]]] = {}
    ordered = sorted(events, key=lambda e: e.at_s)
    for e in log:
        if e.get("action") not in ("stop", "slow", "kill") or "event" not in e:
            continue
        with contextlib.suppress(ValueError, TypeError):
            rank = int(e["target"])
            key = (int(e["event"]), e["action"])
            if e["outcome"] in ("stopped", "slowed"):
                opened[key] = float(e["t"])
            elif e["outcome"] in ("continued", "full speed") and key in opened:
                held.setdefault(rank, []).append((opened.pop(key), float(e["t"])))
            elif e.get("during") == "upload":
                held.setdefault(rank, []).append((ordered[int(e["event"])].at_s, float(e["t"])))
    return held


def _held(step: dict[str, Any], windows: list[tuple[float, float]], t_go: float) -> bool:
    begin = float(step["t"]) - t_go  # when its compute began
    end = begin + float(step["c"])
    return any(begin < b and end > a for a, b in windows)


def _for_mode(schedule: list[Any], mode: str) -> list[Any]:
    """The grid schedule as one mode sees it: sync has no synchronizer and corrupts a
    contribution where decoupled corrupts a push."""
    from dataclasses import replace

    out = []
    for e in schedule:
        if mode == "sync" and e.action == "kill_synchronizer":
            continue
        if mode == "sync" and e.action == "corrupt":
            e = replace(e, target="contribution:0")
        out.append(e)
    return out


def _kept_steps(recs: list[dict[str, Any]], steps: int) -> int:
    """Steps one learner ran and kept: each incarnation's steps below where the next one
    started (the steps from there on were lost to the kill and redone), every step of the last
    incarnation; at most ``steps`` (a sync round retried after it failed trains its steps
    again)."""
    incarnations: list[tuple[int, list[int]]] = []
    for x in recs:
        if x["kind"] == "start":
            incarnations.append((int(x["step"]), []))
        elif x["kind"] == "step" and incarnations:
            incarnations[-1][1].append(int(x["step"]))
    kept = 0
    for i, (_, done) in enumerate(incarnations):
        nxt = incarnations[i + 1][0] if i + 1 < len(incarnations) else None
        kept += sum(1 for t in done if nxt is None or t < nxt)
    return min(kept, steps)


def _recoveries(log: list[dict[str, Any]], out: Path, n: int, t_go: float) -> list[float]:
    """Seconds from each kill of a learner to its next incarnation's first step (restart,
    imports, rejoin download): the recovery time the simulator takes."""
    found = []
    for e in log:
        if e.get("action") != "kill" or not str(e.get("outcome", "")).startswith("killed"):
            continue
        t_kill = t_go + float(e["t"])
        recs = [json.loads(line) for line in open(out / f"learner{int(e['target'])}.jsonl")]
        later = [x["t"] for x in recs if x["kind"] == "start" and x["t"] > t_kill]
        if later:
            found.append(round(min(later) - t_kill, 2))
    return found


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
    ap.add_argument("--n", type=int, default=N, help="(learner role) the run's learners")
    ap.add_argument("--alpha", type=float, default=0.0, help="(learner role) decoupled alpha")
    ap.add_argument(
        "--learners",
        default="",
        help="the grid: comma list of M (e.g. 4,8,16), sync and decoupled under one fault "
        "schedule per M and seed (FAULTS_PER_LEARNER_HOUR), on file:// unless --store s3",
    )
    ap.add_argument("--seeds", default="0,1,2", help="the grid's seeds")
    ap.add_argument(
        "--alpha-at", type=int, default=8, help="the grid: M at which alpha 0.5 also runs"
    )
    ap.add_argument(
        "--alphas", default="0.5", help="the grid: decoupled alphas beside 0 at --alpha-at"
    )
    ap.add_argument(
        "--sync-timeout-rounds", type=float, default=2.0, help="the grid's sync timeout"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="the grid: start no run after this many seconds (what was cut is listed)",
    )
    ap.add_argument("--json-out", default="", help="the grid: also write the result here")
    ap.add_argument(
        "--plot",
        default="",
        help="the grid: plot goodput against M here (.png); with --plot-from, from that result",
    )
    ap.add_argument("--plot-from", default="", help="a grid result (JSON) to plot, no runs")
    ap.add_argument(
        "--warm-spares",
        type=int,
        default=2,
        help="warm spares (torch and the learner's modules imported) that take a killed "
        "learner's restart, in both modes; 0: restarts start cold",
    )
    a = ap.parse_args()
    a.n = a.n if a.role == "learner" else N
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
    if a.warm_spares < 0:
        ap.error("--warm-spares: an integer >= 0")
    if a.quick:
        a.steps = 480
    if a.plot_from:
        plot_grid(json.loads(Path(a.plot_from).read_text()), Path(a.plot or "grid.png"))
        return
    if a.learners:
        result = grid(a)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(result, indent=1) + "\n")
        if a.plot:
            plot_grid(result, Path(a.plot))
        print(json.dumps(result))
        return
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


def grid(a: argparse.Namespace) -> dict[str, Any]:
    """The protocol at each M of ``--learners``: per seed and M one fault schedule
    (`grid_schedule`), sync (timeout ``--sync-timeout-rounds``) and decoupled (alpha 0) under
    it, and at M = ``--alpha-at`` decoupled at each of ``--alphas`` too (module docstring)."""
    from contextlib import nullcontext

    ms = [int(x) for x in a.learners.split(",") if x.strip()]
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    alphas = [float(x) for x in a.alphas.split(",") if x.strip()]
    run_s, round_s = a.steps * a.step_s, a.h * a.step_s
    quorum_arg = a.quorum
    t_start = time.time()
    plan = [
        (seed, m, mode, alpha)
        for seed in seeds
        for m in ms
        for mode, alpha in [("sync", 0.0), ("decoupled", 0.0)]
        + [("decoupled", x) for x in alphas if m == a.alpha_at]
    ]
    runs: list[dict[str, Any]] = []
    cut: list[str] = []
    failed: list[dict[str, Any]] = []
    server: Any = nullcontext(None)
    if a.store == "s3":
        from s3_servers import run_seaweedfs

        server = run_seaweedfs()
    with server as s3:
        for seed, m, mode, alpha in plan:
            name = f"{mode}_m{m}_seed{seed}" + (f"_alpha{alpha:g}" if alpha else "")
            if a.budget_s and time.time() - t_start > a.budget_s:
                cut.append(name)
                continue
            a.n, a.seed = m, seed
            a.quorum = quorum_arg if quorum_arg != N - 1 else m - 1  # default: all but one
            a.timeout = a.sync_timeout_rounds * round_s
            schedule = grid_schedule(m, run_s, round_s, seed)
            load = os.getloadavg()[0]
            try:
                row = run_once(a, mode, faults=True, s3=s3, alpha=alpha, schedule=schedule)
            except RuntimeError as exc:  # a run that did not finish is a finding: kept, named
                failed.append({"name": name, "error": str(exc)[:3000]})
                print(json.dumps({name: "failed"}), str(exc)[:1500], flush=True)
                continue
            row.update(
                name=name,
                learners=m,
                seed=seed,
                alpha=alpha,
                load_start=round(load, 2),
                load_end=round(os.getloadavg()[0], 2),
                steps=a.steps,
                h=a.h,
                p=a.p,
                step_s=a.step_s,
                min_replicas=a.min_replicas,
            )
            runs.append(row)
            if a.json_out:  # every finished run at once (a grid cut short keeps them)
                with open(a.json_out + ".rows.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
            print(json.dumps({name: _brief(row)}), flush=True)
            _say_if_not_protocol(name, row)
    result = summarize_grid(a, runs, ms, alphas, cut, time.time() - t_start)
    result["failed"] = failed
    return result


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "paper_goodput",
        "merged_goodput",
        "goodput",
        "eval_loss",
        "overrun_share",
        "compute_share",
        "recoveries_s",
        "spare_takeovers",
        "rounds_lost",
        "wall_s",
    )
    return {k: _r(row[k]) if isinstance(row.get(k), float) else row.get(k) for k in keys}


def summarize_grid(
    a: argparse.Namespace,
    runs: list[dict[str, Any]],
    ms: list[int],
    alphas: list[float],
    cut: list[str],
    seconds: float,
) -> dict[str, Any]:
    """The grid's last line: per M the means over seeds (the keys the module docstring names),
    every run's row, the conditions (machine, commit, load)."""

    def pick(mode: str, m: int, alpha: float = 0.0) -> list[dict[str, Any]]:
        return [r for r in runs if r["mode"] == mode and r["learners"] == m and r["alpha"] == alpha]

    def mean(rows: list[dict[str, Any]], key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return _r(statistics.fmean(vals)) if vals else None

    out: dict[str, Any] = {}
    for m in ms:
        s, d = pick("sync", m), pick("decoupled", m)
        out[f"decoupled_goodput_m{m}"] = mean(d, "paper_goodput")
        out[f"sync_goodput_m{m}"] = mean(s, "paper_goodput")
        out[f"decoupled_merged_goodput_m{m}"] = mean(d, "merged_goodput")
        out[f"sync_merged_goodput_m{m}"] = mean(s, "merged_goodput")
        gaps = [
            (x["eval_loss"] - y["eval_loss"]) / y["eval_loss"]
            for x in d
            for y in s
            if x["seed"] == y["seed"] and x["eval_loss"] and y["eval_loss"]
        ]
        out[f"loss_gap_vs_sync_m{m}"] = _r(statistics.fmean(gaps)) if gaps else None
        out[f"decoupled_eval_loss_m{m}"] = mean(d, "eval_loss")
        out[f"sync_eval_loss_m{m}"] = mean(s, "eval_loss")
        out[f"seeds_m{m}"] = sorted({r["seed"] for r in d} & {r["seed"] for r in s})
    for alpha in [0.0, *alphas]:
        rows = pick("decoupled", a.alpha_at, alpha)
        out[f"alpha{alpha:g}_merged_goodput_m{a.alpha_at}"] = mean(rows, "merged_goodput")
        out[f"alpha{alpha:g}_goodput_m{a.alpha_at}"] = mean(rows, "paper_goodput")
        out[f"alpha{alpha:g}_eval_loss_m{a.alpha_at}"] = mean(rows, "eval_loss")
    dec = [r for r in runs if r["mode"] == "decoupled"]
    out["rounds_lost"] = sum(int(r.get("rounds_lost") or 0) for r in dec) if dec else None
    out["overrun_share"] = _r(max((r["overrun_share"] or 0.0) for r in runs)) if runs else None
    out["compute_share"] = _r(max((r["compute_share"] or 0.0) for r in runs)) if runs else None
    not_protocol = [r["name"] for r in runs if not r["protocol_figure"]]
    out["protocol_figure"] = bool(runs) and not not_protocol
    out["not_protocol_runs"] = not_protocol
    recoveries = [x for r in runs for x in r["recoveries_s"]]
    out["recovery_s_median"] = _r(statistics.median(recoveries)) if recoveries else None
    out["cut"] = cut
    out["setting"] = {
        "steps": a.steps,
        "h": a.h,
        "p": a.p,
        "step_s": a.step_s,
        "model": {"d": a.d, "layers": a.layers, "ctx": a.ctx},
        "store": a.store,
        "sync_timeout_rounds": a.sync_timeout_rounds,
        "sync_min_replicas": a.min_replicas,
        "quorum": "all learners but one" if a.quorum == a.n - 1 else a.quorum,
        "faults_per_learner_hour_each": round(FAULTS_PER_LEARNER_HOUR, 3),
        "learner_faults": list(LEARNER_FAULTS),
        "alpha_at": a.alpha_at,
    }
    out["machine"] = _machine()
    out["seconds"] = round(seconds, 1)
    out["runs"] = runs
    if not_protocol:
        print(
            f"NOT A PROTOCOL FIGURE: {', '.join(not_protocol)} overran the simulated step in more "
            f"than {OVERRUN_LIMIT:.0%} of their steps",
            flush=True,
        )
    return out


def plot_grid(result: dict[str, Any], path: Path) -> None:
    """Goodput against M, both modes (each seed a dot, the mean a line): the paper's goodput
    left, merged-work goodput right; the simulator's predictions where ``result`` has them."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise SystemExit(
            "the grid plot needs matplotlib: pip install 'composer-replication[report]'"
        ) from exc
    runs = [r for r in result["runs"] if r["alpha"] == 0.0]
    ms = sorted({r["learners"] for r in runs})
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    titles = {
        "paper_goodput": "learner-time on kept steps (paper)",
        "merged_goodput": "merged work",
    }
    for ax, key in zip(axes, titles):
        for mode, color in (("sync", "C0"), ("decoupled", "C3")):
            pts = [(r["learners"], r[key]) for r in runs if r["mode"] == mode]
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o", color=color, alpha=0.35)
            means = [
                statistics.fmean([y for x, y in pts if x == m])
                for m in ms
                if any(x == m for x, _ in pts)
            ]
            ax.plot(
                [m for m in ms if any(x == m for x, _ in pts)], means, "-", color=color, label=mode
            )
            sim = result.get("simulated", {})
            sims = [sim.get(f"{mode}_m{m}_{key}") for m in ms]
            if any(v is not None for v in sims):
                ax.plot(
                    [m for m, v in zip(ms, sims) if v is not None],
                    [v for v in sims if v is not None],
                    "x--",
                    color=color,
                    label=f"{mode}, simulator",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("learners M")
        ax.set_title(titles[key])
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput")
    axes[0].legend(loc="lower left")
    st = result["setting"]
    fig.suptitle(
        f"sync vs Decoupled DiLoCo under faults ({st['faults_per_learner_hour_each']:g} of each "
        f"learner fault per learner-hour; {st['steps']} steps of {st['step_s']:g} s, H {st['h']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)


def _machine() -> dict[str, Any]:
    """Where the figures were taken: CPU model and flags, cores, commit, load now."""
    import platform
    import subprocess

    model, flags = "", []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "cpu_flags": [f for f in flags if f.startswith(("avx", "fma", "sse4", "amx"))],
        "python": platform.python_version(),
        "commit": commit,
        "load_end": [round(x, 2) for x in os.getloadavg()],
    }


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
