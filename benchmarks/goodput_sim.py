"""Goodput at internet scale: a discrete-event simulation of DP, elastic DP and Decoupled DiLoCo.

The Decoupled DiLoCo paper (Douillard et al. 2026) reports, for a mean time between interruptions
(MTBI) of one year per chip, goodput (useful chip-time / allocated chip-time) at 150k, 300k,
600k, 1.2M and 2.4M chips: DP 72/57/38/27/18 %, elastic DP 88/80/69/58/40 %, Decoupled DiLoCo
with M = 8 learners 98/96/94/88/80 % and M = 16 99/98/96/93/86 %. This script simulates the three
systems with one failure process and a few stated mechanism costs, and prints its table beside
the paper's.

Model (all times in seconds; every chip fails as a Poisson process with rate 1 / MTBI, so a
group of n chips fails at rate n / MTBI; a failed chip is replaced when its group restarts):

- **DP**: one synchronous job over all chips with in-memory checkpoints every step. A failure
  stops everything and loses the step in flight (``step_s``); the job restarts (``restart_s``:
  detect, reschedule, reload). Failures during the restart are absorbed by it.
- **Elastic DP**: the chips form ``replicas`` data-parallel replicas. A failure pauses the whole
  job for ``reconfigure_s`` (membership change, re-sharding) and loses the in-flight step; the
  failed replica is out for ``repair_s`` (a spare swapped in) while the others train at reduced
  capacity, and rejoins at a step boundary without a pause. No rollback to a checkpoint.
- **Decoupled DiLoCo**: M learners of chips / M chips each, each a synchronous job that never
  waits for the others. A failure stops only its learner for ``rejoin_s`` (restart and pull the
  newest global fragments from the store) and loses its work since its last fragment push (on
  average half of ``push_every_s``); the other learners and the synchronizer carry on.

Goodput is the chip-time spent on steps that are kept, over the simulated horizon. The three
per-system costs (``restart_s`` 70 s, ``reconfigure_s`` 18 s, ``rejoin_s`` 25 s) were chosen by
hand so each row lies near the paper's; what the model adds is how goodput scales with the chip
count and M under one failure process (mean absolute difference from the paper: about 3 points
for DP and elastic DP, 1 point or less for M = 8 and M = 16). Usage::

    python benchmarks/goodput_sim.py                 # the table + last-line JSON
    python benchmarks/goodput_sim.py --days 60 --seed 1

Last line: JSON with ``dp_goodput_2400k``, ``m8_goodput_2400k``, ``m16_goodput_2400k``, every
other cell, the paper's figures and the mean absolute difference per system.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from dataclasses import dataclass

YEAR = 365.0 * 24 * 3600
CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER = {
    "dp": (72, 57, 38, 27, 18),
    "elastic": (88, 80, 69, 58, 40),
    "m8": (98, 96, 94, 88, 80),
    "m16": (99, 98, 96, 93, 86),
}


@dataclass(frozen=True)
class Costs:
    """The mechanism costs (defaults: the stated assumptions; see the module docstring)."""

    mtbi_s: float = YEAR
    restart_s: float = 70.0  # DP: detect, reschedule, reload the last (in-memory) checkpoint
    reconfigure_s: float = 18.0  # elastic DP: a failure's membership change pauses everyone
    repair_s: float = 60.0  # elastic DP: a failed replica is out this long (spare swapped in)
    replicas: int = 256  # elastic DP: data-parallel replicas
    rejoin_s: float = 25.0  # decoupled: a learner restarts and pulls the newest globals
    push_every_s: float = 10.0  # decoupled: a fragment push every H/P steps
    step_s: float = 5.0  # one synchronous step (lost in flight by elastic DP)


def simulate_dp(chips: int, c: Costs, horizon: float, rng: random.Random) -> float:
    """Useful fraction of a synchronous job (see the module docstring)."""
    rate = chips / c.mtbi_s
    t, useful = 0.0, 0.0
    while t < horizon:
        fail = t + rng.expovariate(rate)
        if fail >= horizon:
            useful += horizon - t
            break
        # in-memory checkpoints every step: the step in flight is lost, then the restart
        useful += max(0.0, fail - t - rng.uniform(0.0, c.step_s))
        t = fail + c.restart_s  # failures during the restart are absorbed by it
    return min(useful / horizon, 1.0)


def simulate_elastic(chips: int, c: Costs, horizon: float, rng: random.Random) -> float:
    """Useful fraction of elastic DP (see the module docstring)."""
    rate = chips / c.mtbi_s
    per_replica = 1.0 / c.replicas
    t, useful = 0.0, 0.0
    back: list[float] = []  # times at which failed replicas are back
    while t < horizon:
        fail = t + rng.expovariate(rate * (1.0 - len(back) * per_replica))
        end = min(fail, horizon)
        # train at the capacity of the replicas present, which changes as repaired ones return
        while t < end:
            nxt = min(back[0], end) if back else end
            useful += (nxt - t) * (1.0 - len(back) * per_replica)
            t = nxt
            if back and back[0] <= t:
                heapq.heappop(back)
        if fail >= horizon:
            break
        useful = max(0.0, useful - rng.uniform(0.0, c.step_s) * (1.0 - len(back) * per_replica))
        if len(back) < c.replicas - 1:
            heapq.heappush(back, t + c.repair_s)
        t += c.reconfigure_s  # everyone pauses while the membership changes
        while back and back[0] <= t:
            heapq.heappop(back)
    return min(useful / horizon, 1.0)


def simulate_decoupled(chips: int, m: int, c: Costs, horizon: float, rng: random.Random) -> float:
    """Useful fraction of Decoupled DiLoCo with m learners (see the module docstring)."""
    rate = chips / m / c.mtbi_s
    total = 0.0
    for _ in range(m):  # learners are independent: nobody waits for anybody
        t, useful = 0.0, 0.0
        while t < horizon:
            fail = t + rng.expovariate(rate)
            if fail >= horizon:
                useful += horizon - t
                break
            lost = rng.uniform(0.0, c.push_every_s)  # work since its last push of a fragment
            useful += max(0.0, fail - t - lost)
            t = fail + c.rejoin_s
        total += useful / horizon
    return min(total / m, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description="DES of DP / elastic DP / Decoupled DiLoCo goodput")
    ap.add_argument("--days", type=float, default=30.0, help="simulated horizon per cell")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    c = Costs()
    horizon = a.days * 24 * 3600
    rng = random.Random(a.seed)
    table: dict[str, list[float]] = {"dp": [], "elastic": [], "m8": [], "m16": []}
    for chips in CHIPS:
        table["dp"].append(simulate_dp(chips, c, horizon, rng))
        table["elastic"].append(simulate_elastic(chips, c, horizon, rng))
        table["m8"].append(simulate_decoupled(chips, 8, c, horizon, rng))
        table["m16"].append(simulate_decoupled(chips, 16, c, horizon, rng))
    print(f"assumptions: {c}")
    print(f"{'system':<10}" + "".join(f"{n // 1000:>12}k" for n in CHIPS))
    diffs = {}
    for name, row in table.items():
        sim = "".join(f"{100 * g:>8.1f}% ({p:>2})" for g, p in zip(row, PAPER[name]))
        print(f"{name:<10}{sim}")
        diffs[name] = sum(abs(100 * g - p) for g, p in zip(row, PAPER[name])) / len(row)
    print(
        "(simulated % (paper %)); mean |difference| in points: "
        + ", ".join(f"{k} {v:.1f}" for k, v in diffs.items())
    )
    result: dict[str, object] = {}
    for name, row in table.items():
        for chips, g in zip(CHIPS, row):
            result[f"{name}_goodput_{chips // 1000}k"] = round(g, 4)
    result.update({f"mean_abs_diff_points_{k}": round(v, 2) for k, v in diffs.items()})
    result["paper"] = PAPER
    result["days"] = a.days
    print(json.dumps(result))


if __name__ == "__main__":
    main()
