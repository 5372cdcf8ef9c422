"""Per-replica resume states in the store: atomic (manifest last), validated on load (size,
checksum, finite values, skeleton), and the resume point skips damaged rounds and global states
with a warning and falls back to the newest good one; the rollback forgets later rounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from composer_replication.diloco.replica_state import (
    ReplicaStateError,
    load_replica_state,
    prune_replica_states,
    replica_state_rounds,
    resume_point,
    rollback_to,
    save_replica_state,
)
from composer_replication.exchange.outer_state import (
    OuterState,
    fetch_outer_state,
    publish_outer_state,
)
from composer_replication.exchange.run_documents import RunDocuments
from composer_replication.exchange.store import ObjectStore

H = 4


def _state(round: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed + round)
    w = torch.randn(3, 2, generator=g)
    return {
        "format": 1,
        "global_step": round * H,
        "model": {"w": w, "tied": w},  # shared storage, as tied embeddings
        "optimizer": {
            "state": {
                0: {
                    "step": torch.tensor(float(round * H)),
                    "exp_avg": torch.randn(3, 2, generator=g),
                }
            },
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        },
        "rng": {"python": [3, list(range(625)), None], "torch": torch.get_rng_state()},
        "taid": {"t": 0.25, "scheduler": {"t": 0.25, "momentum": 0.0, "prev_loss": None}},
    }


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore((tmp_path / "store").as_uri())


def _docs(store: ObjectStore) -> RunDocuments:
    return RunDocuments(store, world_size=2, codec="none", keep_steps=100, poll_interval_s=0.05)


def _publish_global(store: ObjectStore, round: int, value: float = 1.0) -> None:
    user = {"frag": {"original_parameters": {"w": torch.full((2,), value)}}}
    assert publish_outer_state(_docs(store), OuterState(round=round, user=user))


def test_round_trip_is_exact_and_structured(store: ObjectStore) -> None:
    state = _state(2)
    save_replica_state(store, rank=1, round=2, step=8, state=state)
    got = load_replica_state(store, rank=1, round=2)
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert torch.equal(got["rng"]["torch"], state["rng"]["torch"])
    assert got["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert 0 in got["optimizer"]["state"]  # int keys survive
    assert got["rng"]["python"][1] == list(range(625)) and got["taid"]["t"] == 0.25
    assert replica_state_rounds(store, 1) == [2] and replica_state_rounds(store, 0) == []


def _data_files(store: ObjectStore, rank: int, round: int) -> list[Path]:
    folder = Path(store.local_path) / "resume" / f"rank-{rank}" / f"{round:010d}"
    return sorted(folder.iterdir())


def test_torn_truncated_and_nan_states_are_refused(store: ObjectStore) -> None:
    # torn: data written, killed before the manifest -> not a committed state at all
    save_replica_state(store, rank=0, round=1, step=4, state=_state(1))
    (Path(store.local_path) / "resume" / "rank-0" / f"{1:010d}.json").unlink()
    assert replica_state_rounds(store, 0) == []
    with pytest.raises(ReplicaStateError, match="not in the store"):
        load_replica_state(store, rank=0, round=1)

    save_replica_state(store, rank=0, round=2, step=8, state=_state(2))
    tensors = next(p for p in _data_files(store, 0, 2) if p.suffix == ".safetensors")
    data = tensors.read_bytes()
    tensors.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReplicaStateError, match="truncated"):
        load_replica_state(store, rank=0, round=2)
    tensors.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    with pytest.raises(ReplicaStateError, match="sha256"):
        load_replica_state(store, rank=0, round=2)

    bad = _state(3)
    bad["optimizer"]["state"][0]["exp_avg"][0, 0] = float("nan")
    save_replica_state(store, rank=0, round=3, step=12, state=bad)
    with pytest.raises(ReplicaStateError, match="non-finite"):
        load_replica_state(store, rank=0, round=3)

    manifest = Path(store.local_path) / "resume" / "rank-0" / f"{3:010d}.json"
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "round": 7}))
    with pytest.raises(ReplicaStateError, match="does not describe"):
        load_replica_state(store, rank=0, round=3)


def test_rewrite_replaces_and_prune_keeps_the_newest(store: ObjectStore) -> None:
    for r in (1, 2, 3):
        save_replica_state(store, rank=0, round=r, step=r * H, state=_state(r))
    save_replica_state(store, rank=0, round=3, step=12, state=_state(3, seed=9))
    assert len(_data_files(store, 0, 3)) == 2  # the earlier incarnation's data is gone
    got = load_replica_state(store, rank=0, round=3)
    assert torch.equal(got["model"]["w"], _state(3, seed=9)["model"]["w"])
    prune_replica_states(store, 0, keep=2)
    assert replica_state_rounds(store, 0) == [2, 3]


def test_resume_point_falls_back_past_damage_and_rollback_forgets_later_rounds(
    store: ObjectStore,
) -> None:
    for r in range(4):
        _publish_global(store, r)
    for rank in (0, 1):
        for r in (1, 2, 3):
            save_replica_state(store, rank=rank, round=r, step=r * H, state=_state(r, rank))
    warnings: list[str] = []
    assert resume_point(store, 2, warn=warnings.append) == 3 and not warnings

    # the newest global state is truncated: round 2 it is, with one line about round 3
    key = Path(store.local_path) / "states" / "global" / f"{3:010d}.safetensors"
    key.write_bytes(key.read_bytes()[:100])
    assert resume_point(store, 2, warn=warnings.append) == 2
    assert len(warnings) == 1 and "round 3" in warnings[0]
    # ... and a replica reading the latest global state skips it the same way
    assert fetch_outer_state(_docs(store)).round == 2

    # rank 1's state of round 2 is damaged: round 1
    warnings.clear()
    tensors = next(p for p in _data_files(store, 1, 2) if p.suffix == ".safetensors")
    tensors.write_bytes(b"garbage")
    assert resume_point(store, 2, warn=warnings.append) == 1
    assert any("replica 1 round 2" in w for w in warnings)

    # a NaN global state is never published; one put there by hand (checksum intact) is
    # skipped like a truncated one
    with pytest.raises(ValueError, match="non-finite|refusing"):
        _publish_global(store, 4, value=float("nan"))
    from composer_replication.exchange.document_format import encode_state, state_key

    nan = encode_state({"w": torch.full((2,), float("nan"))}, name="global", round=4, extra={})
    store.put(state_key("global", 4), nan)
    warnings.clear()
    assert resume_point(store, 2, warn=warnings.append) == 1
    assert "round 4" in warnings[0] and "NaN" in warnings[0]
    assert fetch_outer_state(_docs(store)).round == 2  # the replicas skip it too
    # no round after 0 has every replica's state: the newest valid global round, inexactly,
    # rather than starting over
    (Path(store.local_path) / "resume" / "rank-0" / f"{1:010d}.json").unlink()
    warnings.clear()
    assert resume_point(store, 2, warn=warnings.append) == 2
    assert "not exact" in warnings[-1]

    (store_steps := Path(store.local_path) / "steps" / f"{3:010d}").mkdir(parents=True)
    (store_steps / "commit.json").write_text("{}")
    head = store_steps.parent / "head.json"
    head.write_text(json.dumps({"step": 3}))
    rollback_to(store, 1, 2)
    assert not head.exists()  # the exchange would call step 2 stale
    assert sorted(int(p.name[:10]) for p in key.parent.iterdir()) == [0, 1]
    assert not store_steps.exists()
    assert replica_state_rounds(store, 0) == [] and replica_state_rounds(store, 1) == [1]


def test_a_signed_runs_replica_state_must_be_signed_by_its_own_rank(
    store: ObjectStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sync mode with ``[security] sign``: the replica (diloco/sync/sync_resume.py) resumes a round
    only from a state whose manifest its own rank signed for this run; an unsigned one or one
    signed by another rank is refused with the reason, and it resumes with fresh inner state."""
    from signing_keys import run_keys

    from composer_replication.diloco.sync.sync_resume import own_resume_state
    from composer_replication.exchange.signing import rank_identity

    verifier, signers = run_keys(store, [rank_identity(0), rank_identity(1)])
    own, other = signers[rank_identity(0)], signers[rank_identity(1)]

    save_replica_state(store, rank=0, round=2, step=8, state=_state(2))  # unsigned
    assert own_resume_state(store, 0, 2, verifier) is None
    assert "is not signed" in capsys.readouterr().err
    save_replica_state(store, rank=0, round=2, step=8, state=_state(2), keys=other)
    assert own_resume_state(store, 0, 2, verifier) is None
    assert "signed by 'rank-1'" in capsys.readouterr().err
    save_replica_state(store, rank=0, round=2, step=8, state=_state(2), keys=own)
    got = own_resume_state(store, 0, 2, verifier)
    assert got is not None and torch.equal(got["model"]["w"], _state(2)["model"]["w"])
    # an unsigned run's replica takes the same state without checking a signature
    assert own_resume_state(store, 0, 2) is not None
