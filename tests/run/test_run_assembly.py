"""assembly/ builds a replica's and the driver's parts from the run config, with the values the
config gives them (what run/ then sequences): the outer loop a replica trains inside, the
synchronizer of a decoupled run, the lighthouse of a torchft run, the chaos services."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_replication.assembly.build import build_model, build_task
from composer_replication.assembly.outer import (
    build_lighthouse,
    build_outer_loop,
    build_synchronizer,
    outer_loop_mode,
)
from composer_replication.assembly.services import build_chaos, build_proxy
from composer_replication.config import load_config
from composer_replication.diloco.outer_loop import DiLoCoOuterLoop
from composer_replication.exchange.store import ObjectStore

TINY = ["train.max_steps=4", "diloco.sync_every_h=2", "task.n_eval=4", "task.shard=shared"]


def test_a_replicas_outer_loop_reports_the_outer_lr_of_its_run_config(tmp_path: Path) -> None:
    """The replica's outer loop once reported `outer.outer_lr == 0.7` whatever `[diloco]
    outer_lr` said: the value a replica reports is now the one its outer optimizer uses."""
    config = load_config(overrides=[*TINY, "diloco.outer_lr=0.3", "diloco.outer_momentum=0.8"])
    task = build_task(config)
    model, tokenizer = build_model(config)
    store = ObjectStore(str(tmp_path / "store"))
    loop = build_outer_loop(config, 0, store, model, tokenizer, task)
    try:
        outer = loop.outer
        assert isinstance(outer, DiLoCoOuterLoop)
        assert (outer.outer_lr, outer.outer_momentum, outer.nesterov) == (0.3, 0.8, True)
        assert (loop.start_round, loop.start_step) == (0, 0)
        # the exchange screens with the run's claim bounds (at most H inner steps per round)
        assert outer.manager.exchange.policy.max_inner_steps == 2  # type: ignore[attr-defined]
    finally:
        loop.close()


def test_the_services_a_run_needs_are_built_for_its_mode(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path / "store"))
    sync = load_config(overrides=TINY)
    with pytest.raises(ValueError, match="only decoupled runs have a synchronizer"):
        build_synchronizer(sync, store)
    assert build_lighthouse(sync) is None
    assert build_proxy(sync) is None  # no chaos event throttles the store
    assert build_chaos(sync, targets=None, store=store, proxy=None, synchronizer_pid=None) is None  # type: ignore[arg-type]
    decoupled = load_config(
        overrides=[*TINY, "diloco.mode=decoupled", "diloco.grace_gamma=0.5", "store.keep_rounds=7"]
    )
    synchronizer = build_synchronizer(decoupled, store)
    assert (synchronizer.config.grace_gamma, synchronizer.config.keep_rounds) == (0.5, 7)
    assert synchronizer.config.max_steps == 4
    assert outer_loop_mode(decoupled).worker_role == "learner"
    external = load_config(overrides=["diloco.manager=torchft", "diloco.lighthouse=http://h:1"])
    assert build_lighthouse(external) is None  # the user runs it where the replicas reach it
