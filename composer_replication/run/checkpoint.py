"""Checkpoints of the global model: a Hugging Face save_pretrained folder + outer-optimizer state.

Written by replica 0 after a committed outer round (all replicas hold the same global weights
then), into the store under `checkpoints/round-<k>/`:

    config.json, generation_config.json, model.safetensors   (model.save_pretrained)
    tokenizer.json, tokenizer_config.json, ...               (tokenizer.save_pretrained)
    outer_state.safetensors + outer_state.json               (outer momentum etc., no pickle)
    state.json                                               round, inner step, time
    COMMITTED                                                written last: complete checkpoint

`AutoModelForCausalLM.from_pretrained(folder)` loads it directly. The driver mirrors committed
checkpoints into `<run>/checkpoints/` (copies, also for a local store: the mirror must survive
the store pruning its rounds). Old rounds are removed beyond `keep_last`; the final checkpoint
is kept as `final/` too. A `COMMITTED` marker that is not a JSON object (a foreign or corrupt
object) counts as not committed.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from composer_replication.exchange.retry import STATE_WRITE_RETRY_S, retry_write
from composer_replication.exchange.store import ObjectStore
from composer_replication.json_types import JSONDict, JSONValue

__all__ = [
    "committed_checkpoints",
    "latest_checkpoint",
    "mirror_checkpoints",
    "prune_checkpoints",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

PREFIX = "checkpoints"
MARKER = "COMMITTED"


def round_dir(round: int) -> str:
    return f"round-{round:06d}"


def save_checkpoint(
    store: ObjectStore,
    *,
    name: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    round: int,
    step: int,
    outer_state: Mapping[str, object] | None = None,
) -> str:
    """Write a complete checkpoint under checkpoints/<name>/ and commit it; return its key.

    outer_state is the nested outer-optimizer state (tensors, dicts, lists, scalars); it is
    stored as safetensors + a JSON skeleton (composer_replication.exchange.outer_state format).
    """
    from safetensors.torch import save_file

    key = f"{PREFIX}/{name}"
    with tempfile.TemporaryDirectory(prefix="composer-ckpt-") as tmp:
        folder = Path(tmp)
        model.save_pretrained(folder, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if outer_state is not None:
            from composer_replication.exchange.outer_state import encode_state

            tensors, skeleton = encode_state(outer_state)
            save_file(tensors, str(folder / "outer_state.safetensors"))
            (folder / "outer_state.json").write_text(json.dumps({"skeleton": skeleton}))
        (folder / "state.json").write_text(
            json.dumps({"round": round, "step": step, "time": time.time()})
        )

        def upload(_left: float) -> None:
            store.delete_prefix(key)  # a half-written attempt (an earlier incarnation's, or ours)
            store.put_dir(folder, key)
            store.put_json(f"{key}/{MARKER}", {"round": round, "step": step})

        # through a store that refuses writes for a while; then the replica fails loudly
        retry_write(upload, what=f"writing the checkpoint {key}", within_s=STATE_WRITE_RETRY_S)
    return key


def load_outer_state(folder: Path) -> JSONDict | None:
    """The outer state stored in a checkpoint folder (None when it has none)."""
    tensors_path = folder / "outer_state.safetensors"
    if not tensors_path.is_file():
        return None
    from safetensors.torch import load_file

    from composer_replication.exchange.outer_state import decode_state

    skeleton = json.loads((folder / "outer_state.json").read_text())["skeleton"]
    state = decode_state(load_file(str(tensors_path)), skeleton)
    return state if isinstance(state, dict) else None


def committed_checkpoints(store: ObjectStore) -> list[tuple[str, JSONDict]]:
    """(name, commit record) of every committed checkpoint, oldest round first."""
    out = []
    for name in store.list(PREFIX):
        try:
            record = store.get_json(f"{PREFIX}/{name}/{MARKER}")
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("round", 0), int):
            out.append((name, record))
    return sorted(out, key=lambda item: (int(item[1].get("round", 0)), item[0] == "final"))


def latest_checkpoint(store: ObjectStore) -> tuple[str, JSONDict] | None:
    found = committed_checkpoints(store)
    return found[-1] if found else None


def prune_checkpoints(store: ObjectStore, keep_last: int) -> None:
    """Remove round checkpoints beyond the newest keep_last ('final' is never removed)."""
    rounds = [name for name, _ in committed_checkpoints(store) if name.startswith("round-")]
    try:
        for name in rounds[: max(0, len(rounds) - keep_last)]:
            # The marker goes first: from then on no reader counts the round as committed
            # while its files disappear.
            store.delete(f"{PREFIX}/{name}/{MARKER}")
            store.delete_prefix(f"{PREFIX}/{name}")
    except OSError as e:  # the store refuses deletes for now: pruned after the next checkpoint
        log.warning("older checkpoints not pruned yet (%r)", e)


def _local_record(folder: Path) -> JSONValue:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def mirror_checkpoints(store: ObjectStore, local_dir: Path) -> list[Path]:
    """Copy committed checkpoints the run folder does not have yet (or has an older version of:
    a resumed run rewrites ``final``); drop pruned ones.

    Returns the local checkpoint folders present afterwards.
    """
    local_dir.mkdir(parents=True, exist_ok=True)
    found = committed_checkpoints(store)
    names = [name for name, _ in found]
    for name, record in found:
        target = local_dir / name
        if _local_record(target) != record:  # absent, half-copied, or rewritten (e.g. final)
            tmp = local_dir / f".{name}.partial"
            if tmp.exists():
                shutil.rmtree(tmp)
            try:
                store.get_dir(f"{PREFIX}/{name}", tmp)
            except FileNotFoundError:
                # Pruned (or rewritten) by a replica while we copied it: skip it this time (a
                # local copy, if any, stays); the next pass mirrors or drops it.
                shutil.rmtree(tmp, ignore_errors=True)
                continue
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
    for stale in local_dir.glob("round-*"):
        if stale.name not in names and stale.is_dir():
            shutil.rmtree(stale)
    return sorted(p for p in local_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
