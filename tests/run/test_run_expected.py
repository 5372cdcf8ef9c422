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
    assert "held-out accuracy 0.000 -> 0.750-0.918 (256 prompts)" in lines[1]
    assert "mean reward 0.14-0.15 -> 0.69-0.89, over seeds 0-2" in lines[1]
    assert (
        "wall time 114 s on 2 idle cores; 225-294 s at load 2-5; 301-616 s at load 6-12"
        in (lines[2])
    )
    assert "this machine: " in lines[2] and " cores, " in lines[2]
    # another seed, name or folder is still the default's setting; anything else is not
    assert is_embedded_default(load_config(overrides=["run.seed=2", "run.name=x"]))
    for override in ("train.max_steps=100", "backend.n_replicas=4", "model.tokenizer=bpe"):
        assert expected_lines(load_config(overrides=[override])) == [], override


def test_ranges_print_a_single_value_once() -> None:
    one = dataclasses.replace(DEMO, accuracy_last=(0.8, 0.8), loaded=(WallTime("3", (200, 200)),))
    lines = expected_lines(load_config(), one)
    assert "-> 0.800 (256 prompts)" in lines[1] and "200 s at load 3" in lines[2]
