"""Decoupled exact resume: a learner restored from the state it saved at a push continues
bit-identically; a corrupt or forged state is skipped (older one, or the newest globals) with
the reason (diloco/decoupled/learner_state.py, `DecoupledLearner.resume_state` / `restore`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _decoupled_toy import Blocks, train_step
from signing_keys import run_keys

from composer_replication.diloco.decoupled import DecoupledLearner, LearnerConfig
from composer_replication.diloco.decoupled.learner_state import learner_resume, learner_start
from composer_replication.diloco.replica_state import (
    prune_replica_states,
    replica_state_rounds,
    save_replica_state,
)
from composer_replication.exchange.signing import (
    rank_identity,
)
from composer_replication.exchange.store import ObjectStore

H, P = 8, 4


def _learner(
    store: ObjectStore, seed: int = 7
) -> tuple[Blocks, torch.optim.Optimizer, DecoupledLearner]:
    model = Blocks(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    learner = DecoupledLearner(
        store,
        learner=0,
        n_learners=1,
        config=LearnerConfig(sync_every_h=H, fragments=P, heartbeat_every_s=None),
        model=model,
    )
    return model, opt, learner


def _bind(learner: DecoupledLearner, opt: torch.optim.Optimizer) -> None:
    """Bind and count steps as entering the context would, without its upload threads (the
    queued pushes stay in the queue, where the test compares them)."""
    learner.bind(optimizer=opt)
    opt.register_step_post_hook(learner._after_step)


def _state(model: Blocks, opt: torch.optim.Optimizer, learner: DecoupledLearner) -> dict:
    return {
        "global_step": learner.step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "learner": learner.resume_state(),
    }


def _assert_same(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _saved_run(
    tmp_path: Path, steps: int
) -> tuple[ObjectStore, Blocks, torch.optim.Optimizer, DecoupledLearner]:
    """A learner trained `steps` steps, its state saved at every push step (as the replica's
    LearnerStateWriter does)."""
    store = ObjectStore(str(tmp_path / "store"))
    model, opt, learner = _learner(store)
    _bind(learner, opt)
    for t in range(steps):
        train_step(model, opt, 0, t)
        if learner.last_push_step == learner.step:
            save_replica_state(
                store,
                rank=0,
                round=learner.step,
                step=learner.step,
                state=_state(model, opt, learner),
                kind="learner",
            )
            prune_replica_states(store, 0, 2, kind="learner")
    return store, model, opt, learner


def test_a_restored_learner_is_bit_identical_and_continues_identically(tmp_path: Path) -> None:
    steps = 2 * H + H // P  # ends right after a push (of fragment 0)
    store, model, opt, learner = _saved_run(tmp_path, steps)
    assert replica_state_rounds(store, 0, "learner") == [steps - H // P, steps]  # newest 2 kept
    found = learner_resume(store, 0)
    assert found is not None and found[0] == steps
    _, key, state = found
    assert key == f"resume/learner-0/{steps:010d}.json"
    # a new learner (another incarnation: other initial weights) restored from it
    model2, opt2, learner2 = _learner(store, seed=99)
    learner2.restore(state["learner"])
    assert learner2.start_step == steps
    _bind(learner2, opt2)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    _assert_same(model.state_dict(), model2.state_dict(), "model")
    _assert_same(opt.state_dict(), opt2.state_dict(), "optimizer")
    _assert_same(learner.resume_state(), learner2.resume_state(), "learner")
    # and both train on identically: same weights, same queued pushes (pseudo-gradients, work)
    learner._queue.clear()  # (as if uploaded: the restored one starts with none queued)
    for t in range(steps, steps + H):
        train_step(model, opt, 0, t)
        train_step(model2, opt2, 0, t)
    _assert_same(model.state_dict(), model2.state_dict(), "model after")
    assert set(learner._queue) == set(range(P))
    for i in range(P):
        (d1, f1), (d2, f2) = learner._queue[i], learner2._queue[i]
        _assert_same(d1, d2, f"push {i}")
        assert f1 == {**f2, "step_seconds": f1["step_seconds"]}


def _flip(store: ObjectStore, key: str) -> None:
    raw = bytearray(store.get(key))
    raw[len(raw) // 2] ^= 0xFF
    store.put(key, bytes(raw))


def test_a_corrupt_state_falls_back_to_an_older_one_then_to_the_globals(tmp_path: Path) -> None:
    steps = 2 * H + H // P
    store, _, _, _ = _saved_run(tmp_path, steps)
    older = steps - H // P

    def blobs(step: int) -> list[str]:
        prefix = f"resume/learner-0/{step:010d}"
        return [f"{prefix}/{n}" for n in store.list(prefix) if n.endswith(".safetensors")]

    _flip(store, blobs(steps)[0])
    lines: list[str] = []
    found = learner_resume(store, 0, warn=lines.append)
    assert found is not None and found[0] == older
    assert len(lines) == 1 and "sha256" in lines[0] and f"step {steps}" in lines[0]

    # a forged state: valid checksums, but its learner part is another step's
    state = found[2]
    state["learner"]["step"] = older - 1
    save_replica_state(store, rank=0, round=older, step=older, state=state, kind="learner")
    lines.clear()
    assert learner_resume(store, 0, warn=lines.append) is None
    assert len(lines) == 2 and "learner part is not at step" in lines[1]

    # the replica then starts from the newest globals, and its start event says why
    _, _, fresh = _learner(store)
    start = learner_start(store, 0, fresh, max_steps=10 * H)
    assert start.state is None and fresh.restored_from is None
    why = start.fields["resume_fallback"]
    assert isinstance(why, str) and "sha256" in why and "learner part" in why


def test_restore_refuses_a_state_that_is_not_this_learners(tmp_path: Path) -> None:
    store, model, opt, learner = _saved_run(tmp_path, H)
    state = learner.resume_state()
    other = DecoupledLearner(
        store,
        learner=0,
        n_learners=1,
        config=LearnerConfig(sync_every_h=H, fragments=2, heartbeat_every_s=None),
        model=Blocks(),
    )
    with pytest.raises(ValueError, match="not a list of 2 fragments"):
        other.restore(state)
    _, opt3, third = _learner(store)
    bad = dict(state, base=[{"nope": torch.zeros(1)}] * P)
    third.restore(bad)
    with pytest.raises(ValueError, match="base tensors are not the run's"):
        third.bind(optimizer=opt3)


def test_a_signed_runs_learner_states_are_signed_and_checked(tmp_path: Path) -> None:
    """With ``[security] sign``: a state whose manifest this learner did not sign is refused
    (unsigned, or signed by another learner), never loaded."""
    store, model, opt, learner = _saved_run(tmp_path, H)
    verifier, signers = run_keys(store, [rank_identity(0), rank_identity(1)])
    own, other = signers[rank_identity(0)], signers[rank_identity(1)]
    state = _state(model, opt, learner)
    lines: list[str] = []
    # the unsigned states of _saved_run: refused
    assert learner_resume(store, 0, keys=verifier, warn=lines.append) is None
    assert lines and all("is not signed" in line for line in lines), lines
    step = learner.step + 1  # (a new index, as a later push's)
    state = dict(state, global_step=step, learner=dict(state["learner"], step=step))
    save_replica_state(
        store, rank=0, round=step, step=step, state=state, kind="learner", keys=other
    )
    lines.clear()
    assert learner_resume(store, 0, keys=verifier, warn=lines.append) is None
    assert "signed by 'rank-1'" in lines[0], lines
    save_replica_state(store, rank=0, round=step, step=step, state=state, kind="learner", keys=own)
    found = learner_resume(store, 0, keys=verifier)
    assert found is not None and found[0] == step
