"""`retry_write`: a write the store refuses is retried with backoff, then given up loudly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from composer_replication.diloco.replica_state import load_replica_state, save_replica_state
from composer_replication.exchange.faulty_store import Fault, FaultyStore
from composer_replication.exchange.retry import retry_write
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.vocabulary import StoreTimeoutError


def test_a_refused_write_is_retried_until_it_goes_through() -> None:
    calls: list[float] = []
    between: list[int] = []

    def put(left: float) -> str:
        calls.append(left)
        if len(calls) < 4:
            raise PermissionError("Access Denied")
        return "written"

    assert retry_write(put, what="x", within_s=5, first_s=0.01, between=lambda: between.append(1))
    assert len(calls) == 4 and len(between) == 3
    assert all(0 < left <= 5 for left in calls) and calls == sorted(calls, reverse=True)


def test_past_its_limit_the_write_fails_loudly_naming_it() -> None:
    def put(_left: float) -> None:
        raise OSError(28, "No space left on device")

    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="writing thing kept failing.*No space left") as err:
        retry_write(put, what="writing thing", within_s=0.3, first_s=0.05)
    assert 0.1 < time.monotonic() - t0 < 2
    assert isinstance(err.value.__cause__, OSError)


def test_a_write_that_hung_past_its_own_limit_is_not_retried() -> None:
    calls = []

    def put(_left: float) -> None:
        calls.append(1)
        raise StoreTimeoutError("the upload did not finish")

    with pytest.raises(StoreTimeoutError, match="did not finish"):
        retry_write(put, what="x", within_s=5, first_s=0.01)
    assert calls == [1]


def test_a_resume_state_is_written_through_a_store_that_refuses_writes_for_a_while(
    tmp_path: Path,
) -> None:
    real = ObjectStore(str(tmp_path))
    refused = Fault("put", "resume/*", "fail", times=3, error=PermissionError)
    save_replica_state(
        FaultyStore(real, [refused]),
        rank=0,
        round=2,
        step=8,
        state={"w": torch.arange(3.0), "global_step": 8},
    )
    assert refused.hits == 3
    state = load_replica_state(real, rank=0, round=2)
    assert torch.equal(state["w"], torch.arange(3.0))
