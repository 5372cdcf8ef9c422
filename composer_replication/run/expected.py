"""What the embedded default run (`composer-replication train`, no arguments) should show, as
measured: the figures of docs/benchmarks.md ("The embedded default") in one place.

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
    """The embedded default's measured figures (docs/benchmarks.md, "The embedded default")."""

    seeds: str  # the run.seed values measured, e.g. "0-2"
    machines: str  # the CPUs, as /proc/cpuinfo names them, with their cores and vector units
    accuracy_first: float  # held-out exact match before training (every seed)
    accuracy_last: tuple[float, float]  # at the end: lowest, highest over seeds and machines
    reward_first: tuple[float, float]  # mean reward, first 10% of steps
    reward_last: tuple[float, float]  # mean reward, last 10% of steps
    quiet_wall_s: float  # on idle cores (load < 1)
    loaded: tuple[WallTime, ...]  # under other jobs' load
    cpu_s_per_replica: tuple[float, float]  # CPU seconds of each replica process


def _r(lo_hi: tuple[float, float], digits: int = 3) -> str:
    lo, hi = lo_hi
    return f"{lo:.{digits}f}" if lo == hi else f"{lo:.{digits}f}-{hi:.{digits}f}"


# The figures (measured: docs/benchmarks.md, "The embedded default", and issue 25's run on a
# 2-core AMD EPYC). Change them only with a measurement recorded there.
DEMO = DemoExpectation(
    seeds="0-2",
    machines="two 2-core x86 machines (one an AMD EPYC with AVX2, no AVX-512)",
    accuracy_first=0.0,
    accuracy_last=(0.750, 0.918),
    reward_first=(0.143, 0.148),
    reward_last=(0.686, 0.893),
    quiet_wall_s=114.0,
    loaded=(WallTime("2-5", (225.0, 294.0)), WallTime("6-12", (301.0, 616.0))),
    cpu_s_per_replica=(108.0, 185.0),
)

_FREE = {"run", "store", "logging", "checkpoint"}  # sections that do not change the figures


def is_embedded_default(config: RunConfig) -> bool:
    """Whether `config` trains the embedded default (see the module docstring)."""
    mine, default = to_dict(config), to_dict(load_config())
    return all(mine[k] == default[k] for k in default if k not in _FREE)


def _wall(e: DemoExpectation) -> str:
    loaded = "; ".join(f"{_r(w.seconds, 0)} s at load {w.load}" for w in e.loaded)
    return f"{e.quiet_wall_s:.0f} s on 2 idle cores; {loaded}"


def expected_lines(config: RunConfig, e: DemoExpectation = DEMO) -> list[str]:
    """What `train` prints when it starts the embedded default ([] for any other run)."""
    if not is_embedded_default(config):
        return []
    try:
        load = f"load average {os.getloadavg()[0]:.1f} now"
    except OSError:  # not on every platform
        load = "load unknown"
    return [
        'What to expect (the embedded default, measured: docs/benchmarks.md "The embedded '
        'default"):',
        f"  held-out accuracy {e.accuracy_first:.3f} -> {_r(e.accuracy_last)} "
        f"({load_config().task.n_eval} prompts), mean reward {_r(e.reward_first, 2)} -> {_r(e.reward_last, 2)}, "
        f"over seeds {e.seeds} on {e.machines}; a seed repeats exactly on one machine, not "
        "across CPUs",
        f"  wall time {_wall(e)} (each replica is one CPU-bound process of "
        f"{_r(e.cpu_s_per_replica, 0)} CPU s); this machine: {os.cpu_count()} cores, {load}",
    ]


def readme_sentence(e: DemoExpectation = DEMO) -> str:
    """The README's sentences of measured figures (tests/test_readme.py finds them there)."""
    return (
        f"held-out exact-match accuracy on the {load_config().task.n_eval} held-out prompts "
        f"{e.accuracy_first:.3f} -> {_r(e.accuracy_last)} and mean reward (first vs last 10% of "
        f"steps) {_r(e.reward_first, 2)} -> {_r(e.reward_last, 2)}, over seeds {e.seeds} on "
        f"{e.machines}; a seed repeats bit for bit on one machine, not across CPUs. Wall time: "
        f"{_wall(e)}; each replica is a CPU-bound process of {_r(e.cpu_s_per_replica, 0)} CPU "
        "seconds."
    )
