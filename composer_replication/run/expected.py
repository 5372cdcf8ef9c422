"""What the embedded default run (`composer-replication train`, no arguments) should show, as
measured: the figures of docs/benchmarks-notebook.md ("The embedded default") in one place.

`train` prints `expected_lines` when it starts such a run, so a user compares their numbers
with ranges over seeds and machines (not one machine's figure), and their wall time with the
load it was measured at (and sees their own cores and load now). The README quotes
`readme_sentence()` (tests/test_readme.py checks that it does), so the two cannot disagree.
A run whose configuration differs from the default in anything but `[run]` (name, seed, folder),
`[store]`, `[logging]` and `[checkpoint]` gets no expectation: these figures are not its.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from composer_replication.config import RunConfig, load_config, to_dict

__all__ = ["DEMO", "DemoExpectation", "expected_lines", "is_embedded_default", "readme_sentence"]


@dataclass(frozen=True)
class WallTime:
    """Wall seconds from the driver's start to the end of training, at a load average."""

    load: str  # e.g. "2-5" (load average over the run, `uptime`)
    seconds: tuple[float, float]  # lowest, highest measured


@dataclass(frozen=True)
class DemoExpectation:
    """The embedded default's measured figures (docs/benchmarks-notebook.md, "The embedded default")."""

    seeds: str  # the run.seed values measured, e.g. "0-2"
    machines: str  # the CPUs, as /proc/cpuinfo names them, with their cores and vector units
    accuracy_first: float  # held-out exact match before training (every seed)
    accuracy_last: tuple[float, float]  # at the end: lowest, highest over seeds and machines
    accuracy_median: float | None  # at the end: the median over seeds (None: not stated)
    caveat: str  # what the range hides (e.g. a seed that does not learn), "" for none
    reward_first: tuple[float, float]  # mean reward, first 10% of steps
    reward_last: tuple[float, float]  # mean reward, last 10% of steps
    quiet_wall_s: float | None  # on idle cores (load < 1); None: not measured
    quiet_note: str  # how the quiet figure was taken, "" when with this very configuration
    loaded: tuple[WallTime, ...]  # under other jobs' load
    cpu_s_per_replica: (
        tuple[float, float] | None
    )  # CPU seconds of each replica (None: not measured)
    cpu_load: str  # the load average the CPU seconds were measured at


def _r(lo_hi: tuple[float, float], digits: int = 3) -> str:
    lo, hi = (f"{v:.{digits}f}" for v in lo_hi)
    return lo if lo == hi else f"{lo}-{hi}"


# The figures (measured: docs/benchmarks-notebook.md, "The demo reads its hint": the 9 runs of
# `benchmarks/demo_robustness.py`, seeds 0-2 under each ATen kernel set, one at a time on the
# otherwise idle 2-core Intel Xeon, commit 2edfceb, 2026-11-30). Change them only with a
# measurement recorded there.
DEMO = DemoExpectation(
    seeds="0-2",
    machines=(
        "a 2-core Intel Xeon under each of ATen's CPU kernel sets (default, AVX2, AVX-512: 9 runs)"
    ),
    accuracy_first=0.0,
    accuracy_last=(0.770, 0.977),
    accuracy_median=0.902,
    caveat="",
    reward_first=(0.174, 0.190),
    reward_last=(0.800, 0.922),
    quiet_wall_s=None,
    quiet_note=(
        "one run at a time with nothing else running, the load being the run's own 2 processes: "
        "190-218 s under AVX2, 190-208 s under AVX-512, 239-249 s without SIMD kernels"
    ),
    loaded=(WallTime("1-2", (190, 249)),),
    cpu_s_per_replica=None,
    cpu_load="",
)

_FREE = {"run", "store", "logging", "checkpoint"}  # sections that do not change the figures


def is_embedded_default(config: RunConfig) -> bool:
    """Whether `config` trains the embedded default (see the module docstring)."""
    mine, default = to_dict(config), to_dict(load_config())
    return all(mine[k] == default[k] for k in default if k not in _FREE)


def _wall(e: DemoExpectation) -> str:
    loaded = "; ".join(f"{_r(w.seconds, 0)} s at load {w.load}" for w in e.loaded)
    note = f" ({e.quiet_note})" if e.quiet_note else ""
    if e.quiet_wall_s is None:
        return f"{loaded}{note}"
    return f"{e.quiet_wall_s:.0f} s on 2 idle cores{note}; {loaded}"


def _cpu(e: DemoExpectation, what: str, unit: str, before: str, after: str) -> str:
    """The replicas' CPU seconds, where measured: `{before}each replica is {what} N {unit} at
    load L{after}`, else ""."""
    if e.cpu_s_per_replica is None:
        return ""
    return f"{before}each replica is {what} {_r(e.cpu_s_per_replica, 0)} {unit} at load {e.cpu_load}{after}"


def _accuracy(e: DemoExpectation) -> str:
    """``0.000 -> 0.105-0.945 (median 0.809 ...; caveat)``: the held-out figure with what it hides."""
    extra = [f"median {e.accuracy_median:.3f}"] if e.accuracy_median is not None else []
    extra += [e.caveat] if e.caveat else []
    tail = f" ({'; '.join(extra)})" if extra else ""
    return f"{e.accuracy_first:.3f} -> {_r(e.accuracy_last)}{tail}"


def expected_lines(config: RunConfig, e: DemoExpectation = DEMO) -> list[str]:
    """What `train` prints when it starts the embedded default ([] for any other run)."""
    if not is_embedded_default(config):
        return []
    try:
        load = f"load average {os.getloadavg()[0]:.1f} now"
    except OSError:  # not on every platform
        load = "load unknown"
    return [
        'What to expect (the embedded default, measured: docs/benchmarks-notebook.md "The teacher '
        'gate on a window"):',
        f"  held-out accuracy on {load_config().task.n_eval} prompts {_accuracy(e)}, mean reward {_r(e.reward_first, 2)} -> {_r(e.reward_last, 2)}, "
        f"over seeds {e.seeds} on {e.machines}; a seed repeats exactly on one machine, not "
        "across CPUs",
        f"  wall time {_wall(e)}{_cpu(e, 'one CPU-bound process of', 'CPU s', ' (', ')')}; "
        f"this machine: {os.cpu_count()} cores, {load}",
    ]


def readme_sentence(e: DemoExpectation = DEMO) -> str:
    """The README's sentences of measured figures (tests/test_readme.py finds them there)."""
    return (
        f"held-out exact-match accuracy on the {load_config().task.n_eval} held-out prompts "
        f"{_accuracy(e)} and mean reward (first vs last 10% of "
        f"steps) {_r(e.reward_first, 2)} -> {_r(e.reward_last, 2)}, over seeds {e.seeds} on "
        f"{e.machines}; a seed repeats bit for bit on one machine, not across CPUs. Wall time: "
        f"{_wall(e)}{_cpu(e, 'a CPU-bound process of', 'CPU seconds', '; ', '')}."
    )
