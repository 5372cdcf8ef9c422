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
per-system costs of this paper-scale table (``restart_s`` 70 s, ``reconfigure_s`` 18 s,
``rejoin_s`` 25 s) are assumptions about clusters we cannot run, chosen by hand so each row lies
near the paper's; what the model adds is how goodput scales with the chip count and M under one
failure process (mean absolute difference from the paper: about 3 points for DP and elastic DP,
1 point or less for M = 8 and M = 16).

**Checked against real processes** (``--check``): `simulate_protocol_run` replays each run of a
``benchmarks/decoupled_goodput.py --learners`` grid, the same M, steps, step and round, sync
timeout, and that run's faults as they happened (kills, stop and slow windows from its chaos
log), and predicts both of its goodputs (the paper's and merged work). Its costs are measured,
none hand-set: ``recovery_s``, the median time from a kill to the restarted learner's first step
over the runs of that mode and M (process start, imports, rejoin: 3-10 s on the quiet 2-core
machine, 10-22 s when it was shared); ``exchange_s``, from a sync round's last arrival to its
commit (inside the last step's padding on a quiet machine); ``upload_s``, from a sync round's last
step beginning to its contribution stored (the first round's arrivals: 0.2-0.5 s with 8-16
learners uploading at once on 2 cores); ``hook_s``, where in a decoupled step its optimizer
hook runs (the real compute, ``compute_share``: 25-95 ms); ``push_s``, from a decoupled step's
start to the synchronizer holding its push (the first merge, which waits for every learner's
first push: 0.07-0.12 s with 4 learners, 0.2-0.37 s with 8-16); decoupled's quorum (all
active learners but one), grace window (gamma 0.8, tau 2, of the synchronizer's EMAs) and
poll interval are the run's settings; a slow window steps
`harness_slow_factor` slower (the harness's 3x duty cycle is 2.73x on the simulated
accelerator, whose step time counts each 0.1 s stop as 5 ms). The first replay
missed one cost: a learner takes a new fragment version only after its next inner step (the
optimizer hook), so that step's work on the fragment is overwritten too; with it the merged-work
prediction for decoupled moved from 0.705 to 0.635 against 0.585 measured (M = 16, seed 0).
A second: a sync learner's contribution is stored ``upload_s`` after its round's last step
begins (the exchange runs in that step's optimizer step, the padding after it), not as the step
ends; with it a kill in the first few tenths of a second of that step catches the learner
before its upload, as in the runs. A third, sync's corrupted contribution (`_SyncBarrier`): the
replicas that read it before it was corrupted hold it valid, a replica reading it later refuses
it, and its owner, about to commit, reads its own copy back and leaves itself out; so when a
holder commits (it became ready first, at its own timeout), every replica without a valid copy
(the owner included) fails the round, trains it again, fails again at each barrier until the
next round is committed without them, and heals: one run lost 4 learners x 32 s this way,
which the old rule (the corrupted contribution refused by all, nobody fails) did not see. On
the quiet grid it
predicts decoupled's learner-time goodput within 0.003 in every run and sync's within 0.03 but
one run (0.067, M = 8 seed 0: whether the slowed rank 1 read rank 0's contribution before it
was corrupted, 0.17 s apart in the run, decides whether 4 learners fail a round; the replay
has rank 1 arrive 0.8 s later: its slow windows ran at 0.39-0.50 of full speed, judged from
its round arrivals, against the 0.37 modelled). The synchronizer's outages are replayed
(`synchronizer_outages`: frozen from 0.55 of the run while the injector waits for a push to
corrupt, 0.3-9.6 s; killed at 0.65 until its next merge, 6.3-11.1 s on the quiet grid,
9.8-20.1 s on the shared one): no merges meanwhile, then every push made meanwhile found at
once. That moved decoupled's merged work little (quiet grid: max |error| 0.084 -> 0.082,
median 0.019 -> 0.021; earlier grid 0.062 -> 0.058, median 0.048 -> 0.034): an outage defers
merges but loses no pushed work.

The M = 4 grid with warm spares (results/decoupled_goodput_grid_spares.json) showed the
decoupled replay wrong by a step: its merged work at M = 4 was 0.041-0.080 under the runs
(0.660 / 0.639 / 0.611 against 0.701 / 0.694 / 0.692) while M = 8 and 16 fit within 0.03,
errors that cancelled. Followed rule by rule from the code (`_Fragments` has each), five
things were replayed otherwise than the code runs them:

1. *The hook's place in the step* (learner.py `_after_step` is an optimizer post hook;
   decoupled_goodput.py pads each step after ``opt.step()``): the replay pushed as a step
   ended and took a version one step later, so in step the learners lost two steps per push
   (6 of 8 merged); the code takes and pushes at the start of the step, a push is merged
   within the step's padding and taken in the next step's hook, one step lost (7 of 8). The
   runs' first merge is 1.08-1.13 s from the start at M = 4 (the push in step 2's hook at
   1.0 s), the replay's was at 1.98 s.
2. *The push's way to the synchronizer* (``push_s``, measured above): the upload, the
   synchronizer's 0.1 s poll and its fetch, longer with more learners on 2 cores.
3. *The active learners* (synchronizer.py `_active_learners`): every learner that is not
   done; a stopped or killed one stays active (it may still push) until ``dead_after_s`` (120 s,
   longer than the run; run_local writes no departure records), so with one stopped a merge
   waits the grace window, and with two stopped the quorum of all but one cannot form; the
   quorum counts every learner with an on-time push (fragment_merger.py `maybe_merge`). The
   replay counted only running learners.
4. *The grace window* (`maybe_merge`, merge_math.grace_seconds): decided once as the quorum is
   reached, from the synchronizer's EMAs, ``step_s`` of the step time each push reports (the
   learner's own EMA of the time between its hooks: long after a stop or a slow window,
   short just after a restart) and ``quorum_s`` of the rounds' first push to quorum; a new
   synchronizer process starts them afresh. The replay used tau x step_s less the current
   round's time since its first push, shrinking as it waited. ``sync_s`` (a merge's
   publication) is not measured and counts 0.
5. *A kill mid-upload* (the harness freezes the learner inside a push's write, chaos log
   "killed mid-upload"): that push is lost, and the learner restarts from its previous push
   (its progress document is written after each stored push; a push skipped because the
   fragment was just replaced writes none). The replay's restarts now take the step of the
   newest stored push: 38 of the grid's 42 restarts at the step the row's ``rejoins`` record,
   the 4 others one push off (a kill within a few tens of ms of the hook). A late push of a
   learner whose push on the same base was merged is dropped (`_select`), as in the code.

With them every decoupled run of the grid is within 0.013 (merged work) and 0.004 (learner
time); the M = 4 runs 0.696 / 0.687 / 0.683 against 0.701 / 0.694 / 0.692. The older grids
moved the same way: the quiet one's decoupled merged work max |error| 0.082 -> 0.026, the
shared one's 0.057 -> 0.031 (their sync runs are replayed as before). One at a time on the
spares grid: the hook alone put M = 4 within 0.046 but M = 8 0.047-0.083 over; the push's way
took M = 8 to 0.042-0.066 over; the active learners and the EMA grace window to 0.001-0.062
(the 0.062 the run with a kill mid-upload, M = 8 seed 0, whose lost push held a merge 1.3 s in
the grace window); the lost push to 0.001-0.016.
docs/benchmarks-notebook.md ("Decoupled DiLoCo at 4, 8 and 16 learners") has each run's figures.

Usage::

    python benchmarks/goodput_sim.py                 # the table + last-line JSON
    python benchmarks/goodput_sim.py --days 60 --seed 1
    python benchmarks/goodput_sim.py --check benchmarks/results/decoupled_goodput_grid_quiet.json

Last line: JSON with ``dp_goodput_2400k``, ``m8_goodput_2400k``, ``m16_goodput_2400k``, every
other cell, the paper's figures and the mean absolute difference per system; with ``--check``,
``sim_max_abs_error_paper`` and ``sim_max_abs_error_merged`` (the largest |predicted - measured|
over the runs), the costs used, the predicted means per mode and M (``simulated``) and each run.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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


# --------------------------------------------------------------------------- the protocol runs


def commit_grace_s(timeout_s: float, poll_interval_s: float = 0.05) -> float:
    """How long a sync replica that is ready to commit waits for the lowest valid rank (the
    designated committer) before committing itself: ObjectStoreAllReduce's
    ``min(timeout_s / 4, max(5, 50 * poll_interval_s))``."""
    return min(timeout_s / 4, max(5.0, 50 * poll_interval_s))


@dataclass(frozen=True)
class RunCosts:
    """The costs of one measured protocol run (benchmarks/decoupled_goodput.py --learners),
    each as measured there (`costs_from_runs`): ``recovery_s`` from a learner's kill to its
    next incarnation's first step (process start, imports, rejoin download), ``exchange_s``
    from a sync round's last arrival to its commit (poll, download, screen, write; hidden in the
    last step's padding when shorter than it), ``upload_s`` from a sync round's last step
    beginning to its contribution stored (compute, pseudo-gradient, encode, write: what a kill
    early in that step catches), ``apply_s`` from a decoupled merge to the learners taking the new
    fragment (their poll interval and the download), ``hook_s`` from a decoupled step's start
    to its optimizer hook (the step's real compute: where the learner takes versions and
    pushes), ``push_s`` from a decoupled step's start to the synchronizer holding the push made
    in its hook (the upload, the synchronizer's poll and fetch), ``grace_gamma`` /
    ``grace_tau`` the synchronizer's grace window (its defaults) and ``quorum`` its quorum
    (None: all but one); ``adopt_listed`` the sync rule for a listed contribution a replica
    cannot read."""

    recovery_s: float
    exchange_s: float = 0.0
    upload_s: float = 0.0
    apply_s: float = 0.1
    hook_s: float = 0.0
    push_s: float = 0.0
    grace_gamma: float = 0.8
    grace_tau: float = 2.0
    quorum: int | None = None
    # sync: a replica that cannot read a contribution the round's record lists adopts the
    # round's state as its committer publishes it (True, the code since h36-heal), or fails
    # the round and trains it again until the next commit heals it (False, rows measured before)
    adopt_listed: bool = True


class _Fragments:
    """Decoupled's synchronizer and the learners' fragment state, for `simulate_protocol_run`,
    rule by rule as the code runs them (diloco/decoupled/learner.py, fragment_merger.py,
    synchronizer.py):

    - the learners (`DecoupledLearner._after_step`, an optimizer post hook, so it runs once a
      step's inner compute is done, ``hook_s`` into the step, before its padding): every
      fragment counts the step, then takes every version published by then (`apply_ready`:
      ``steps_since_push`` back to 0, what it trained on the fragment since its push, this
      step's update included, is overwritten, alpha 0), then the fragment due at this step is
      pushed with ``steps_since_push`` (none if it just took a version: nothing trained since
      its base). A finishing learner takes what was published, then pushes what it trained;
    - a push reaches the synchronizer ``push_s`` after its step began (compute, the upload, the
      synchronizer's poll and fetch; measured, `costs_from_runs`), on time if it is based on
      the fragment's current version then, else late;
    - the quorum (`FragmentMerger.maybe_merge`): ``quorum`` (all learners but one) of the
      learners with an on-time push, out of the *active* learners, every learner that is not
      done: a stopped or killed one stays active (it may still push; the synchronizer drops a
      learner only at a departure record, which run_local never writes, or after
      ``dead_after_s``, 120 s, longer than a run);
    - the grace window, decided once as the quorum is reached: ``grace_gamma * max(0,
      grace_tau * step_s - quorum_s - sync_s)`` of the synchronizer's EMAs (weight 0.2):
      ``step_s`` of the ``step_seconds`` each push reports (the learner's own EMA of the time
      between its hooks: a learner back from a stop or slowed reports long steps, one just
      restarted short ones), ``quorum_s`` of each merged round's first on-time push to its
      quorum; ``sync_s``, a merge's publication, is not measured and counts 0. The merge comes
      when every active learner has an on-time push, or the grace window is over;
    - a merge takes every on-time push and carries the late ones, except a late push of a
      learner whose push on the same base was merged before (its work is in that one); the
      merged work is the ``steps_since_push`` of what it takes; the learners take the new
      version ``apply_s`` later."""

    def __init__(self, m: int, h: int, p: int, costs: RunCosts, step_s: float) -> None:
        self.m, self.h, self.p, self.costs, self.step_s = m, h, p, costs, step_s
        self.version = [0] * p
        self.base = [[0] * p for _ in range(m)]
        self.since = [[0] * p for _ in range(m)]
        # per fragment: the pushes the synchronizer holds, (learner, base, steps_since_push)
        self.pending: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]
        self.merged_bases: list[set[tuple[int, int]]] = [set() for _ in range(p)]
        self.first_push: list[float | None] = [None] * p
        self.quorum_at: list[float | None] = [None] * p
        self.grace_s = [0.0] * p  # each fragment's grace window, decided at its quorum
        # the synchronizer's EMAs of the learners' step time and of first push to quorum
        self.step_ema: float | None = None
        self.quorum_ema: float | None = None
        # each learner's own EMA of the time between its hooks (what its pushes report)
        self.learner_step_s: list[float | None] = [None] * m
        self.last_hook: list[float | None] = [0.0] * m
        # pushes on their way: (when the synchronizer has it, learner, fragment, base, steps,
        # the learner's step time)
        self.inflight: list[tuple[float, int, int, int, int, float]] = []
        # per fragment: (when learners can take it, version) of every merged version
        self.published: list[list[tuple[float, int]]] = [[] for _ in range(p)]
        self.useful = 0.0  # steps merged, summed over fragments
        # (down, merging again, a new process) of the synchronizer
        self.outages: list[tuple[float, float, bool]] = []
        self.down = False
        self.fresh = False  # the synchronizer now down comes back as a new process
        self.merge_times: list[float] = []  # when each merge was decided

    def on_time(self, f: int) -> set[int]:
        """The learners with a push of fragment f based on its current version."""
        return {r for r, base, _ in self.pending[f] if base == self.version[f]}

    def stepped(self, r: int, k: int, t: float, lost: bool = False) -> bool:
        """Learner r's optimizer hook at ``t`` in its step k (1-based count): train every
        fragment, take every version published by then, push the one due at this step
        (fragment f at local step (f + 1) * h / p mod h; ``lost``: a kill mid-upload catches
        it). True if a push was stored (the learner's progress document: where it restarts)."""
        per = max(1, self.h // self.p)
        last = self.last_hook[r]
        if last is not None:
            e, gap = self.learner_step_s[r], t - last
            self.learner_step_s[r] = gap if e is None else _ema(e, gap)
        self.last_hook[r] = t
        pushed = False
        for f in range(self.p):
            self.since[r][f] += 1
            self.take(r, f, t)
            if k % self.h == ((f + 1) * per) % self.h:
                pushed = self.push(r, f, t, lost)
        return pushed

    def take(self, r: int, f: int, t: float) -> None:
        """Learner r takes the newest version of fragment f published by ``t``: what it trained
        on the fragment since its push is overwritten (alpha 0)."""
        newest = max((v for when, v in self.published[f] if when <= t), default=0)
        if self.base[r][f] < newest:
            self.base[r][f] = newest
            self.since[r][f] = 0

    def push(self, r: int, f: int, t: float, lost: bool = False) -> bool:
        steps, self.since[r][f] = self.since[r][f], 0
        if steps == 0 or lost:  # nothing trained since its base: no push
            return False
        arrives = t + max(0.0, self.costs.push_s - self.costs.hook_s)
        step_s = self.learner_step_s[r] or 0.0
        self.inflight.append((arrives, r, f, self.base[r][f], steps, step_s))
        return True

    def arrive(self, t: float) -> None:
        """The synchronizer discovers the pushes that reached it by ``t`` (`_discover`: each
        updates its step-time EMA)."""
        due = [x for x in self.inflight if x[0] <= t]
        self.inflight = [x for x in self.inflight if x[0] > t]
        for at, r, f, base, steps, step_s in due:
            self.pending[f].append((r, base, steps))
            if step_s > 0:
                self.step_ema = step_s if self.step_ema is None else _ema(self.step_ema, step_s)
            if base == self.version[f] and self.first_push[f] is None:
                self.first_push[f] = at

    def restarted(self, r: int, t: float) -> None:
        """A learner's next incarnation: its unpushed work is gone, it takes the newest versions;
        its step time restarts from its first hook (it entered at ``t``)."""
        self.since[r] = [0] * self.p
        self.base[r] = list(self.version)
        self.learner_step_s[r], self.last_hook[r] = None, t

    def finished(self, r: int, t: float) -> None:
        """Learner r's last step ended (`finish`): it takes what was published meanwhile
        (apply_ready), then pushes every fragment it trained since (its final pushes)."""
        for f in range(self.p):
            self.take(r, f, t)
            self.push(r, f, t)

    def tick(self, t: float, active: set[int]) -> None:
        """Merge every fragment whose quorum and grace window are complete at ``t``
        (``active``: the learners not done). While the synchronizer is down (``outages``)
        nothing merges; the pushes stay in the store and, as it comes back, it reloads them all
        at once (`_recover`: the inbox rebuilt, each push's arrival the time it is
        discovered), so a fragment's quorum and grace window start again from then."""
        self.arrive(t)
        now_down = [o for o in self.outages if o[0] <= t < o[1]]
        if now_down and active:
            self.down = True
            self.fresh = any(o[2] for o in now_down)
            return
        if self.down:
            self.down = False
            if self.fresh:  # a restarted synchronizer's timings start afresh (Timings())
                self.step_ema = self.quorum_ema = None
            for f in range(self.p):
                self.first_push[f] = t if self.on_time(f) else None
                self.quorum_at[f] = None
        q = self.costs.quorum if self.costs.quorum is not None else self.m - 1
        for f in range(self.p):
            if self.pending[f] and not active:  # everyone finished: the final merges
                self.merge(f, t)
                continue
            got = self.on_time(f)
            if len(got) < max(1, min(q, len(active))):
                continue
            quorum_at = self.quorum_at[f]
            if quorum_at is None:
                quorum_at = self.quorum_at[f] = t
                self.grace_s[f] = self.costs.grace_gamma * max(
                    0.0, self.costs.grace_tau * (self.step_ema or 0.0) - (self.quorum_ema or 0.0)
                )
            if active <= got or t >= quorum_at + self.grace_s[f]:
                self.merge(f, t)

    def merge(self, f: int, t: float) -> None:
        quorum_at, first = self.quorum_at[f], self.first_push[f]
        if quorum_at is not None and first is not None:
            gap = quorum_at - first
            self.quorum_ema = gap if self.quorum_ema is None else _ema(self.quorum_ema, gap)
        taken = [
            (r, base, steps)
            for r, base, steps in self.pending[f]
            if base == self.version[f] or (r, base) not in self.merged_bases[f]
        ]
        self.useful += sum(steps for _, _, steps in taken)
        self.merged_bases[f] |= {(r, base) for r, base, _ in taken}
        self.pending[f] = []
        self.first_push[f] = self.quorum_at[f] = None
        self.version[f] += 1
        self.published[f].append((t + self.costs.apply_s, self.version[f]))
        self.merge_times.append(t)


def _ema(old: float, sample: float, weight: float = 0.2) -> float:
    """The synchronizer's and the learners' EMAs (merge_math.ema; the learner's step time
    weighs a new sample 0.2 too)."""
    return (1.0 - weight) * old + weight * sample


@dataclass
class _Learner:
    k: int = 0  # the step it is at
    local: int = 0  # sync: steps since its last round boundary
    progress: float = 0.0  # seconds of the current step done
    state: str = "run"  # run | wait | down | done
    back_at: float = 0.0  # down: when the next incarnation takes its first step
    rnd: int = 0  # sync: the rounds it applied (outer.round)
    entered: bool = False  # sync: its exchange of this round began (start_quorum)
    resolved: bool = False  # sync: ... and is over (applied, failed or healed)
    call: int | None = None  # sync: the round whose barrier it waits at
    heal_to: int | None = None  # sync: healing, it waits for this round's state
    runs: list[tuple[int, list[int]]] = field(default_factory=lambda: [(0, [])])
    end: float = 0.0
    hooked: bool = False  # decoupled: the current step's optimizer hook ran
    pushed: int = 0  # decoupled: the step count of its newest stored push (its progress)

    def crashed(self, t: float, kills: list[tuple[float, float]]) -> bool:
        """Take a kill due at ``t`` (``kills``: (when, recovery) in order): the learner is down
        until its next incarnation ``recovery`` later. True while it is down."""
        if kills and kills[0][0] <= t:
            _, recovery = kills.pop(0)
            if self.state != "down":
                self.state, self.back_at, self.progress = "down", t + recovery, 0.0
                self.call = self.heal_to = None
        return self.state == "down" and t < self.back_at

    def advance(self, seconds: float, step_s: float) -> bool:
        """Run ``seconds`` of its simulated accelerator; True when that finished a step."""
        self.progress += seconds
        if self.progress + 1e-9 < step_s:
            return False
        self.progress -= step_s
        self.runs[-1][1].append(self.k)
        self.k, self.local = self.k + 1, self.local + 1
        return True

    def kept(self, steps: int) -> int:
        """Steps of each incarnation below where the next one started (the kept steps)."""
        total = 0
        for i, (_, done) in enumerate(self.runs):
            nxt = self.runs[i + 1][0] if i + 1 < len(self.runs) else None
            total += sum(1 for t in done if nxt is None or t < nxt)
        return min(total, steps)


def _rate(t: float, windows: list[tuple[float, float, float]]) -> float:
    """The simulated accelerator's speed at ``t``: 0 while stopped, 1/factor while slowed."""
    rate = 1.0
    for a, b, r in windows:
        if a <= t < b:
            rate = min(rate, r)
    return rate


class _SyncBarrier:
    """One sync round's exchange as the replicas run it (ObjectStoreAllReduce), for
    `simulate_protocol_run`. A replica in the round's call polls the store every tick it runs:
    it reads each contribution stored so far, refuses one corrupted by then (one it read before
    stays valid in its memory) and holds its own from memory. It is ready once every slot is
    judged or its own ``timeout_s`` since its upload is over; then the lowest rank it holds
    valid commits (itself: after reading its own contribution back, and a corrupted copy it
    leaves out, so it is no longer the lowest), any other ``grace`` after it became ready
    (ties: the lowest rank); the record lists what the committer holds valid. A replica applies
    the record if it holds, or can still read, every contribution listed; otherwise its round
    fails (CorruptContributionError), as does a call whose timeout passed with too few valid."""

    def __init__(self, m: int, min_replicas: int, timeout_s: float, grace: float) -> None:
        self.m, self.min_replicas, self.timeout_s, self.grace = m, min_replicas, timeout_s, grace
        self.arrivals: dict[int, float] = {}  # rank -> when its contribution was stored
        self.corrupted: dict[int, float] = {}  # rank -> when its stored contribution was corrupted
        self.t_in: dict[int, float] = {}  # rank -> when its current call's upload was in
        self.held: dict[int, set[int]] = {}  # rank -> contributions it read and verified
        self.refused: dict[int, set[int]] = {}  # rank -> contributions it read corrupted
        self.ready: dict[int, float] = {}  # rank -> when it became ready to commit
        self.read_back: set[int] = set()  # ranks that read their own contribution back
        self.dropped: set[int] = set()  # ... and found it corrupted
        self.commit: tuple[float, list[int]] | None = None  # (when decided, the ranks listed)
        self.committer: int | None = None  # the rank that wrote the record

    def enter(self, r: int, t: float) -> None:
        """Rank r's call: its upload (a retried call finds its first one), then the polls."""
        self.arrivals.setdefault(r, t)
        self.t_in[r] = t
        self.held[r], self.refused[r] = set(), set()
        self.ready.pop(r, None)
        self.read_back.discard(r)
        self.dropped.discard(r)

    def _bad(self, s: int, t: float) -> bool:
        return s in self.corrupted and self.corrupted[s] <= t

    def valid(self, r: int) -> set[int]:
        return self.held[r] | ({r} if r not in self.dropped else set())

    def poll(self, r: int, t: float) -> str | None:
        """Rank r polls at ``t``: "commit" if it writes the record (`commit`), "failed" if its
        call can no longer commit (too few valid, every slot judged or its timeout over)."""
        for s, at in self.arrivals.items():
            if s != r and at <= t and s not in self.held[r] and s not in self.refused[r]:
                (self.refused[r] if self._bad(s, t) else self.held[r]).add(s)
        valid = self.valid(r)
        settled = len(self.held[r]) + len(self.refused[r]) + 1 == self.m
        timed_out = t >= self.t_in[r] + self.timeout_s
        if not (settled or timed_out):
            return None
        if len(valid) < self.min_replicas:
            return "failed"
        self.ready.setdefault(r, t)
        if r != min(valid) and t < self.ready[r] + self.grace:
            return None
        if r not in self.read_back:  # the committer reads its own contribution back first
            self.read_back.add(r)
            if self._bad(r, t):
                self.dropped.add(r)
                return None
        self.commit = (t, sorted(valid))
        self.committer = r
        return "commit"

    def applies(self, r: int, t: float, *, in_call: bool) -> bool:
        """Whether rank r can apply the record at ``t``: every listed contribution it holds (in
        its call: what it polled, and its own unless its read-back failed) or reads now."""
        assert self.commit is not None
        held = self.valid(r) if in_call else set()
        return not any(self._bad(s, t) for s in self.commit[1] if s not in held)


def _simulate_sync(
    m: int,
    steps: int,
    h: int,
    step_s: float,
    windows: dict[int, list[tuple[float, float, float]]],
    kills: dict[int, list[tuple[float, float]]],
    corrupts: list[tuple[float, int]],
    costs: RunCosts,
    timeout_s: float,
    min_replicas: int,
    dt: float,
    trace: dict[str, list[Any]] | None,
) -> tuple[list[_Learner], int]:
    """Sync DiLoCo's learners (see `simulate_protocol_run`): (the learners, the h-step
    contributions listed in commit records)."""
    ls = [_Learner() for _ in range(m)]
    grace = commit_grace_s(timeout_s)
    rounds: dict[int, _SyncBarrier] = {}
    published = {0: 0.0}  # round -> when its outer state was published (what a restart loads)
    listed = 0

    def newest_commit(t: float) -> int:
        seen = [k for k, b in rounds.items() if b.commit and b.commit[0] + costs.exchange_s <= t]
        return max(seen, default=0)

    def newest_state(t: float) -> int:
        return max(k for k, at in published.items() if at <= t)

    def finish_round(x: _Learner, t: float) -> None:
        # the learner goes on from its round (outer.round * h), or it is done
        x.k, x.local, x.state, x.entered, x.resolved = x.rnd * h, 0, "run", False, False
        if x.k >= steps:
            x.state, x.end = "done", t

    def resolve(r: int, x: _Learner, rnd: int | None, t: float) -> None:
        # its exchange is over: the round applied (rnd) or failed (None: trained again)
        x.call, x.heal_to, x.resolved = None, None, True
        if rnd is not None:
            b = rounds.get(rnd)
            if rnd not in published and b is not None and b.commit and r == publisher(b):
                published[rnd] = t  # the round's publisher writes its state as it applies it
            x.rnd = rnd
        if x.state == "wait":
            finish_round(x, t)

    def publisher(b: _SyncBarrier) -> int:
        assert b.commit is not None
        if costs.adopt_listed and b.committer is not None:
            return b.committer  # it holds every contribution it listed
        return min(b.commit[1])  # before: the lowest listed rank

    def unreadable(r: int, x: _Learner, rnd: int, t: float) -> None:
        # a contribution the record lists cannot be read here: adopt the round's published
        # state (as soon as its publisher wrote it), or fail the round (trained again)
        if not costs.adopt_listed:
            resolve(r, x, None, t)
            return
        x.call, x.heal_to = None, rnd
        if newest_state(t) >= rnd:
            resolve(r, x, newest_state(t), t)

    t = 0.0
    while any(x.state != "done" for x in ls) and t < 50 * steps * step_s:
        while corrupts and corrupts[0][0] <= t:
            # the injector corrupts the rank's newest stored contribution
            _, r = corrupts.pop(0)
            mine = [k for k, b in rounds.items() if r in b.arrivals]
            if mine:
                rounds[max(mine)].corrupted[r] = t
        for r, x in enumerate(ls):
            if x.state == "done" or x.crashed(t, kills[r]):
                continue
            if x.state == "down":
                # the next incarnation loads the newest published state
                x.rnd = newest_state(t)
                x.k, x.local, x.state, x.entered, x.resolved = x.rnd * h, 0, "run", False, False
                x.runs.append((x.k, []))
            if _rate(t, windows[r]) == 0:
                continue
            if x.heal_to is not None and newest_state(t) >= x.heal_to:
                resolve(r, x, newest_state(t), t)
            if x.state != "run":
                continue
            if x.local == h - 1 and not x.entered and x.progress + 1e-9 >= costs.upload_s:
                # the round's exchange runs in its last step's optimizer step: start_quorum
                # (heal if it missed a committed round), then the upload (``upload_s`` after
                # the step began) and the wait; the step's padding runs meanwhile
                x.entered = True
                published.setdefault(x.rnd, t)  # _ensure_published
                latest = newest_commit(t)
                if latest > x.rnd + 1:  # missed a round: load the newest state, sit this out
                    x.heal_to = latest
                    if newest_state(t) >= latest:
                        resolve(r, x, newest_state(t), t)
                elif latest == x.rnd + 1:  # its round is decided: read the record
                    if rounds[latest].applies(r, t, in_call=False):
                        resolve(r, x, latest, t)
                    else:
                        unreadable(r, x, latest, t)
                else:
                    x.call = x.rnd + 1
                    b = rounds.setdefault(x.call, _SyncBarrier(m, min_replicas, timeout_s, grace))
                    b.enter(r, t)
            if not x.advance(dt * _rate(t, windows[r]), step_s):
                continue
            if x.local == h:
                if x.resolved:
                    finish_round(x, t)
                else:
                    x.state = "wait"
        for k, b in sorted(rounds.items()):
            for r in sorted(b.t_in):
                x = ls[r]
                if x.call != k or x.state not in ("run", "wait") or _rate(t, windows[r]) == 0:
                    continue
                if b.commit is None:
                    out = b.poll(r, t)
                    if out == "failed":
                        resolve(r, x, None, t)
                        continue
                    if out == "commit" and b.commit is not None:
                        listed += len(b.commit[1])
                        if trace is not None:
                            trace.setdefault("rounds", []).append(
                                {
                                    "round": k,
                                    "t": b.commit[0] + costs.exchange_s,
                                    "included": b.commit[1],
                                    "arrivals": dict(b.arrivals),
                                }
                            )
                if b.commit is not None and t >= b.commit[0] + costs.exchange_s:
                    if b.applies(r, t, in_call=True):
                        resolve(r, x, k, t)
                    else:
                        unreadable(r, x, k, t)
        t += dt
    return ls, listed


def simulate_protocol_run(
    mode: str,
    m: int,
    steps: int,
    h: int,
    p: int,
    step_s: float,
    faults: list[dict[str, object]],
    costs: RunCosts,
    *,
    timeout_s: float = 0.0,
    min_replicas: int = 2,
    dt: float = 0.02,
    trace: dict[str, list[Any]] | None = None,
) -> dict[str, float]:
    """Replay one measured run's faults (``faults``: ``{"kind": kill|stop|slow, "target": r,
    "t": s, "until": s, "factor": f}``, seconds from the start) on ``m`` simulated learners of
    ``steps`` steps of ``step_s`` each, in ``mode``; return the paper's goodput (the steps each
    learner kept, over each learner's time to its own end) and the merged-work goodput, as
    benchmarks/decoupled_goodput.py counts them.

    decoupled: learners never wait; each step's optimizer hook (``hook_s`` into the step)
    takes the versions published by then and pushes the fragment due (every h / p steps); a
    kill loses the steps since the learner's newest stored push (a kill that lands mid-upload,
    ``"lost_push"``, loses that push too) and costs ``recovery_s``; the synchronizer
    (`_Fragments`, whose docstring has each rule and where it comes from) holds a push
    ``push_s`` after its step began and merges a fragment once a quorum of the active learners
    (those not done) pushed it on its current version, at once if all did, else after the
    grace window of its EMAs; the work a learner did on the fragment between its push and
    taking the merged version (``apply_s`` after the merge, in its next hook) is overwritten
    (alpha 0); while the synchronizer is down (a ``{"kind": "synchronizer", "t": s, "until":
    s}`` fault; ``"restarted"``: it comes back as a new process, its EMAs afresh) nothing
    merges, and as it comes back it finds every push made meanwhile. sync: every h steps a
    barrier (`_SyncBarrier`): in the h-th step, after start_quorum (a learner that missed a
    committed round loads the newest published state and goes on from there), its
    contribution is stored ``upload_s`` after the step began and it waits (the step's padding
    runs meanwhile) until a commit record is written, by the lowest valid rank once every slot
    is judged or its own ``timeout_s`` is over, else by another `commit_grace_s` after it was
    ready, ``exchange_s`` later; it applies the record, or, when the record lists a corrupted
    contribution it does not hold, adopts the round's state as its committer publishes it
    (``costs.adopt_listed``; before: fails the round and trains it again); a learner reaching
    a round already committed reads the record; a killed one restarts ``recovery_s`` later
    from the newest published state (the round's committer publishes it as it applies the
    round; before: the lowest listed rank); every learner ends at the run's last round."""
    windows: dict[int, list[tuple[float, float, float]]] = {r: [] for r in range(m)}
    kills: dict[int, list[tuple[float, float]]] = {r: [] for r in range(m)}
    lost_pushes: dict[int, list[float]] = {r: [] for r in range(m)}
    corrupts: list[tuple[float, int]] = []  # sync: (when, rank) of a corrupted contribution
    # decoupled: the synchronizer down (from, until, restarted as a new process)
    outages: list[tuple[float, float, bool]] = []
    for f in faults:
        if f["kind"] == "synchronizer":
            outages.append((float(str(f["t"])), float(str(f["until"])), bool(f.get("restarted"))))
            continue
        r = int(str(f["target"]))
        if f["kind"] == "corrupt":
            corrupts.append((float(str(f["t"])), r))
        elif f["kind"] == "kill":
            kills[r].append((float(str(f["t"])), float(str(f.get("recovery_s", costs.recovery_s)))))
            if f.get("lost_push"):
                lost_pushes[r].append(float(str(f["t"])))
        else:
            rate = 0.0 if f["kind"] == "stop" else 1.0 / float(str(f["factor"]))
            windows[r].append((float(str(f["t"])), float(str(f["until"])), rate))
    for r in kills:
        kills[r].sort()
    corrupts.sort()
    # a learner's time counts from its own first step: a late start is a stop from 0
    offsets = {
        int(str(f["target"])): float(str(f["until"]))
        for f in faults
        if f["kind"] == "stop" and float(str(f["t"])) == 0.0
    }
    if mode == "sync":
        ls, listed = _simulate_sync(
            m, steps, h, step_s, windows, kills, corrupts, costs, timeout_s, min_replicas, dt, trace
        )
        useful = float(listed * h)
    else:
        ls, useful = _simulate_decoupled(
            m, steps, h, p, step_s, windows, kills, costs, dt, sorted(outages), trace, lost_pushes
        )
    learner_s = sum(x.end - offsets.get(r, 0.0) for r, x in enumerate(ls))
    kept = sum(x.kept(steps) for x in ls)
    # (min: a step that ends between two ticks is counted at the later one)
    return {
        "paper_goodput": min(1.0, kept * step_s / learner_s) if learner_s else 0.0,
        "merged_goodput": min(1.0, useful * step_s / learner_s) if learner_s else 0.0,
    }


def _simulate_decoupled(
    m: int,
    steps: int,
    h: int,
    p: int,
    step_s: float,
    windows: dict[int, list[tuple[float, float, float]]],
    kills: dict[int, list[tuple[float, float]]],
    costs: RunCosts,
    dt: float,
    outages: list[tuple[float, float, bool]] | None = None,
    trace: dict[str, list[Any]] | None = None,
    lost_pushes: dict[int, list[float]] | None = None,
) -> tuple[list[_Learner], float]:
    """Decoupled DiLoCo's learners and synchronizer (see `simulate_protocol_run`): (the
    learners, the inner steps merged)."""
    ls = [_Learner() for _ in range(m)]
    frags = _Fragments(m, h, p, costs, step_s)
    frags.outages = list(outages or [])
    t = 0.0
    while any(x.state != "done" for x in ls) and t < 50 * steps * step_s:
        for r, x in enumerate(ls):
            if x.state == "done" or x.crashed(t, kills[r]):
                continue
            if x.state == "down":
                # the next incarnation goes on from its newest stored push (its progress
                # document: the push of the step it was killed in, if that step's hook ran
                # and pushed, unless the kill caught that push's upload)
                x.k = x.pushed
                x.hooked = False
                x.local, x.state = 0, "run"
                x.runs.append((x.k, []))
                frags.restarted(r, t)
                if trace is not None:
                    trace.setdefault("restarts", []).append((r, t, x.k))
            rate = _rate(t, windows[r])
            if x.advance(dt * rate, step_s):
                x.hooked = False
                if x.k >= steps:
                    x.state, x.end = "done", t
                    frags.finished(r, t)
                    continue
            if not x.hooked and rate > 0 and x.progress + 1e-9 >= costs.hook_s:
                # the step's optimizer hook, once its inner compute is done
                x.hooked = True
                lost = any(t <= a < t + step_s for a in (lost_pushes or {}).get(r, []))
                if frags.stepped(r, x.k + 1, t, lost):
                    x.pushed = x.k + 1
        frags.tick(t, {r for r, x in enumerate(ls) if x.state != "done"})
        t += dt
    while frags.inflight:  # the final pushes reach the synchronizer
        frags.tick(t, set())
        t += dt
    frags.tick(t, set())  # the final merges
    if trace is not None:
        trace["merges"] = list(frags.merge_times)
    return ls, frags.useful / p


# the harness's slow fault (faults/injector.py `_do_slow`): the learner runs SLOW_RUN_S of every
# SLOW_RUN_S * factor; the simulated accelerator (decoupled_goodput.py `busy`) counts a stop
# longer than BUSY_GAP_S as one BUSY_TICK_S of running time, so it runs a little faster
SLOW_RUN_S, BUSY_TICK_S, BUSY_GAP_S = 0.05, 0.005, 0.08


def harness_slow_factor(factor: float) -> float:
    """How much slower the simulated accelerator steps while the harness slows its process by
    ``factor``: 3x gives 0.15 s / (0.05 + 0.005) s = 2.73x (a stop under BUSY_GAP_S counts
    whole, so the harness's 1.25-2.5x leave its step time alone)."""
    stopped = SLOW_RUN_S * (factor - 1.0)
    counted = BUSY_TICK_S if stopped >= BUSY_GAP_S else stopped
    return SLOW_RUN_S * factor / (SLOW_RUN_S + counted)


def faults_of(row: dict[str, Any]) -> list[dict[str, object]]:
    """A measured run's learner faults as they happened (its ``chaos_log``): kills (each with
    its measured recovery, ``recoveries_s``; one the harness landed mid-upload loses that
    push, ``lost_push``), sync's corrupted contributions, the windows a learner was stopped or
    slowed, decoupled's synchronizer outages (``restarted`` when it was killed), and a
    learner's late first step (``start_offsets``), in seconds from the start."""
    factors = {i: float(e.get("factor", 3.0)) for i, e in enumerate(row["schedule"])}
    recoveries = row.get("recoveries_s") or []
    kills_seen = 0
    opened: dict[tuple[int, str], float] = {}
    out: list[dict[str, object]] = []
    for e in row["chaos_log"]:
        action, outcome = e.get("action"), str(e.get("outcome", ""))
        if action == "kill" and outcome.startswith("killed"):
            kill: dict[str, object] = {"kind": "kill", "target": e["target"], "t": float(e["t"])}
            if outcome == "killed mid-upload":
                kill["lost_push"] = True
            if kills_seen < len(recoveries):  # this kill's own recovery, as measured
                kill["recovery_s"] = float(recoveries[kills_seen])
            kills_seen += 1
            out.append(kill)
        elif action == "corrupt" and outcome == "corrupted":
            kind, _, who = str(e.get("target", "")).partition(":")
            if kind == "contribution" and who.isdigit():  # sync's; decoupled's push: not modelled
                out.append({"kind": "corrupt", "target": who, "t": float(e["t"])})
        elif action in ("stop", "slow") and outcome in ("stopped", "slowed"):
            opened[(int(e["event"]), action)] = float(e["t"])
        elif action in ("stop", "slow") and (int(e["event"]), action) in opened:
            out.append(
                {
                    "kind": action,
                    "target": e["target"],
                    "t": opened.pop((int(e["event"]), action)),
                    "until": float(e["t"]),
                    "factor": harness_slow_factor(factors.get(int(e["event"]), 3.0)),
                }
            )
    # the synchronizer's outages; one that began with its kill ends in a new process
    killed = [
        float(e["t"])
        for e in row["chaos_log"]
        if e.get("action") == "kill_synchronizer" and e.get("outcome") == "killed"
    ]
    for a, b in synchronizer_outages(row):
        down: dict[str, object] = {"kind": "synchronizer", "t": a, "until": b}
        if any(a <= k < b for k in killed):
            down["restarted"] = True
        out.append(down)
    # a learner whose first step came late (its process was slow to start on the loaded
    # machine) is, for the replay, stopped from the start until then
    for r, late in enumerate(row.get("start_offsets") or []):
        if late > 0.5:
            out.append({"kind": "stop", "target": str(r), "t": 0.0, "until": late, "factor": 1.0})
    return out


def synchronizer_outages(row: dict[str, Any]) -> list[tuple[float, float]]:
    """When a measured decoupled run's synchronizer was down, (from, until) in seconds from the
    start: the row's ``synchronizer_outages`` (decoupled_goodput.py records them from the
    harness's log and the synchronizer's own "resumed at versions" lines), else derived from
    what older rows hold: frozen while the injector waited for a push to corrupt (from the
    event's scheduled start to the corrupted push, ``chaos_log``; it continues at once, its
    reload takes a few polls), and killed (``kill_synchronizer`` in the chaos log) until its
    next merge record (``commit_times``: the restart, ``restart_after_s`` plus the process's
    start-up and the killed holder's lease TTL; a quorum the restarted synchronizer had to wait
    for also falls in it)."""
    if row.get("mode") != "decoupled":
        return []
    if row.get("synchronizer_outages") is not None:
        return [
            (float(o["t"]), float(o["until"]))
            for o in row["synchronizer_outages"]
            if o.get("until") is not None
        ]
    schedule = row.get("schedule") or []
    commits = sorted(float(x) for x in row.get("commit_times") or [])
    out: list[tuple[float, float]] = []
    for e in row.get("chaos_log") or []:
        t = float(e.get("t", 0.0))
        if e.get("action") == "corrupt" and str(e.get("target", "")).startswith("push"):
            i = int(e.get("event", -1))
            start = float(schedule[i]["at_s"]) if 0 <= i < len(schedule) else t
            out.append((min(start, t), t))
        elif e.get("action") == "kill_synchronizer" and e.get("outcome") == "killed":
            back = next((c for c in commits if c > t), None)
            if back is not None:
                out.append((t, back))
    return sorted(out)


def costs_from_runs(runs: list[dict[str, Any]]) -> dict[tuple[str, int], RunCosts]:
    """The simulator's costs per (mode, M), each the median of what the runs measured:
    recovery, a learner's kill to its next incarnation's first step (``recoveries_s``); sync's
    exchange, from a round's last arrival to its commit over the rounds every learner reached
    (``rounds``; rows without them: the quietest half of the commit intervals beyond H steps,
    ``commit_times``, which counts only an exchange longer than the last step's padding);
    sync's upload, from a learner's first step to its contribution to the first round stored,
    less h - 1 steps (``rounds`` and ``start_offsets``, learners that started on time; rows
    without them: 0). Decoupled's hook, the real compute of a step (``compute_share`` x
    ``step_s``); decoupled's push, from the start to the first merge record less h / p - 1
    steps and the latest learner's start (``commit_times``, ``start_offsets``, runs whose
    learners all started on time: the first merge waits for every learner's first push, so
    it measures the slowest of M pushes made at once). Decoupled's apply time (0.1 s: the
    learners poll every 0.05 s on file://, a fragment is a few kB), grace window and quorum
    are the run's settings."""
    out: dict[tuple[str, int], RunCosts] = {}
    for key in sorted({(r["mode"], r["learners"]) for r in runs}):
        rows = [r for r in runs if (r["mode"], r["learners"]) == key and r["alpha"] == 0.0]
        rec = [x for r in rows for x in r["recoveries_s"]]
        exchange: list[float] = []
        upload: list[float] = []
        hook: list[float] = []
        push: list[float] = []
        for r in rows:
            if key[0] == "decoupled":
                offsets = r.get("start_offsets") or []
                if r.get("compute_share") is not None:
                    hook.append(float(r["compute_share"]) * r["step_s"])
                if r.get("commit_times") and offsets and max(offsets) < 0.5:
                    per = max(1, r["h"] // r["p"])
                    first = min(r["commit_times"]) - (per - 1) * r["step_s"] - max(offsets)
                    push.append(first)
            if key[0] != "sync":
                continue
            offsets = r.get("start_offsets") or []
            if r.get("rounds") and offsets:  # the first round: each learner's first step to
                # its contribution stored (learners that started on time)
                first = r["rounds"][0]
                upload += [
                    at - offsets[int(rank)] - (r["h"] - 1) * r["step_s"]
                    for rank, at in first["arrivals"].items()
                    if offsets[int(rank)] < 0.5 and first["step"] == 1
                ]
            if r.get("rounds"):  # each round every learner reached: last arrival to commit
                exchange += [
                    x["t"] - max(x["arrivals"].values())
                    for x in r["rounds"]
                    if len(x["arrivals"]) == r["learners"]
                ]
            else:  # older rows: the quietest half of the commit intervals beyond H steps
                times = [0.0, *r["commit_times"]]
                gaps = sorted(b - a for a, b in zip(times, times[1:]))
                quiet = gaps[: max(1, len(gaps) // 2)]
                exchange += [g - r["h"] * r["step_s"] for g in quiet]
        out[key] = RunCosts(
            adopt_listed=all(r.get("sync_adopts_listed", False) for r in rows),
            recovery_s=statistics.median(rec) if rec else 0.0,
            exchange_s=max(0.0, statistics.median(exchange)) if exchange else 0.0,
            upload_s=max(0.0, statistics.median(upload)) if upload else 0.0,
            hook_s=statistics.median(hook) if hook else 0.0,
            push_s=max(0.0, statistics.median(push)) if push else 0.0,
        )
    return out


def synthetic_faults(
    m: int, run_s: float, round_s: float, rate: float, seed: int, recovery_s: float
) -> list[dict[str, object]]:
    """Faults as benchmarks/decoupled_goodput.py's grid draws them (kill, stop for 2 rounds,
    3x slower for 3 rounds; a kill mid-upload is a kill), each kind at ``rate`` per
    learner-hour, at seeded times in [0.1, 0.85] of the run (a Poisson count: fractional
    expectations at low rates)."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for kind in ("kill", "kill", "stop", "slow"):
        lam = rate * m * run_s / 3600.0
        n, t = 0, rng.expovariate(lam) if lam > 0 else float("inf")
        while t < 1.0:
            n, t = n + 1, t + rng.expovariate(lam)
        for _ in range(n):
            at = rng.uniform(0.1, 0.85) * run_s
            target = str(rng.randrange(m))
            if kind == "kill":
                out.append({"kind": "kill", "target": target, "t": at})
            else:
                length = (2 if kind == "stop" else 3) * round_s
                factor = 1.0 if kind == "stop" else harness_slow_factor(3.0)
                out.append(
                    {
                        "kind": kind,
                        "target": target,
                        "t": at,
                        "until": at + length,
                        "factor": factor,
                    }
                )
    return out


def what_if(costs: dict[tuple[str, int], RunCosts], seeds: int = 5) -> dict[str, Any]:
    """With the measured costs: both modes' goodputs at M = 4, 8, 16 against the fault rate
    (per learner-hour, each kind) and against one learner permanently slower (no faults)."""
    steps, h, p, step_s = 96, 8, 4, 1.0
    run_s, round_s = steps * step_s, h * step_s
    out: dict[str, Any] = {}
    for m in (4, 8, 16):
        for mode in ("sync", "decoupled"):
            c = costs.get((mode, m)) or RunCosts(recovery_s=15.0)
            timeout = 2 * round_s
            for rate in (0.0, 1.0, 2.5, 5.0, 9.375, 20.0):
                vals = [
                    simulate_protocol_run(
                        mode,
                        m,
                        steps,
                        h,
                        p,
                        step_s,
                        synthetic_faults(m, run_s, round_s, rate, seed, c.recovery_s),
                        c,
                        timeout_s=timeout,
                        dt=0.05,
                    )
                    for seed in range(seeds if rate else 1)
                ]
                for key in ("paper_goodput", "merged_goodput"):
                    out[f"{mode}_m{m}_rate{rate:g}_{key}"] = round(
                        statistics.fmean(v[key] for v in vals), 3
                    )
            for factor in (1.25, 1.5, 2.0):
                slow = [{"kind": "slow", "target": "0", "t": 0.0, "until": 1e9, "factor": factor}]
                v = simulate_protocol_run(
                    mode, m, steps, h, p, step_s, slow, c, timeout_s=timeout, dt=0.05
                )
                for key in ("paper_goodput", "merged_goodput"):
                    out[f"{mode}_m{m}_slow{factor:g}_{key}"] = round(v[key], 3)
    return out


def check(path: str, what_ifs: bool = False) -> dict[str, Any]:
    """Each run of a decoupled_goodput.py grid result replayed by `simulate_protocol_run` with
    its own faults and the measured costs; prints measured against predicted goodputs."""
    text = Path(path).read_text()
    if path.endswith(".jsonl"):  # the rows the grid writes as each run finishes
        runs = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        runs = json.loads(text)["runs"]
    runs = [r for r in runs if r["alpha"] == 0.0]
    costs = costs_from_runs(runs)
    print(f"costs (measured, per mode and M): {costs}")
    print(f"{'run':<22}{'paper meas':>11}{'sim':>7}{'merged meas':>12}{'sim':>7}")
    errors: dict[str, list[float]] = {"paper": [], "merged": []}
    per_m: dict[str, list[float]] = {}
    per_run: list[dict[str, Any]] = []
    for r in runs:
        sim = simulate_protocol_run(
            r["mode"],
            r["learners"],
            r["steps"],
            r["h"],
            r["p"],
            r["step_s"],
            faults_of(r),
            costs[(r["mode"], r["learners"])],
            timeout_s=float(r["timeout_s"] or 0.0),
            min_replicas=r["min_replicas"],
        )
        errors["paper"].append(abs(sim["paper_goodput"] - r["paper_goodput"]))
        errors["merged"].append(abs(sim["merged_goodput"] - r["merged_goodput"]))
        for key in ("paper_goodput", "merged_goodput"):
            per_m.setdefault(f"{r['mode']}_m{r['learners']}_{key}", []).append(sim[key])
        per_run.append(
            {
                "name": r["name"],
                "paper_goodput": round(r["paper_goodput"], 4),
                "sim_paper_goodput": round(sim["paper_goodput"], 4),
                "merged_goodput": round(r["merged_goodput"], 4),
                "sim_merged_goodput": round(sim["merged_goodput"], 4),
            }
        )
        print(
            f"{r['name']:<22}{r['paper_goodput']:>11.3f}{sim['paper_goodput']:>7.3f}"
            f"{r['merged_goodput']:>12.3f}{sim['merged_goodput']:>7.3f}"
        )
    result: dict[str, Any] = {
        "sim_max_abs_error_paper": round(max(errors["paper"]), 4) if runs else None,
        "sim_mean_abs_error_paper": round(statistics.fmean(errors["paper"]), 4) if runs else None,
        "sim_max_abs_error_merged": round(max(errors["merged"]), 4) if runs else None,
        "sim_mean_abs_error_merged": round(statistics.fmean(errors["merged"]), 4) if runs else None,
        "runs": len(runs),
        "costs": {f"{k[0]}_m{k[1]}": asdict(c) for k, c in costs.items()},
    }
    # the means over seeds per mode and M, as the grid's keys are (the plot draws them)
    result["simulated"] = {k: round(statistics.fmean(v), 4) for k, v in per_m.items()}
    if what_ifs:
        result["what_if"] = what_if(costs)
    result["per_run"] = per_run
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description="DES of DP / elastic DP / Decoupled DiLoCo goodput")
    ap.add_argument("--days", type=float, default=30.0, help="simulated horizon per cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--check",
        default="",
        help="a decoupled_goodput.py --learners result (JSON): replay each run, print "
        "measured against predicted goodput",
    )
    ap.add_argument(
        "--what-if",
        action="store_true",
        help="with --check: both modes at other fault rates and speed spreads, measured costs",
    )
    a = ap.parse_args()
    if a.check:
        print(json.dumps(check(a.check, a.what_if)))
        return
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
