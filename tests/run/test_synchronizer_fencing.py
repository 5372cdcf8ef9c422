"""Fencing of a driver-run synchronizer after a driver crash (run/synchronizer_process.py with
``$COMPOSER_RUN_GENERATION``, exchange/fencing.py).

A real synchronizer process of launch 1 merges two learners' pushes and is then frozen
(SIGSTOP), as a process that outlives its crashed driver would be; the resumed driver bumps the
run generation to 2 and starts its own synchronizer, which takes the lease over and merges. When
the old one wakes up (SIGCONT) it must not write anything more: no merge record, state, head,
heartbeat or lease document of its own appears after the takeover, and it exits with code 3
(fenced) instead of waiting for the lease again."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from composer_replication.config import load_config, to_dict
from composer_replication.diloco.decoupled import DecoupledLearner, LearnerConfig
from composer_replication.exchange.fencing import bump_generation
from composer_replication.exchange.push_store import HEADS_KEY, DecoupledStore
from composer_replication.exchange.store import ObjectStore
from composer_replication.run.replica_env import ENV_GENERATION, ENV_STORAGE_OPTIONS, EXIT_FENCED
from composer_replication.run.synchronizer_process import SynchronizerProcess

pytestmark = [pytest.mark.slow, pytest.mark.long]

CONFIG = [
    "diloco.mode=decoupled",
    "diloco.sync_every_h=2",
    "train.max_steps=100000",
    "diloco.lease_ttl_s=2",
    "backend.n_replicas=2",
]


def _learn(store: ObjectStore, rank: int, stop: threading.Event) -> None:
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    learner = DecoupledLearner(
        store,
        learner=rank,
        n_learners=2,
        config=LearnerConfig(sync_every_h=2, poll_interval_s=0.05, heartbeat_every_s=0.3),
        model=model,
        inner_optimizer=opt,
    )
    learner.__enter__()
    g = torch.Generator().manual_seed(rank)
    try:
        while not stop.is_set():
            x = torch.randn(8, 4, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.02)
    finally:
        learner.close()


def _merges_by(docs: DecoupledStore) -> list[tuple[int, str, float]]:
    out = []
    for v in docs.versions(0, "merge"):
        rec = docs.read_merge(0, v)
        if rec is not None:
            out.append((v, str(rec["owner"]), float(rec["time"])))
    return out


def _until(what: str, cond, timeout_s: float = 120.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_an_outliving_synchronizer_of_a_crashed_driver_cannot_write_after_the_resume(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "store")
    store = ObjectStore(uri)
    store.put_json(
        "run_config.json", json.loads(json.dumps(to_dict(load_config(overrides=CONFIG))))
    )
    docs = DecoupledStore(store)
    env = {ENV_STORAGE_OPTIONS: "{}"}
    old = SynchronizerProcess(
        uri, {**env, ENV_GENERATION: str(bump_generation(store))}, tmp_path / "old.log"
    )
    new: SynchronizerProcess | None = None
    stop = threading.Event()
    learners = [threading.Thread(target=_learn, args=(store, r, stop)) for r in range(2)]
    old.start()
    for t in learners:
        t.start()
    try:
        _until("the first synchronizer's merges", lambda: len(_merges_by(docs)) >= 2)
        old_owner = _merges_by(docs)[0][1]
        assert old.pid is not None
        os.killpg(old.pid, signal.SIGSTOP)  # frozen: its driver "crashed"
        # the resumed driver: a new run generation, then its own synchronizer
        fenced_at = time.time()
        generation = bump_generation(store)
        new = SynchronizerProcess(
            uri, {**env, ENV_GENERATION: str(generation)}, tmp_path / "new.log"
        )
        new.start()
        _until(
            "the new synchronizer's merges",
            lambda: sum(o != old_owner for _, o, _ in _merges_by(docs)) >= 2,
        )
        merges_before = len(_merges_by(docs))
        os.killpg(old.pid, signal.SIGCONT)
        assert old.proc is not None
        code = old.proc.wait(timeout=60)
        log = (tmp_path / "old.log").read_text()
        assert code == EXIT_FENCED, log
        assert "fenced" in log
        _until("more merges by the new one", lambda: len(_merges_by(docs)) >= merges_before + 2)
        assert new.pid is not None  # the new one was not disturbed
    finally:
        stop.set()
        for t in learners:
            t.join(60)
        for p in (old, new):
            if p is not None and p.proc is not None and p.proc.poll() is None:
                if p.pid is not None:
                    os.killpg(p.pid, signal.SIGCONT)
                p.stop(grace_s=5)
    # nothing of the old synchronizer's after the resumed launch's generation was written
    late = [(v, t) for v, o, t in _merges_by(docs) if o == old_owner and t > fenced_at]
    assert not late, late
    assert all(o != old_owner for _, o, _ in _merges_by(docs)[-3:])
    heads = store.get_json(HEADS_KEY)
    assert heads["owner"] != old_owner
    member = "".join(c if c.isalnum() or c in "_.-" else "-" for c in old_owner)[:64]
    beat = store.get_json(f"health/synchronizer/{member}.json")
    assert beat is not None and beat["time"] < fenced_at  # its last heartbeat: before the freeze
