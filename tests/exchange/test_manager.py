"""ObjectStoreManager: the torchft Manager surface DiLoCo uses, over a real file:// exchange."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "diloco"))

from _diloco_worker import build_model, inner_step  # noqa: E402
from allreduce_handles import exchange

from composer_replication.diloco import make_diloco_outer_loop  # noqa: E402
from composer_replication.exchange import (  # noqa: E402
    MockManager,
    ObjectStoreAllReduce,
    ObjectStoreManager,
)
from composer_replication.exchange.protocol import StoreTimeoutError  # noqa: E402


def _store(tmp_path: Path, rank: int | None, world: int = 2, **kw: Any) -> ObjectStoreAllReduce:
    kw = {"timeout_s": 20.0, "poll_interval_s": 0.01, **kw}
    return exchange("file://" + str(tmp_path / "run"), world, rank, **kw)


def _in_threads(*fns: Any) -> list[Any]:
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out


def test_seed_constructor_form_and_validation(tmp_path: Path) -> None:
    assert MockManager is ObjectStoreManager
    m = MockManager(allreduce=_store(tmp_path, 0))
    assert m._use_async_quorum is False and m.current_step() == 0
    with pytest.raises(ValueError, match="rank="):
        ObjectStoreManager(_store(tmp_path, None))
    with pytest.raises(ValueError, match="checkpoint_every"):
        ObjectStoreManager(_store(tmp_path, 0), checkpoint_every=0)
    m.register_state_dict_fn("a", lambda s: None, lambda: {})
    with pytest.raises(ValueError, match="already registered"):
        m.register_state_dict_fn("a", lambda s: None, lambda: {})


def test_queued_tensors_are_averaged_in_one_exchange(tmp_path: Path) -> None:
    def replica(rank: int) -> tuple[ObjectStoreManager, list[torch.Tensor], bool]:
        m = ObjectStoreManager(_store(tmp_path, rank))
        ts = [torch.full((3,), float(rank + 1)), torch.full((2, 2), 10.0 * (rank + 1))]
        m.start_quorum()
        works = [m.allreduce(t) for t in ts]
        futs = [w.get_future() for w in works]
        for w in works:
            w.wait()
        assert all(f.done() for f in futs)
        return m, ts, m.should_commit()

    (m0, t0, c0), (m1, t1, c1) = _in_threads(lambda: replica(0), lambda: replica(1))
    assert c0 and c1 and m0.current_step() == m1.current_step() == 1
    assert torch.equal(t0[0], torch.full((3,), 1.5)) and torch.equal(
        t1[1], torch.full((2, 2), 15.0)
    )
    assert m0.history[-1]["included_ranks"] == [0, 1] and m0.history[-1]["store_step"] == 1
    assert m0.bytes_uploaded > 0 and m0.bytes_downloaded > 0


def test_world_size_one_is_a_passthrough(tmp_path: Path) -> None:
    m = ObjectStoreManager(_store(tmp_path, 0, world=1))
    t = torch.ones(4)
    m.start_quorum()
    m.allreduce(t).wait()
    assert m.should_commit() and m.current_step() == 1 and torch.equal(t, torch.ones(4))


def test_late_replica_is_left_out_but_receives_the_committed_average(tmp_path: Path) -> None:
    early = ObjectStoreManager(_store(tmp_path, 0, min_replicas=1, timeout_s=0.5))
    a = torch.full((2,), 4.0)
    early.start_quorum()
    early.allreduce(a).wait()
    assert early.should_commit() and early.history[-1]["included_ranks"] == [0]
    late = ObjectStoreManager(_store(tmp_path, 1, min_replicas=1, timeout_s=0.5))
    b = torch.full((2,), -100.0)
    late.start_quorum()
    late.allreduce(b).wait()
    assert late.should_commit(), "a late replica still applies the committed round"
    assert torch.equal(b, a) and late.history[-1]["excluded_ranks"] == [1]


def test_failed_round_does_not_advance_and_is_retried_at_the_same_step(tmp_path: Path) -> None:
    alone = ObjectStoreManager(_store(tmp_path, 0, timeout_s=0.4))
    alone.start_quorum()
    alone.allreduce(torch.full((2,), 1.0)).wait()
    assert alone.should_commit() is False and alone.current_step() == 0
    assert "StoreTimeoutError" in alone.history[-1]["error"]

    def retry() -> torch.Tensor:
        t = torch.full((2,), 999.0)  # the step-1 upload from the first try is what counts
        alone.start_quorum()
        alone.allreduce(t).wait()
        assert alone.should_commit()
        return t

    def other() -> torch.Tensor:
        m = ObjectStoreManager(_store(tmp_path, 1, timeout_s=5.0))
        t = torch.full((2,), 3.0)
        m.start_quorum()
        m.allreduce(t).wait()
        assert m.should_commit()
        return t

    r0, r1 = _in_threads(retry, other)
    assert torch.equal(r0, torch.full((2,), 2.0)) and torch.equal(r1, r0)
    assert alone.current_step() == 1 and alone.history[-1]["store_step"] == 1


def test_replica_that_missed_rounds_heals_from_the_published_state(tmp_path: Path) -> None:
    """Rank 1 stalls while rank 0 (min_replicas=1) commits 3 rounds; rank 1 then loads round 3's
    global weights and outer momentum from the store instead of exchanging, and matches."""
    h = 3
    m1 = build_model(101)
    opt1 = torch.optim.SGD(m1.parameters(), lr=0.05)
    store1 = _store(tmp_path, 1, min_replicas=1, timeout_s=0.3)
    outer1 = make_diloco_outer_loop(opt1, ObjectStoreManager(store1), h, model=m1)

    m0 = build_model(100)
    opt0 = torch.optim.SGD(m0.parameters(), lr=0.05)
    outer0 = make_diloco_outer_loop(
        opt0, ObjectStoreManager(_store(tmp_path, 0, min_replicas=1, timeout_s=0.3)), h, model=m0
    )
    with outer0:
        while outer0.round < 3:
            inner_step(m0, opt0, 0, outer0.round * h + outer0.local_step)
    assert [r["included_ranks"] for r in outer0.history] == [[0]] * 3

    with outer1:
        for t in range(h):  # one round's worth of (stale) work, then the sync point
            inner_step(m1, opt1, 1, t)
    assert outer1.round == 3 and outer1.history[-1]["healed"] is True
    g0, g1 = outer0.global_parameters(), outer1.global_parameters()
    assert all(torch.equal(g0[n], g1[n]) for n in g0)
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p, q), "the healed model must hold the new global weights"
    mom0 = outer0.outer_optimizers[0].state_dict()["state"]
    mom1 = outer1.outer_optimizers[0].state_dict()["state"]
    assert all(torch.equal(mom0[i]["momentum_buffer"], mom1[i]["momentum_buffer"]) for i in mom0)


def test_heal_without_a_newer_state_fails_loudly(tmp_path: Path) -> None:
    m = ObjectStoreManager(_store(tmp_path, 1), state_timeout_s=0.2)
    m.register_state_dict_fn("x", lambda s: None, lambda: {"w": torch.zeros(1)})
    m.initial_sync({"w": torch.zeros(1)})
    other = _store(tmp_path, 0, world=2)
    # Fake "the run is two rounds ahead" by committing steps as a lone replica would.
    for step in (1, 2):
        solo = _store(tmp_path, 0, min_replicas=1, timeout_s=0.2)
        solo.allreduce({"w": torch.ones(1)}, step=step)
    assert other.latest_committed_step() == 2
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="state_timeout_s"):
        m.start_quorum()
    assert time.monotonic() - t0 < 5


def test_global_states_are_published_through_a_store_that_refuses_writes_for_a_while(
    tmp_path: Path,
) -> None:
    """The round-0 state at start and a round's state after its commit: each write the store
    refuses (3 times for each) is retried, and the state lands."""
    from composer_replication.exchange.faulty_store import Fault, FaultyStore
    from composer_replication.exchange.outer_state import fetch_outer_state
    from composer_replication.exchange.store import ObjectStore

    uri = "file://" + str(tmp_path / "run")
    first = Fault("put_if_absent", "states/*", "fail", times=3, error=PermissionError)
    later = Fault("put_if_absent", "states/*", "fail", after=1, times=3, error=PermissionError)
    store = FaultyStore(ObjectStore(uri), [first, later])
    m = ObjectStoreManager(exchange(store, 1, 0, timeout_s=20.0, poll_interval_s=0.01))
    held = {"w": torch.ones(3)}
    m.register_state_dict_fn("a", lambda s: held.update(s), lambda: dict(held))
    assert m.initial_sync({"w": torch.ones(3)}) == 0 and first.hits == 3
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    assert m.should_commit() and m.publish_if_due() and later.hits == 3
    assert fetch_outer_state(m.exchange).round == 1
