"""Checkpoints: save_pretrained folders + outer state in the store, mirrored into the run folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from composer_replication.exchange.store import ObjectStore
from composer_replication.models import build_tiny_model, build_tokenizer
from composer_replication.run.checkpoint import (
    committed_checkpoints,
    latest_checkpoint,
    load_outer_state,
    mirror_checkpoints,
    prune_checkpoints,
    save_checkpoint,
)


def test_checkpoint_round_trip_prune_and_mirror(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    store = ObjectStore(str(tmp_path / "store"))
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, seed=3)
    momentum = {"w": torch.arange(6.0).reshape(2, 3)}
    outer = {"fragment_0": {"outer_optimizer": {"state": {0: momentum}, "lr": 0.7}}}
    for rnd in (1, 2, 3):
        save_checkpoint(
            store,
            name=f"round-{rnd:06d}",
            model=model,
            tokenizer=tok,
            round=rnd,
            step=rnd * 10,
            outer_state=outer,
        )
    # an uncommitted (half-written) checkpoint is ignored
    store.put("checkpoints/round-000004/model.safetensors", b"partial")
    assert [n for n, _ in committed_checkpoints(store)] == [
        "round-000001",
        "round-000002",
        "round-000003",
    ]
    prune_checkpoints(store, keep_last=2)
    assert latest_checkpoint(store)[0] == "round-000003"
    # a COMMITTED marker that is not a JSON object counts as not committed
    store.put("checkpoints/round-000005/COMMITTED", b"\x80 not json")
    store.put("checkpoints/round-000006/COMMITTED", b"[6]")
    local = mirror_checkpoints(store, tmp_path / "run" / "checkpoints")
    assert [p.name for p in local] == ["round-000002", "round-000003"]
    # copies, not hard links into the store: pruning or rewriting there never reaches the mirror
    mirrored = local[-1] / "model.safetensors"
    assert mirrored.stat().st_nlink == 1
    assert mirrored.read_bytes() == bytes(store.get("checkpoints/round-000003/model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(local[-1])
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    state = load_outer_state(local[-1])
    assert state["fragment_0"]["outer_optimizer"]["lr"] == 0.7
    assert torch.equal(state["fragment_0"]["outer_optimizer"]["state"][0]["w"], momentum["w"])
    # pruning in the store removes the mirrored copy on the next mirror
    prune_checkpoints(store, keep_last=1)
    assert [p.name for p in mirror_checkpoints(store, tmp_path / "run" / "checkpoints")] == [
        "round-000003"
    ]


def test_mirror_refreshes_a_checkpoint_rewritten_in_the_store(tmp_path: Path) -> None:
    """A resumed run rewrites ``final``: the run folder must not keep the old copy."""
    store = ObjectStore(str(tmp_path / "store"))
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, seed=3)
    save_checkpoint(store, name="final", model=model, tokenizer=None, round=2, step=8)
    local_dir = tmp_path / "run" / "checkpoints"
    mirror_checkpoints(store, local_dir)
    assert json.loads((local_dir / "final" / "state.json").read_text())["round"] == 2
    save_checkpoint(store, name="final", model=model, tokenizer=None, round=30, step=120)
    mirror_checkpoints(store, local_dir)
    assert json.loads((local_dir / "final" / "state.json").read_text())["round"] == 30


def test_mirror_survives_a_round_pruned_while_it_copies(tmp_path: Path) -> None:
    """Replica 0 commits round 2 and prunes round 1 (keep_last=1) just after the driver listed
    round 1 as committed and began copying it: the driver skips it (no crash, no partial
    folder) and mirrors round 2 on its next pass."""
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, seed=3)

    class PrunedMidCopy(ObjectStore):
        """The real file:// store; the replica's commit + prune runs before the first copy."""

        interleaved = False

        def get_file(self, key: str, local_file: str | Path) -> None:  # type: ignore[override]
            if not self.interleaved:
                self.interleaved = True
                save_checkpoint(
                    self, name="round-000002", model=model, tokenizer=tok, round=2, step=2
                )
                prune_checkpoints(self, keep_last=1)
            super().get_file(key, local_file)

    store = PrunedMidCopy(str(tmp_path / "store"))
    save_checkpoint(store, name="round-000001", model=model, tokenizer=tok, round=1, step=1)
    local_dir = tmp_path / "run" / "checkpoints"
    assert mirror_checkpoints(store, local_dir) == []
    assert not list(local_dir.glob(".*"))
    assert [p.name for p in mirror_checkpoints(store, local_dir)] == ["round-000002"]
