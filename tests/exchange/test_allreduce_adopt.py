"""A committed round that lists a contribution some replicas cannot read any more.

Rank 1 reads a contribution, then the stored copy rots (overwritten with one byte flipped,
through the store interface); rank 1 commits listing it. A replica that reads the rotted copy
cannot apply the record (`ListedContributionError`). Before, it failed the round, trained it
again, met the same record and failed again until the run moved past it; now it adopts the
round: it loads the outer state the committer publishes and trains the next round with the
others, bit-identical. When that state never appears it fails the round as before, saying why.

Each rank's store is a view of one real store (`_Scripted`, a `FaultyStore` without faults plus
two hooks): no rank reads the rotted copy before rank 1 has read the good one, and the ranks
that must not commit first hold a read until the record is there, so rank 1 commits (the others
defer to the lowest rank they hold valid, rank 1 takes over after ``commit_grace_s``).
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from allreduce_handles import exchange

sys.path.insert(0, str(Path(__file__).parents[1] / "diloco"))

from _diloco_worker import build_model, inner_step  # noqa: E402

from composer_replication.diloco import make_diloco_outer_loop  # noqa: E402
from composer_replication.exchange import ObjectStoreManager  # noqa: E402
from composer_replication.exchange.document_format import state_key  # noqa: E402
from composer_replication.exchange.faulty_store import FaultyStore  # noqa: E402
from composer_replication.exchange.protocol import commit_key, contrib_key  # noqa: E402
from composer_replication.exchange.store import ObjectStore, Payload  # noqa: E402
from composer_replication.exchange.vocabulary import ListedContributionError  # noqa: E402

STEP = 1  # the store step (outer round) whose listed contribution rots
H = 2
ROUNDS = 2


class _Scripted(FaultyStore):
    """One rank's view of the shared store: ``hold`` keys are read only once step `STEP`'s
    commit record exists; after this rank reads ``rot`` its stored copy is overwritten with one
    byte flipped; the state rounds this rank published are recorded."""

    def __init__(self, inner: ObjectStore, *, hold: tuple[str, ...] = (), rot: str = "") -> None:
        super().__init__(inner)
        self.hold, self.rot = set(hold), rot
        self.published: list[str] = []

    def get(self, key: str) -> bytes | memoryview | None:
        if key in self.hold:
            deadline = time.monotonic() + 30
            while self.inner.get(commit_key(STEP)) is None and time.monotonic() < deadline:
                time.sleep(0.01)
        raw = super().get(key)
        if key == self.rot and raw is not None:
            self.rot = ""
            flipped = bytearray(bytes(raw))
            flipped[len(flipped) // 2] ^= 0xFF
            self.inner.put(key, bytes(flipped))
        return raw

    def put_if_absent(self, key: str, data: Payload) -> bool:
        wrote = super().put_if_absent(key, data)
        if wrote and key.startswith("states/"):
            self.published.append(key)
        return wrote


def _views(uri: str, rotted: int | None) -> dict[int, _Scripted]:
    """Rank 1 reads rank ``rotted``'s contribution of step `STEP`, then it rots (None: nothing
    rots); ranks 0 and 2 hold their reads of a peer until rank 1 has committed, so rank 1
    commits and the one of them that did not upload the rotted contribution reads it rotted."""
    base = ObjectStore(uri)
    key = {r: contrib_key(STEP, r) for r in range(3)}
    return {
        0: _Scripted(base, hold=(key[2],)),
        1: _Scripted(base, rot="" if rotted is None else key[rotted]),
        2: _Scripted(base, hold=(key[0],)),
    }


def _config(**kw: Any) -> dict[str, Any]:
    return {"timeout_s": 4.0, "poll_interval_s": 0.01, "min_replicas": 2, **kw}


def _exchanges(
    views: dict[int, _Scripted], ranks: tuple[int, ...]
) -> tuple[dict[int, Any], list[threading.Thread]]:
    """``ranks`` run step `STEP`'s exchange without a manager, each in a started thread; the
    dict gets each one's result (rank r sends ``r`` everywhere) or exception."""
    out: dict[int, Any] = {}

    def go(r: int) -> None:
        try:
            out[r] = exchange(views[r], 3, r, **_config()).allreduce(
                {"w": torch.full((3,), float(r))}, step=STEP
            )
        except BaseException as e:
            out[r] = e

    threads = [threading.Thread(target=go, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    return out, threads


@pytest.mark.parametrize(
    ("rotted", "fails"),
    [(0, 2), (2, 0)],
    ids=["rank0-rots-rank2-cannot-read", "rank2-rots-rank0-lowest-included-cannot-read"],
)
def test_a_replica_that_cannot_read_a_listed_contribution_adopts_the_committed_round(
    tmp_path: Path, rotted: int, fails: int
) -> None:
    """Three replicas, DiLoCo over the store, two rounds. In round 1 rank ``fails`` cannot read
    rank ``rotted``'s contribution that rank 1's record lists; it loads round 1's published
    state and trains round 2 with the others: every rank ends at round 2 with bit-identical
    global weights, outer momentum and model, having run each round's inner steps once, and
    round 2 includes all three. In the second case the lowest included rank is the one that
    cannot read: round 1's state comes from its committer (rank 1), which holds every
    contribution it listed (`test_the_committer_publishes_the_rounds_state`)."""
    uri = "file://" + str(tmp_path / "run")
    views = _views(uri, rotted)
    outers: dict[int, Any] = {}
    models: dict[int, torch.nn.Module] = {}
    errors: list[BaseException] = []

    def replica(r: int) -> None:
        try:
            model = build_model(100 + r)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            manager = ObjectStoreManager(exchange(views[r], 3, r, **_config()))
            outer = make_diloco_outer_loop(opt, manager, H, model=model)
            outers[r], models[r] = outer, model
            with outer:
                for t in range(ROUNDS * H):  # each round's inner steps once, whatever happens
                    inner_step(model, opt, r, t)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [outers[r].round for r in range(3)] == [ROUNDS] * 3, [o.history for o in outers.values()]
    ref = outers[1]
    for r in (0, 2):
        g, g1 = outers[r].global_parameters(), ref.global_parameters()
        assert all(torch.equal(g[n], g1[n]) for n in g1), f"rank {r}'s global weights differ"
        mom = outers[r].outer_optimizers[0].state_dict()["state"]
        mom1 = ref.outer_optimizers[0].state_dict()["state"]
        assert all(torch.equal(mom[i]["momentum_buffer"], mom1[i]["momentum_buffer"]) for i in mom1)
        for p, q in zip(models[r].parameters(), models[1].parameters()):
            assert torch.equal(p, q), f"rank {r}'s model differs"
    history = outers[fails].history
    failed = [rec for rec in history if rec["store_step"] == STEP and not rec["healed"]]
    assert len(failed) == 1 and "ListedContributionError" in str(failed[0]["error"]), history
    assert any(rec["round"] == STEP and rec["healed"] for rec in history), history
    last = history[-1]
    assert last["store_step"] == ROUNDS and last["committed"], history
    assert last["included_ranks"] == [0, 1, 2], history
    for r in (0, 1, 2):
        if r != fails:
            steps = [rec["store_step"] for rec in outers[r].history]
            assert steps == [1, 2] and all(rec["committed"] for rec in outers[r].history)
    assert state_key("global", STEP) not in views[fails].published


def test_the_committer_publishes_the_rounds_state(tmp_path: Path) -> None:
    """Rank 1 commits a round that includes ranks 0, 1 and 2: rank 1 publishes its state, not
    the lowest included rank (which may be one that cannot read a listed contribution, and
    then waits for this state)."""
    views = _views("file://" + str(tmp_path / "run"), rotted=None)

    def replica(r: int) -> tuple[bool, bool, list[int]]:
        w = torch.zeros(3)
        m = ObjectStoreManager(exchange(views[r], 3, r, **_config()))
        m.register_state_dict_fn("w", lambda s: w.copy_(s["w"]), lambda: {"w": w})
        m.start_quorum()
        m.allreduce(torch.full((3,), float(r))).wait()
        return m.should_commit(), m.publish_if_due(), m.history[-1]["included_ranks"]

    results: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda r=r: results.__setitem__(r, replica(r))) for r in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {r: (True, r == 1, [0, 1, 2]) for r in range(3)}, results
    published = {r: v.published for r, v in views.items()}
    assert [r for r in range(3) if state_key("global", STEP) in published[r]] == [1], published


@pytest.mark.parametrize("state", ["never", "damaged"])
def test_a_committed_round_without_a_usable_state_fails_as_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, state: str
) -> None:
    """Ranks 0 and 1 exchange without a manager (nobody publishes a state); rank 2 cannot read
    rank 0's listed contribution. Its round 1 state never appears (rank 2 waits
    ``state_timeout_s``) or what stands there is not a state (a pickle: refused, never
    unpickled): rank 2 fails the round as it did before (should_commit False, still at round
    0, the error in its record) with a log line saying why; its retry meets the same record and
    fails the same way."""
    uri = "file://" + str(tmp_path / "run")
    views = _views(uri, rotted=0)
    w = torch.zeros(3)
    m = ObjectStoreManager(exchange(views[2], 3, 2, **_config()), state_timeout_s=0.5)
    m.register_state_dict_fn("w", lambda s: w.copy_(s["w"]), lambda: {"w": w})
    m.initial_sync({"w": w})
    if state == "damaged":
        views[2].inner.put(state_key("global", STEP), pickle.dumps({"w": torch.ones(3)}))
    out, threads = _exchanges(views, (0, 1))
    caplog.set_level(logging.WARNING, logger="composer_replication.exchange.store_manager")
    for _attempt in range(2):
        m.start_quorum()
        t0 = time.monotonic()
        m.allreduce(torch.full((3,), 2.0)).wait()
        assert m.should_commit() is False and m.current_step() == 0
        assert state != "never" or time.monotonic() - t0 >= 0.5
        assert "ListedContributionError" in str(m.history[-1]["error"]), m.history
        assert not m.history[-1]["healed"]
    for t in threads:
        t.join(60)
    assert all(isinstance(v, dict) for v in out.values()), out
    said = [r.getMessage() for r in caplog.records if "cannot be adopted" in r.getMessage()]
    why = "state_timeout_s=0.5" if state == "never" else "published outer state is refused"
    assert len(said) == 2 and why in said[0], said
    assert torch.equal(w, torch.zeros(3))


def test_the_error_names_the_step_the_committer_and_the_listed_ranks(tmp_path: Path) -> None:
    """The exchange alone: rank 2's `allreduce` raises `ListedContributionError` (a
    `CorruptContributionError`, as before) carrying what a manager needs to adopt the round."""
    uri = "file://" + str(tmp_path / "run")
    out, threads = _exchanges(_views(uri, rotted=0), (0, 1, 2))
    for t in threads:
        t.join(60)
    err = out[2]
    assert isinstance(err, ListedContributionError), out
    assert (err.step, err.committed_by, err.included_ranks) == (STEP, 1, [0, 1, 2])
    assert str(err).startswith(f"step {STEP}: the commit lists rank 0 but its contribution")
    assert torch.equal(out[0]["w"], out[1]["w"]) and torch.equal(out[0]["w"], torch.ones(3))
