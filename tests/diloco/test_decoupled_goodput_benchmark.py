"""benchmarks/decoupled_goodput.py's grid (``--learners``) and benchmarks/goodput_sim.py's
replay of it: the fault schedule scales with the learners at a fixed rate per learner-hour, the
paper's goodput counts the steps a learner kept, the grid's last line has the keys the docs
name, and the simulator replays a run's faults (a tiny real grid under ``long``; the figures
themselves are in docs/benchmarks-notebook.md, not judged here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decoupled_goodput as dg  # noqa: E402
import goodput_sim as gs  # noqa: E402

GRID_KEYS = [
    f"{k}_m{m}"
    for m in (4, 8, 16)
    for k in ("decoupled_goodput", "sync_goodput", "decoupled_merged_goodput", "loss_gap_vs_sync")
] + ["rounds_lost", "overrun_share"]


def test_fault_schedule_scales_with_the_learners_at_a_fixed_rate() -> None:
    """Each learner fault at FAULTS_PER_LEARNER_HOUR: twice the learners, twice the faults;
    every learner is hit once before any is hit twice; seeded."""
    run_s, round_s = 96.0, 8.0
    counts = {}
    for m in (4, 8, 16):
        ev = dg.grid_schedule(m, run_s, round_s, seed=0)
        learner = [e for e in ev if e.action in ("kill", "stop", "slow")]
        kinds = Counter((e.action, e.during if e.action == "kill" else "") for e in learner)
        assert len(set(kinds.values())) == 1  # as many of each learner fault
        counts[m] = len(learner)
        per_target = Counter(e.target for e in learner)
        assert max(per_target.values()) - min(per_target.values()) <= 1
        assert all(0.1 * run_s <= e.at_s <= 0.85 * run_s for e in learner)
        assert [e.action for e in ev].count("kill_synchronizer") == 1
        assert ev == sorted(ev, key=lambda e: e.at_s)
    assert counts == {4: 4, 8: 8, 16: 16}
    rate = counts[8] / 4 / (8 * run_s / 3600)  # per learner-hour, each of the four kinds
    assert rate == pytest.approx(dg.FAULTS_PER_LEARNER_HOUR)
    assert dg.grid_schedule(8, run_s, round_s, 1) != dg.grid_schedule(8, run_s, round_s, 0)
    sync = dg._for_mode(dg.grid_schedule(8, run_s, round_s, 0), "sync")
    assert "kill_synchronizer" not in [e.action for e in sync]
    assert [e.target for e in sync if e.action == "corrupt"] == ["contribution:0"]


def _recs(*parts: tuple[int, int]) -> list[dict[str, Any]]:
    """Records of incarnations: (start step, steps run)."""
    out: list[dict[str, Any]] = []
    for start, n in parts:
        out.append({"kind": "start", "step": start})
        out += [{"kind": "step", "step": start + i} for i in range(n)]
    return out


def test_kept_steps_counts_what_no_later_start_redid() -> None:
    assert dg._kept_steps(_recs((0, 20)), 20) == 20
    # killed at step 13, restarted from its last push at 12: step 12 was lost and redone
    assert dg._kept_steps(_recs((0, 13), (12, 8)), 20) == 20
    # sync: killed at 13, restarted from the newest commit at 16 (steps 13-15 nobody ran)
    assert dg._kept_steps(_recs((0, 13), (16, 4)), 20) == 17
    # killed before its first step
    assert dg._kept_steps(_recs((0, 0), (0, 20)), 20) == 20


def test_held_steps_are_left_out_of_the_overrun() -> None:
    """A step the harness stopped or slowed the process in is the fault's time."""
    log = [
        {"event": 0, "action": "stop", "target": "1", "outcome": "stopped", "t": 10.0},
        {"event": 0, "action": "stop", "target": "1", "outcome": "continued", "t": 16.0},
        {"event": 1, "action": "kill", "target": "2", "outcome": "killed mid-upload", "t": 30.0}
        | {"during": "upload"},
    ]
    events = [SimpleNamespace(at_s=10.0), SimpleNamespace(at_s=25.0)]
    held = dg._held_windows(log, events)
    assert held == {1: [(10.0, 16.0)], 2: [(25.0, 30.0)]}
    t_go = 1000.0
    assert dg._held({"t": t_go + 9.99, "c": 0.5}, held[1], t_go)
    assert not dg._held({"t": t_go + 16.5, "c": 0.5}, held[1], t_go)


def _row(mode: str, m: int, seed: int, goodput: float, loss: float, alpha: float = 0.0) -> dict:
    return {
        "name": f"{mode}_m{m}_seed{seed}",
        "mode": mode,
        "learners": m,
        "seed": seed,
        "alpha": alpha,
        "paper_goodput": goodput,
        "merged_goodput": goodput / 2,
        "eval_loss": loss,
        "overrun_share": 0.01,
        "compute_share": 0.02,
        "protocol_figure": True,
        "recoveries_s": [10.0],
        "rounds_lost": 0 if mode == "decoupled" else None,
    }


def test_grid_summary_has_the_documented_keys() -> None:
    runs = [
        _row(mode, m, seed, g, loss)
        for m in (4, 8, 16)
        for seed in (0, 1)
        for mode, g, loss in (("sync", 0.6, 2.0), ("decoupled", 0.9, 2.02))
    ] + [_row("decoupled", 8, 0, 0.9, 2.1, alpha=0.5)]
    a = SimpleNamespace(
        steps=96, h=8, p=4, step_s=1.0, d=16, layers=4, ctx=32, store="file", n=8, quorum=7
    )
    a.sync_timeout_rounds, a.min_replicas, a.alpha_at = 2.0, 2, 8
    out = dg.summarize_grid(a, runs, [4, 8, 16], [0.5], [], 1.0)  # type: ignore[arg-type]
    assert set(GRID_KEYS) <= set(out)
    assert out["decoupled_goodput_m8"] == 0.9 and out["sync_goodput_m8"] == 0.6
    assert out["decoupled_merged_goodput_m8"] == 0.45
    assert out["loss_gap_vs_sync_m16"] == pytest.approx(0.01)
    assert out["alpha0.5_eval_loss_m8"] == 2.1 and out["alpha0_eval_loss_m8"] == 2.02
    assert out["rounds_lost"] == 0 and out["protocol_figure"] is True
    assert {"cpu", "cpu_flags", "commit", "load_end"} <= set(out["machine"])


def test_simulator_without_faults_loses_only_the_exchange() -> None:
    costs = gs.RunCosts(recovery_s=10.0, exchange_s=0.5)
    dec = gs.simulate_protocol_run("decoupled", 4, 48, 8, 4, 1.0, [], costs)
    assert dec["paper_goodput"] == pytest.approx(1.0, abs=0.01)
    sync = gs.simulate_protocol_run("sync", 4, 48, 8, 4, 1.0, [], costs, timeout_s=16.0)
    # the round's exchange starts with its last step and fits in that step's padding
    assert sync["paper_goodput"] == pytest.approx(1.0, abs=0.01)
    slow = gs.RunCosts(recovery_s=10.0, exchange_s=1.5)
    sync = gs.simulate_protocol_run("sync", 4, 48, 8, 4, 1.0, [], slow, timeout_s=16.0)
    # one that does not: six rounds of 8 s, each 0.5 s longer
    assert sync["paper_goodput"] == pytest.approx(48 / 51, abs=0.01)
    assert sync["merged_goodput"] == pytest.approx(sync["paper_goodput"], abs=0.01)


def test_simulator_a_stopped_learner_stalls_sync_not_decoupled() -> None:
    costs = gs.RunCosts(recovery_s=10.0)
    stop = [{"kind": "stop", "target": "1", "t": 10.0, "until": 26.0, "factor": 1.0}]
    dec = gs.simulate_protocol_run("decoupled", 4, 48, 8, 4, 1.0, stop, costs)
    sync = gs.simulate_protocol_run("sync", 4, 48, 8, 4, 1.0, stop, costs, timeout_s=100.0)
    # decoupled: only learner 1 loses its 16 s; sync: everyone waits for it
    assert dec["paper_goodput"] == pytest.approx(4 * 48 / (3 * 48 + 64), abs=0.01)
    assert sync["paper_goodput"] == pytest.approx(48 / 64, abs=0.01)
    kill = [{"kind": "kill", "target": "2", "t": 13.5}]
    dec = gs.simulate_protocol_run("decoupled", 4, 48, 8, 4, 1.0, kill, costs)
    # killed in its 14th step, whose hook (at the step's start) pushed: back from that push
    # (its progress document, step 14) ten seconds later
    assert dec["paper_goodput"] == pytest.approx(4 * 48 / (3 * 48 + 48 + 13.5 + 10 - 14), abs=0.01)


def test_simulator_reads_a_runs_faults_from_its_chaos_log() -> None:
    row = {
        "schedule": [{"action": "slow", "factor": 3.0}, {"action": "kill"}],
        "chaos_log": [
            {"event": 0, "action": "slow", "target": "1", "outcome": "slowed", "t": 5.0},
            {"event": 1, "action": "kill", "target": "0", "outcome": "killed", "t": 7.0},
            {"event": 0, "action": "slow", "target": "1", "outcome": "full speed", "t": 9.0},
        ],
    }
    assert gs.faults_of(row) == [
        {"kind": "kill", "target": "0", "t": 7.0},
        # the harness's 3x: the simulated accelerator counts each 0.1 s stop as 5 ms
        {
            "kind": "slow",
            "target": "1",
            "t": 5.0,
            "until": 9.0,
            "factor": gs.harness_slow_factor(3.0),
        },
    ]


def test_simulator_slow_factor_is_the_harness_duty_cycle() -> None:
    """The harness slows a learner by stopping it 0.05 * (factor - 1) s of every 0.05 * factor;
    decoupled_goodput.py's busy() counts a stop of 0.08 s or more as one 5 ms tick and a
    shorter one whole: 3x steps 2.73x slower, 2x not at all."""
    assert gs.harness_slow_factor(3.0) == pytest.approx(2.727, abs=1e-3)
    assert gs.harness_slow_factor(2.0) == 1.0
    assert gs.harness_slow_factor(1.0) == 1.0


@pytest.mark.long
@pytest.mark.slow
def test_tiny_grid_prints_the_keys_and_the_simulator_replays_it(tmp_path: Path) -> None:
    """Two learners, 12 steps of 0.3 s, one seed: the last line has every grid key for M = 2,
    each run's faults and commit times, and goodput_sim.py --check replays it."""
    out = tmp_path / "grid.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decoupled_goodput.py"), "--protocol"]
    cmd += ["--learners", "2", "--seeds", "0", "--steps", "12", "--h", "4", "--p", "2"]
    cmd += ["--step-s", "0.3", "--store", "file", "--min-replicas", "1", "--alpha-at", "2"]
    cmd += ["--json-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = ["decoupled_goodput", "sync_goodput", "decoupled_merged_goodput", "loss_gap_vs_sync"]
    assert {f"{k}_m2" for k in keys} | {"rounds_lost", "overrun_share"} <= set(last)
    assert last["rounds_lost"] == 0
    assert {r["name"] for r in last["runs"]} == {
        "sync_m2_seed0",
        "decoupled_m2_seed0",
        "decoupled_m2_seed0_alpha0.5",
    }
    for r in last["runs"]:
        assert 0 < r["merged_goodput"] <= 1.0 and 0 < r["paper_goodput"] <= 1.0
        assert r["chaos_log"] and r["commit_times"]
        assert r["warm_spares"] == 2 and r["spare_takeovers"] <= sum(r["restarts"])
    # sync: every committed round as it happened, agreeing with the commit times and the
    # merged work counted from the same commit records
    sync = next(r for r in last["runs"] if r["mode"] == "sync")
    assert [x["t"] for x in sync["rounds"]] == sorted(sync["commit_times"])
    assert sum(4 * len(x["included"]) for x in sync["rounds"]) == sync["useful_steps"]
    for x in sync["rounds"]:
        assert set(map(int, x["arrivals"])) >= set(x["included"])
        assert all(x["arrivals"][str(rank)] <= x["t"] for rank in x["included"])
        # a restarted learner keeps its writer secret: its earlier upload is its own
        assert not any("squatted" in why for why in (x["excluded"] or {}).values()), x
    assert json.loads(out.read_text())["decoupled_goodput_m2"] == last["decoupled_goodput_m2"]
    sim = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "goodput_sim.py"), "--check", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert sim.returncode == 0, sim.stderr[-3000:]
    result = json.loads(sim.stdout.strip().splitlines()[-1])
    assert result["runs"] == 2 and result["sim_max_abs_error_paper"] is not None


def test_simulator_overwrites_what_a_learner_trained_before_taking_a_version() -> None:
    """No faults, learners in step: the learner's optimizer hook (DecoupledLearner._after_step)
    runs as a step's inner compute is done, at its start, and there it takes the versions
    published by then and pushes; a fragment pushed in step k's hook is merged at once and
    taken in step k + 1's hook, which overwrites step k + 1's update: 7 of every 8 steps reach
    the model (alpha 0), less the last one of each fragment."""
    costs = gs.RunCosts(recovery_s=10.0, apply_s=0.1)
    dec = gs.simulate_protocol_run("decoupled", 4, 96, 8, 4, 1.0, [], costs)
    assert dec["paper_goodput"] == pytest.approx(1.0, abs=0.01)
    # per fragment 12 merges of 8 steps each less one overwritten step (fragment 3's last push
    # is in the last step's hook: nothing after it), over 96 steps of 4 learners
    assert dec["merged_goodput"] == pytest.approx(4 * (96 - 47 / 4) / (4 * 96), abs=0.01)


def test_simulator_hook_pushes_and_takes_at_the_start_of_a_step() -> None:
    """Hand-worked: 2 learners, H = 4, one fragment, 8 steps of 1 s, no faults. Step 4's hook
    (t = 3: the inner compute done, the padding to come) pushes steps 1-4; both learners
    pushed, so the merge comes at once (t = 3) and is published 0.1 s later; step 5's hook
    (t = 4) takes it and overwrites step 5's update; step 8's hook (t = 7) pushes steps 6-8,
    merged at once; the learner, done at t = 8, has nothing left to push. Merged: 7 of 8
    steps per learner. (The replay before pushed as a step ended, t = 4 and 8, and took a
    version one step later: 6 of 8.)"""
    costs = gs.RunCosts(recovery_s=1.0, apply_s=0.1)
    seen: dict[str, list[Any]] = {}
    out = gs.simulate_protocol_run("decoupled", 2, 8, 4, 1, 1.0, [], costs, trace=seen)
    assert seen["merges"] == pytest.approx([3.0, 7.0], abs=0.03)
    # 14 steps merged over 2 learners' 8 s (each ends a tick early: 7.98 s)
    assert out["merged_goodput"] == pytest.approx(14 / 16, abs=0.01)


def test_simulator_stopped_learner_stays_active_and_the_grace_window_is_the_emas() -> None:
    """Hand-worked: 3 learners (quorum 2), H = 4, one fragment; learner 2 is stopped from 0.5 s
    on. The synchronizer counts it active (not done, not dead: run_local writes no departure,
    dead_after_s is 120 s), so the push of learners 0 and 1 in step 4's hook (t = 3) is a
    quorum, not everyone, and waits the grace window decided at the quorum from the EMAs:
    each learner's step time (its hooks at 0, 1, 2, 3 s: 0, 0.2, 0.36, 0.488) is what its push
    reports, so step_s = 0.488, quorum_s none yet: 0.8 * (2 * 0.488 - 0) = 0.78 s, merge at
    3.78. Without the stop all three push and the merge comes at once."""
    costs = gs.RunCosts(recovery_s=1.0, apply_s=0.1)
    stop = [{"kind": "stop", "target": "2", "t": 0.5, "until": 100.0, "factor": 1.0}]
    seen: dict[str, list[Any]] = {}
    gs.simulate_protocol_run("decoupled", 3, 8, 4, 1, 1.0, stop, costs, trace=seen)
    assert seen["merges"][0] == pytest.approx(3.0 + 0.8 * 2 * 0.488, abs=0.03)
    seen = {}
    gs.simulate_protocol_run("decoupled", 3, 8, 4, 1, 1.0, [], costs, trace=seen)
    assert seen["merges"][0] == pytest.approx(3.0, abs=0.03)


def test_simulator_kill_mid_upload_loses_that_push() -> None:
    """A kill the harness lands mid-upload (chaos log "killed mid-upload") catches the push of
    the step it lands in: the push never reaches the synchronizer and the learner restarts
    from its previous push (its progress document is written after each stored push); a
    plain kill after the step's hook restarts from that hook's push. 4 learners, H = 8, P = 4:
    killed at 9.5 s, in step 10, whose hook pushed fragment 0."""
    row = {
        "schedule": [{"action": "kill"}],
        "chaos_log": [
            {"event": 0, "action": "kill", "target": "1", "outcome": "killed mid-upload", "t": 9.5}
        ],
        "recoveries_s": [1.0],
    }
    faults = gs.faults_of(row)
    assert faults == [
        {"kind": "kill", "target": "1", "t": 9.5, "lost_push": True, "recovery_s": 1.0}
    ]
    costs = gs.RunCosts(recovery_s=1.0, apply_s=0.1)
    plain = [{k: v for k, v in faults[0].items() if k != "lost_push"}]
    seen: dict[str, list[Any]] = {}
    gs.simulate_protocol_run("decoupled", 4, 16, 8, 4, 1.0, plain, costs, trace=seen)
    assert [k for _, _, k in seen["restarts"]] == [10]
    assert seen["merges"][4] == pytest.approx(9.0, abs=0.03)  # fragment 0, everyone pushed
    seen = {}
    gs.simulate_protocol_run("decoupled", 4, 16, 8, 4, 1.0, faults, costs, trace=seen)
    assert [k for _, _, k in seen["restarts"]] == [8]
    # the other three are a quorum, not everyone (learner 1 is active): the grace window
    assert seen["merges"][4] > 9.5


def test_simulator_drops_a_late_push_on_a_base_already_merged() -> None:
    """FragmentMerger._select: a late push of a learner whose push on the same base was merged
    before is dropped (its work is in that one); any other late push is carried."""
    costs = gs.RunCosts(recovery_s=1.0, apply_s=0.1)
    fr = gs._Fragments(2, 4, 1, costs, 1.0)
    for r in (0, 1):
        fr.since[r][0] = 4
        fr.push(r, 0, 3.0)
    fr.tick(3.0, {0, 1})  # everyone pushed on version 0: merged, 8 steps
    assert fr.version == [1] and fr.useful == 8
    # learner 1 takes version 1 (published at 3.1) and pushes on it, learner 0 pushes on
    # version 0 again (it never took version 1)
    fr.take(1, 0, 3.2)
    fr.since[0][0], fr.since[1][0] = 3, 2
    fr.push(0, 0, 5.0)
    fr.push(1, 0, 5.0)
    fr.tick(5.0, set())  # the final merge: learner 0's late push is dropped
    assert fr.version == [2] and fr.useful == 8 + 2


def test_simulator_synchronizer_outage_delays_merges_and_lowers_merged_work() -> None:
    """While the synchronizer is down nothing merges; it comes back to every push made
    meanwhile and merges at once (every live learner pushed: no grace window); the merges it
    missed leave more work to be overwritten around its return, so merged work drops."""
    costs = gs.RunCosts(recovery_s=10.0, apply_s=0.1)
    seen: dict[str, list[Any]] = {}
    down = [{"kind": "synchronizer", "t": 20.0, "until": 32.0}]
    out = gs.simulate_protocol_run("decoupled", 4, 96, 8, 4, 1.0, down, costs, trace=seen)
    base = gs.simulate_protocol_run("decoupled", 4, 96, 8, 4, 1.0, [], costs)
    merges = seen["merges"]
    assert not [t for t in merges if 20.0 <= t < 32.0]
    assert 32.0 <= min(t for t in merges if t >= 20.0) < 32.1
    assert len([t for t in merges if 32.0 <= t < 32.1]) == 4  # every fragment, at once
    assert out["paper_goodput"] == pytest.approx(base["paper_goodput"])
    assert out["merged_goodput"] < base["merged_goodput"] - 0.01


def test_synchronizer_outages_of_a_row() -> None:
    """A row's recorded outages, else the freeze (the corrupt event's start to the corrupted
    push) and the kill (to the next merge record) from its chaos log and commit times."""
    row: dict[str, Any] = {
        "mode": "decoupled",
        "schedule": [{"at_s": 10.0, "action": "stop"}, {"at_s": 52.8, "action": "corrupt"}],
        "chaos_log": [
            {
                "event": 1,
                "action": "corrupt",
                "target": "push:0",
                "outcome": "corrupted",
                "t": 55.4,
            },
            {"event": 2, "action": "kill_synchronizer", "outcome": "killed", "t": 62.4},
        ],
        "commit_times": [50.0, 55.6, 70.1, 71.0],
    }
    assert gs.synchronizer_outages(row) == [(52.8, 55.4), (62.4, 70.1)]
    assert {"kind": "synchronizer", "t": 62.4, "until": 70.1, "restarted": True} in gs.faults_of(
        {**row, "chaos_log": row["chaos_log"]}
    )
    row["synchronizer_outages"] = [{"cause": "killed", "t": 62.4, "until": 68.0}]
    assert gs.synchronizer_outages(row) == [(62.4, 68.0)]
    assert gs.synchronizer_outages({**row, "mode": "sync"}) == []


def test_benchmark_records_synchronizer_outages(tmp_path: Path) -> None:
    """decoupled_goodput.py's record: a kill until the restarted synchronizer's "resumed at
    versions" log line; a freeze until that line if it lost its lease, else until continued."""
    import datetime

    t_go = datetime.datetime(2026, 1, 1, 12, 0, 0).timestamp()

    def line(s: float) -> str:
        at = datetime.datetime.fromtimestamp(t_go + s).strftime("%Y-%m-%d %H:%M:%S,%f")[:23]
        return f"{at} composer_replication.diloco.decoupled.synchronizer synchronizer x: resumed at versions [0]"

    log_path = tmp_path / "synchronizer.log"
    log_path.write_text("\n".join([line(-0.5), line(55.6), "=== restart 1 ===", line(69.25)]))
    events = [SimpleNamespace(at_s=52.8), SimpleNamespace(at_s=62.4), SimpleNamespace(at_s=80.0)]
    log = [
        {"event": 0, "action": "corrupt", "target": "push:0", "outcome": "corrupted", "t": 55.4},
        {"event": 1, "action": "kill_synchronizer", "outcome": "killed", "t": 62.45},
        {"event": 2, "action": "corrupt", "target": "push:0", "outcome": "corrupted", "t": 80.5},
    ]
    got = dg.synchronizer_outages(log, events, log_path, t_go)
    assert got == [
        {"cause": "frozen", "t": 52.8, "until": 55.6},
        {"cause": "killed", "t": 62.45, "until": 69.25},
        {"cause": "frozen", "t": 80.0, "until": 80.5},
    ]


def test_synthetic_faults_scale_with_the_rate() -> None:
    assert gs.synthetic_faults(8, 96.0, 8.0, 0.0, 0, 10.0) == []
    few = [len(gs.synthetic_faults(8, 96.0, 8.0, 5.0, s, 10.0)) for s in range(20)]
    many = [len(gs.synthetic_faults(8, 96.0, 8.0, 20.0, s, 10.0)) for s in range(20)]
    assert sum(many) > 2 * sum(few) > 0


def test_corpus_shard_is_built_once_and_read_back_the_same(tmp_path: Path) -> None:
    import torch

    calls: list[tuple[int, int]] = []

    def load(max_train_bytes: int, max_eval_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((max_train_bytes, max_eval_bytes))
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, 256, (5000,), generator=g), torch.randint(
            0, 256, (700,), generator=g
        )

    built = dg._corpus(tmp_path, load)
    read = dg._corpus(tmp_path, load)  # a learner's start: read, not rebuilt
    assert calls == [dg.CORPUS_BYTES]
    for b, r in zip(built, read):
        assert r.dtype == torch.int64 and torch.equal(b, r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus-eval.u8", "corpus-train.u8"]


def test_simulator_sync_commit_follows_the_exchange_rules() -> None:
    """ObjectStoreAllReduce's committer: the lowest valid rank, at the round's barrier, as soon
    as it is ready (every slot judged, or its own timeout_s over); a killed or stopped one
    (it does not poll) leaves it to the others a commit grace after each became ready."""
    b = gs._SyncBarrier(3, 2, 16.0, 4.0)
    for r, at in ((0, 7.0), (1, 7.0), (2, 10.0)):
        b.enter(r, at)
    assert b.poll(1, 10.0) is None  # rank 0 commits
    assert b.poll(0, 10.0) == "commit" and b.commit == (10.0, [0, 1, 2])
    b = gs._SyncBarrier(3, 2, 16.0, 4.0)
    for r, at in ((0, 7.0), (1, 7.0), (2, 10.0)):
        b.enter(r, at)
    assert b.poll(1, 10.0) is None and b.poll(1, 13.9) is None  # rank 0 killed after its upload
    assert b.poll(1, 14.0) == "commit"
    b = gs._SyncBarrier(3, 2, 16.0, 4.0)
    b.enter(0, 7.0)
    b.enter(1, 7.5)  # rank 2 never came: each replica's own timeout
    assert b.poll(0, 22.9) is None and b.poll(0, 23.0) == "commit"
    b = gs._SyncBarrier(3, 2, 16.0, 4.0)
    b.enter(0, 7.0)
    b.enter(1, 7.5)  # rank 0 stopped: rank 1's timeout, then the grace
    assert b.poll(1, 23.5) is None and b.poll(1, 27.4) is None
    assert b.poll(1, 27.5) == "commit"


def test_simulator_sync_replica_is_ready_at_its_own_timeout_before_the_round_settles() -> None:
    """A replica whose timeout_s ran out is ready then, and its grace counts from then, even
    when the last slot arrives later (the old rule took the last arrival for every replica)."""
    b = gs._SyncBarrier(3, 2, 16.0, 4.0)
    b.enter(0, 7.0)
    b.enter(1, 7.0)
    assert b.poll(1, 23.0) is None  # ready (its timeout), rank 0 is the lowest: it waits
    b.enter(2, 24.0)  # the round settles; rank 0 does not poll (stopped)
    assert b.poll(1, 26.9) is None
    assert b.poll(1, 27.0) == "commit" and b.commit == (27.0, [0, 1, 2])


def test_simulator_sync_corrupted_contribution_read_before_stays_valid() -> None:
    """The injector corrupts rank 0's stored contribution at 16: ranks that read it before hold
    it valid, a rank that reads it after refuses it, and rank 0 reading its own back before
    committing leaves itself out. A record listing it cannot be applied by those without it."""
    b = gs._SyncBarrier(4, 2, 8.0, 2.0)
    b.enter(1, 15.0)
    b.enter(2, 15.0)
    b.enter(0, 15.5)
    for r in (0, 1, 2):
        assert b.poll(r, 15.6) is None
    b.corrupted[0] = 16.0
    b.enter(3, 17.0)
    assert b.poll(3, 17.0) is None
    assert b.held[1] == {0, 2} and b.refused[3] == {0}
    assert b.poll(1, 23.0) is None  # rank 1: ready at its timeout, waits for rank 0
    assert b.poll(0, 23.5) is None and b.dropped == {0}  # its read-back is corrupted
    assert b.poll(1, 25.0) == "commit" and b.commit == (25.0, [0, 1, 2, 3])
    assert b.applies(1, 25.1, in_call=True) and b.applies(2, 25.1, in_call=True)
    assert not b.applies(0, 25.1, in_call=True) and not b.applies(3, 25.1, in_call=True)
    assert not b.applies(1, 25.1, in_call=False)  # a later call reads the corrupted copy


def test_simulator_sync_listed_corrupted_contribution_fails_the_others_rounds() -> None:
    """Replayed as the code ran before replicas adopted a listed round (``adopt_listed``
    False, the rows measured then): rank 3 is stopped through round 2's barrier and rank 0
    uploads last, so ranks 1 and 2 (holding rank 0's contribution, read before it was
    corrupted at 16) are ready first and commit it: rank 0 (its read-back failed) and rank 3
    (reads it after) cannot apply round 2, train it again until round 3 is committed without
    them, and heal. The rule before that (round 2 committed without rank 0, nobody fails) lost
    only rank 0's 8 steps."""
    costs = gs.RunCosts(recovery_s=10.0, adopt_listed=False)
    stop = {"kind": "stop", "target": "3", "t": 12.0, "until": 23.0, "factor": 1.0}
    late = {"kind": "stop", "target": "0", "t": 0.0, "until": 0.5, "factor": 1.0}
    hit = {"kind": "corrupt", "target": "0", "t": 16.0}
    base = gs.simulate_protocol_run("sync", 4, 48, 8, 4, 1.0, [stop, late], costs, timeout_s=8.0)
    trace: dict[str, list[Any]] = {}
    out = gs.simulate_protocol_run(
        "sync", 4, 48, 8, 4, 1.0, [stop, late, hit], costs, timeout_s=8.0, trace=trace
    )
    listed = {x["round"]: x["included"] for x in trace["rounds"]}
    assert listed[2] == [0, 1, 2] and listed[3] == [1, 2] and listed[4] == [0, 1, 2, 3]
    assert out["paper_goodput"] < base["paper_goodput"] - 0.05
    assert out["merged_goodput"] < base["merged_goodput"] - 0.1


def test_simulator_sync_replica_adopts_a_listed_round_it_cannot_read() -> None:
    """The same faults as above under today's rule (exchange/store_manager.py: a replica that
    cannot read a listed contribution adopts the round's state as its committer publishes it):
    ranks 0 and 3 apply round 2 through the published state and are in round 3's record, so
    no round is trained twice and the run loses next to nothing against the one without the
    corruption; with the rule off it loses rounds (the test above)."""
    stop = {"kind": "stop", "target": "3", "t": 12.0, "until": 23.0, "factor": 1.0}
    late = {"kind": "stop", "target": "0", "t": 0.0, "until": 0.5, "factor": 1.0}
    hit = {"kind": "corrupt", "target": "0", "t": 16.0}
    costs = gs.RunCosts(recovery_s=10.0)
    assert costs.adopt_listed
    base = gs.simulate_protocol_run("sync", 4, 48, 8, 4, 1.0, [stop, late], costs, timeout_s=8.0)
    trace: dict[str, list[Any]] = {}
    out = gs.simulate_protocol_run(
        "sync", 4, 48, 8, 4, 1.0, [stop, late, hit], costs, timeout_s=8.0, trace=trace
    )
    listed = {x["round"]: x["included"] for x in trace["rounds"]}
    assert listed[2] == [0, 1, 2] and listed[3] == [0, 1, 2, 3]
    assert out["paper_goodput"] > base["paper_goodput"] - 0.02
    assert out["merged_goodput"] > base["merged_goodput"] - 0.02
    old = gs.simulate_protocol_run(
        "sync",
        4,
        48,
        8,
        4,
        1.0,
        [stop, late, hit],
        gs.RunCosts(recovery_s=10.0, adopt_listed=False),
        timeout_s=8.0,
    )
    assert out["merged_goodput"] > old["merged_goodput"] + 0.05


def test_simulator_check_takes_the_listed_round_rule_from_the_rows() -> None:
    """Rows the benchmark writes since the rule say so (``sync_adopts_listed``); older rows
    are replayed by the rule they ran under."""
    row = {
        "mode": "sync",
        "learners": 4,
        "alpha": 0.0,
        "recoveries_s": [5.0],
        "commit_times": [8.5, 17.0],
        "h": 8,
        "step_s": 1.0,
    }
    assert not gs.costs_from_runs([row])[("sync", 4)].adopt_listed
    assert gs.costs_from_runs([{**row, "sync_adopts_listed": True}])[("sync", 4)].adopt_listed


def test_simulator_sync_a_contribution_read_after_corruption_by_the_lowest_is_left_out() -> None:
    """Rank 1 reaches round 2 after rank 0's contribution was corrupted: it refuses it, is its
    own lowest valid rank and commits without it at once; nobody fails, only rank 0's 8 steps
    are not merged; corrupted after its round was committed, it changes nothing."""
    costs = gs.RunCosts(recovery_s=10.0)
    stop = {"kind": "stop", "target": "1", "t": 12.0, "until": 20.0, "factor": 1.0}
    base = gs.simulate_protocol_run("sync", 4, 48, 8, 4, 1.0, [stop], costs, timeout_s=30.0)
    assert base["merged_goodput"] == pytest.approx(base["paper_goodput"], abs=1e-9)
    hit = {"kind": "corrupt", "target": "0", "t": 16.0}
    out = gs.simulate_protocol_run("sync", 4, 48, 8, 4, 1.0, [stop, hit], costs, timeout_s=30.0)
    assert out["paper_goodput"] == pytest.approx(base["paper_goodput"], abs=1e-3)
    assert out["merged_goodput"] == pytest.approx(
        base["paper_goodput"] * (4 * 48 - 8) / (4 * 48), abs=1e-3
    )
    late = {"kind": "corrupt", "target": "0", "t": 30.0}
    out = gs.simulate_protocol_run("sync", 4, 48, 8, 4, 1.0, [stop, late], costs, timeout_s=30.0)
    assert out["merged_goodput"] == pytest.approx(base["merged_goodput"], abs=1e-9)


def test_simulator_sync_contribution_is_stored_upload_s_into_the_last_step() -> None:
    """A sync contribution is stored ``upload_s`` after the round's last step begins (the
    first round's arrivals measure it): a kill 0.1 s into that step catches it before its
    upload, and the round waits for the restarted learner (the old rule, stored as the step
    began, merged it and let the others go on)."""
    kill = [{"kind": "kill", "target": "2", "t": 15.1}]
    trace: dict[str, list[Any]] = {}
    costs = gs.RunCosts(recovery_s=5.0, upload_s=0.3)
    out = gs.simulate_protocol_run(
        "sync", 4, 48, 8, 4, 1.0, kill, costs, timeout_s=30.0, trace=trace
    )
    second = trace["rounds"][1]
    assert second["round"] == 2 and second["arrivals"][0] == pytest.approx(15.3, abs=0.03)
    assert second["arrivals"][2] > 25.0 and second["t"] > 25.0  # everyone waited for rank 2
    early = gs.simulate_protocol_run(
        "sync", 4, 48, 8, 4, 1.0, kill, gs.RunCosts(recovery_s=5.0), timeout_s=30.0
    )
    assert out["paper_goodput"] < early["paper_goodput"] - 0.05
