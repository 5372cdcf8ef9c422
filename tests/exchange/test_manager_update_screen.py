"""What a replica checks before it applies a committed update.

1. The commit record follows the run's merge rule (issue 22's forgery, a planted record listing
   an honest contribution at weight or scale x1000, is refused in round 1 as in round 10: every
   replica recomputes the weights the run's weighting rule gives).
2. Unsigned runs: the update is not a norm outlier against the run's recent rounds (the rule that
   screens contributions, `contribution_screening.norm_outlier`): a tripwire for what follows the
   rule but is still forged, e.g. a contribution planted in a slot of a run without slot secrets.
   Its history lives beside the global states, so a relaunched replica judges from the run's 4th
   round, not its own."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from composer_replication.exchange import AllReduceConfig, ObjectStoreAllReduce, ObjectStoreManager
from composer_replication.exchange.contribution_screening import norm_outlier
from composer_replication.exchange.protocol import (
    Encoding,
    commit_key,
    contrib_key,
    decode_contribution,
    encode_contribution,
    make_commit,
    parse_contrib_name,
    step_prefix,
)
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.vocabulary import UpdateRefusedError

SECRET = b"s" * 32


def _manager(uri: str, rank: int, slot_secret: bytes | None = SECRET) -> ObjectStoreManager:
    """Rank ``rank``'s manager, its outer state (one tensor) registered and synced."""
    exchange = ObjectStoreAllReduce(
        uri,
        2,
        rank,
        config=AllReduceConfig(timeout_s=30.0, poll_interval_s=0.01),
        slot_secret=slot_secret,
    )
    m = ObjectStoreManager(exchange)
    w = torch.zeros(4)
    m.register_state_dict_fn("w", lambda s: w.copy_(s["w"]), lambda: {"w": w.clone()})
    m.initial_sync({"w": w})
    return m


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
    for m in (m0, m1):
        m.publish_if_due()


def _rank0_upload(store: ObjectStore, step: int) -> tuple[str, bytes]:
    """(key, bytes) of rank 0's upload of ``step``, once it appears (the forger's event)."""
    prefix = step_prefix(step) + "contrib/"
    deadline = time.monotonic() + 60
    while True:
        names = [n for n in store.list(prefix) if parse_contrib_name(n) == 0]
        if names:
            raw = store.get(prefix + names[0])
            assert raw is not None
            return prefix + names[0], bytes(raw)
        assert time.monotonic() < deadline, "rank 0 never uploaded"
        time.sleep(0.01)


FORGERIES = {
    "scale x1000": lambda r: r["scales"].update({"0": 1000.0}),
    "weight x1000": lambda r: r["weights"].update({"0": 1000.0}),
    "token weighting": lambda r: r.update(weighting="tokens"),
    "another merge": lambda r: r.update(aggregate="median"),
}


def _forge_commit(uri: str, step: int, forgery: str) -> None:
    """As someone with bucket access: once rank 0's contribution of ``step`` is there, commit it
    alone with a record like the committer's (checksum and all), edited by ``forgery``."""
    store = ObjectStore(uri)
    _, raw = _rank0_upload(store, step)
    c = decode_contribution(raw, step=step, rank=0, reference={"p000000": ([4], "float32")})
    record = make_commit(
        step=step, world_size=2, included=[c], weighting="equal", committed_by=0, excluded={}
    )
    FORGERIES[forgery](record)
    assert store.put_if_absent(commit_key(step), json.dumps(record).encode())


def _refused(m: ObjectStoreManager, value: float, match: str) -> UpdateRefusedError:
    """Run one round on ``m`` alone: it must refuse the round's update, leaving its tensor."""
    t = torch.full((4,), value)
    m.start_quorum()
    with pytest.raises(UpdateRefusedError, match=match) as err:
        m.allreduce(t).wait()
        m.should_commit()
    assert torch.equal(t, torch.full((4,), value))  # not overwritten with the forged average
    return err.value


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
@pytest.mark.parametrize("target", [1, 5])
def test_a_commit_off_the_runs_rule_is_refused_from_round_1(
    tmp_path: Path, forgery: str, target: int
) -> None:
    uri = "file://" + str(tmp_path / "run")
    m0, m1 = _manager(uri, 0), _manager(uri, 1)
    for value in (1.0, 1.1, 0.9, 1.05)[: target - 1]:  # the honest rounds before it
        _both(m0, m1, value)
    forger = threading.Thread(target=_forge_commit, args=(uri, target, forgery))
    forger.start()
    err = _refused(m0, 1.0, "commit record .* is refused")  # rank 1 has not come
    forger.join(10)
    assert err.step == target
    record = m0.history[-1]
    assert record["round"] == target and not record["committed"]
    assert record["refused"] is not None and f"step {target}" in record["refused"]
    _refused(m1, 2.0, "commit record .* is refused")  # rank 1, late, reads the same record


def _plant_in_slot(uri: str, step: int) -> None:
    """A run without slot secrets (plain keys): before rank 1 arrives, plant in its slot a
    contribution x1000 of rank 0's and commit both at equal weights: a record that follows the
    run's rule, so only the size of the update gives it away."""
    store = ObjectStore(uri)
    _, raw = _rank0_upload(store, step)
    ref = {"p000000": ([4], "float32")}
    c0 = decode_contribution(raw, step=step, rank=0, reference=ref)
    big = {n: t * 1000 for n, t in c0.decode().items()}
    payload, c1 = encode_contribution(
        big,
        rank=1,
        step=step,
        tokens=None,
        inner_steps=None,
        encoding=Encoding(codec="fp32", checksum="sha256"),
    )
    assert store.put_if_absent(contrib_key(step, 1), b"".join(bytes(b) for b in payload))
    record = make_commit(
        step=step, world_size=2, included=[c0, c1], weighting="equal", committed_by=0, excluded={}
    )
    assert store.put_if_absent(commit_key(step), json.dumps(record).encode())


def test_a_forged_update_that_follows_the_rule_trips_the_norm_screen(tmp_path: Path) -> None:
    uri = "file://" + str(tmp_path / "run")
    m0, m1 = _manager(uri, 0, None), _manager(uri, 1, None)
    for value in (1.0, 1.1, 0.9, 1.05):  # four honest rounds: the run's recent norms
        _both(m0, m1, value)
    forger = threading.Thread(target=_plant_in_slot, args=(uri, 5))
    forger.start()
    err = _refused(m0, 1.0, "norm outlier")
    forger.join(10)
    assert err.step == 5
    _refused(m1, 2.0, "norm outlier")


def test_the_tripwire_remembers_across_a_relaunch(tmp_path: Path) -> None:
    """Both replicas relaunched after round 4 (new processes: nothing in memory), two honest
    rounds, then the forgery: judged against the run's rounds 1-6, not the relaunch's two."""
    uri = "file://" + str(tmp_path / "run")
    m0, m1 = _manager(uri, 0, None), _manager(uri, 1, None)
    for value in (1.0, 1.1, 0.9, 1.05):
        _both(m0, m1, value)
    m0.close()
    m1.close()
    m0, m1 = _manager(uri, 0, None), _manager(uri, 1, None)  # the relaunch
    assert m0.current_step() == m1.current_step() == 4
    for value in (0.95, 1.0):
        _both(m0, m1, value)
    forger = threading.Thread(target=_plant_in_slot, args=(uri, 7))
    forger.start()
    err = _refused(m0, 1.0, "norm outlier")
    forger.join(10)
    assert err.step == 7 and "the last 6 rounds'" in str(err)


def test_the_rule_is_the_contribution_screen_s() -> None:
    """One rule for contributions and updates: above ratio x the median of at least 3."""
    assert norm_outlier(11.0, [1.0, 1.0], 10.0) is None  # too few to judge
    assert norm_outlier(9.0, [1.0, 1.0, 1.0], 10.0) is None
    why = norm_outlier(11.0, [1.0, 1.0, 1.0], 10.0, against="the last 3 rounds'")
    assert why == "norm outlier: L2 norm 11 > 10 x the last 3 rounds' median 1"
    assert norm_outlier(1e9, [1.0, 1.0, 1.0], 0.0) is None  # outlier_ratio = 0: off
