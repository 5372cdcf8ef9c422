"""What `train` prints to expect when it starts the embedded default (run/expected.py)."""

from __future__ import annotations

import dataclasses

from composer_replication.config import load_config
from composer_replication.run.expected import (
    DEMO,
    WallTime,
    expected_lines,
    is_embedded_default,
)


def test_the_embedded_default_gets_its_measured_ranges() -> None:
    lines = expected_lines(load_config())
    assert lines[0].startswith("What to expect (the embedded default")
    assert "held-out accuracy on 256 prompts 0.000 -> 0.770-0.977 (median 0.902), " in lines[1]
    assert "mean reward 0.17-0.19 -> 0.80-0.92, over seeds 0-2" in lines[1]
    assert "under each of ATen's CPU kernel sets" in lines[1]
    assert (
        "wall time 190-249 s at load 1-2 (one run at a time with nothing else running" in lines[2]
    )
    assert "this machine: " in lines[2] and " cores, " in lines[2]
    # another seed, name or folder is still the default's setting; anything else is not
    assert is_embedded_default(load_config(overrides=["run.seed=2", "run.name=x"]))
    for override in ("train.max_steps=100", "backend.n_replicas=4", "model.tokenizer=char"):
        assert expected_lines(load_config(overrides=[override])) == [], override


def test_ranges_print_a_single_value_once() -> None:
    one = dataclasses.replace(
        DEMO,
        accuracy_last=(0.8, 0.8),
        accuracy_median=None,
        caveat="",
        loaded=(WallTime("3", (200, 200)),),
    )
    lines = expected_lines(load_config(), one)
    assert "256 prompts 0.000 -> 0.800, mean" in lines[1] and "200 s at load 3" in lines[2]


def test_idle_wall_time_and_cpu_seconds_are_printed_only_where_measured() -> None:
    measured = dataclasses.replace(
        DEMO,
        quiet_wall_s=236.0,
        quiet_note="median of seeds 0-2",
        cpu_s_per_replica=(108.0, 110.0),
        cpu_load="3-5",
    )
    line = expected_lines(load_config(), measured)[2]
    assert "wall time 236 s on 2 idle cores (median of seeds 0-2); " in line
    assert "(each replica is one CPU-bound process of 108-110 CPU s at load 3-5)" in line
    bare = expected_lines(load_config(), dataclasses.replace(measured, quiet_wall_s=None))[2]
    assert "idle" not in bare
    unmeasured = dataclasses.replace(measured, cpu_s_per_replica=None)
    assert "CPU-bound" not in expected_lines(load_config(), unmeasured)[2]
