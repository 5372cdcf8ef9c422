"""Global-update screening in unsigned runs (issue 22, item 4): a committed update whose norm
is an outlier against the run's recent rounds (the rule that screens contributions,
`robust.norm_outlier`) is not applied. The issue's case: a planted commit record that lists an
honest contribution scaled x1000 (the record is well formed, the contribution's checksum
matches: only the size of the update gives it away)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from composer_replication.exchange import ObjectStoreAllReduce, ObjectStoreManager
from composer_replication.exchange.protocol import (
    commit_key,
    decode_contribution,
    make_commit,
    parse_contrib_name,
    step_prefix,
)
from composer_replication.exchange.robust import norm_outlier
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.vocabulary import UpdateRefusedError

SECRET = b"s" * 32


def _manager(uri: str, rank: int) -> ObjectStoreManager:
    exchange = ObjectStoreAllReduce(
        uri, 2, rank, timeout_s=30.0, poll_interval_s=0.01, slot_secret=SECRET
    )
    return ObjectStoreManager(exchange)


def _round(m: ObjectStoreManager, value: float) -> tuple[torch.Tensor, bool]:
    t = torch.full((4,), value)
    m.start_quorum()
    m.allreduce(t).wait()
    return t, m.should_commit()


def _both(m0: ObjectStoreManager, m1: ObjectStoreManager, value: float) -> None:
    out: dict[int, bool] = {}
    ts = [
        threading.Thread(target=lambda r=r, m=m: out.setdefault(r, _round(m, value + r)[1]))
        for r, m in ((0, m0), (1, m1))
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert out == {0: True, 1: True}


def _forge_commit(uri: str, step: int) -> None:
    """As someone with bucket access: once rank 0's contribution of ``step`` is there, commit it
    alone, scaled x1000 (a record like the committer's, checksum and all)."""
    store = ObjectStore(uri)
    prefix = step_prefix(step) + "contrib/"
    deadline = time.monotonic() + 60
    while True:  # the event: rank 0's upload appears
        names = [n for n in store.list(prefix) if parse_contrib_name(n) == 0]
        if names:
            break
        assert time.monotonic() < deadline, "rank 0 never uploaded"
        time.sleep(0.01)
    raw = store.get(prefix + names[0])
    assert raw is not None
    c = decode_contribution(raw, step=step, rank=0, reference={"p000000": ([4], "float32")})
    record = make_commit(
        step=step, world_size=2, included=[c], weighting="equal", committed_by=0, excluded={}
    )
    record["scales"] = {"0": 1000.0}  # a "clip scale" of 1000: the honest update x1000
    assert store.put_if_absent(commit_key(step), json.dumps(record).encode())


def test_a_forged_commit_that_blows_up_the_update_is_not_applied(tmp_path: Path) -> None:
    uri = "file://" + str(tmp_path / "run")
    m0, m1 = _manager(uri, 0), _manager(uri, 1)
    for value in (1.0, 1.1, 0.9, 1.05):  # four honest rounds: the run's recent norms
        _both(m0, m1, value)
    assert m0.current_step() == 4
    forger = threading.Thread(target=_forge_commit, args=(uri, 5))
    forger.start()
    t = torch.full((4,), 1.0)
    m0.start_quorum()
    with pytest.raises(UpdateRefusedError, match="norm outlier") as err:
        m0.allreduce(t).wait()  # rank 1 has not come: only the forged record commits step 5
        m0.should_commit()
    forger.join(10)
    assert err.value.step == 5
    assert torch.equal(t, torch.full((4,), 1.0))  # not overwritten with the x1000 average
    record = m0.history[-1]
    assert record["round"] == 5 and not record["committed"]
    assert record["refused"] is not None and "step 5" in record["refused"]
    # rank 1, late, reads the same record and refuses it too
    t1 = torch.full((4,), 2.0)
    m1.start_quorum()
    with pytest.raises(UpdateRefusedError):
        m1.allreduce(t1).wait()
        m1.should_commit()
    assert torch.equal(t1, torch.full((4,), 2.0))


def test_the_rule_is_the_contribution_screen_s() -> None:
    """One rule for contributions and updates: above ratio x the median of at least 3."""
    assert norm_outlier(11.0, [1.0, 1.0], 10.0) is None  # too few to judge
    assert norm_outlier(9.0, [1.0, 1.0, 1.0], 10.0) is None
    why = norm_outlier(11.0, [1.0, 1.0, 1.0], 10.0, against="the last 3 rounds'")
    assert why == "norm outlier: L2 norm 11 > 10 x the last 3 rounds' median 1"
    assert norm_outlier(1e9, [1.0, 1.0, 1.0], 0.0) is None  # outlier_ratio = 0: off
