"""A bucket writer without any of the run's keys, attacking a signed decoupled run (run as its own
process by tests/run/test_decoupled_signed_train.py).

    python _decoupled_forger.py STORE_URI STORAGE_OPTIONS_JSON OUT_JSON

Once fragment 0's first merge record is in the store it writes, through the store's interface:
an unsigned push in learner 1's name, a genuine push of learner 0 re-uploaded under a later
name, a forged merge record (a genuine one with its version changed) at fragment 0's next
version, fragment 1's version-1 record replayed at its next version, and an unsigned global
state at fragment 1's next version (each put-if-absent at the first free version, so it lands
before the synchronizer gets there). OUT_JSON lists the keys it planted.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from composer_replication.exchange.document_format import encode_state
from composer_replication.exchange.push_store import (
    DecoupledStore,
    PushId,
    encode_push,
    global_key,
    merge_key,
)
from composer_replication.exchange.store import ObjectStore
from composer_replication.exchange.vocabulary import DTYPES


def _wait(store: ObjectStore, key: str, timeout_s: float = 600.0) -> bytes:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        raw = store.get(key)
        if raw is not None:
            return bytes(raw)
        time.sleep(0.2)
    raise TimeoutError(f"{key} never appeared")


def _first_free(store: ObjectStore, key_of, start: int, payload) -> str:  # noqa: ANN001
    for v in range(start, start + 50):
        if store.put_if_absent(key_of(v), payload(v)):
            return key_of(v)
    raise RuntimeError("no free version to plant at")


def main(uri: str, options: dict, out: str) -> None:
    store = ObjectStore(uri, options)
    docs = DecoupledStore(store)
    merge_f0 = json.loads(_wait(store, merge_key(0, 1)))
    merge_f1 = _wait(store, merge_key(1, 1))
    manifest = docs.read_manifest()
    assert manifest is not None
    ref = DecoupledStore.reference(manifest, 0)
    zeros = {n: torch.zeros(shape, dtype=DTYPES[d]) for n, (shape, d) in ref.items()}
    planted: dict[str, str] = {}

    # 1. an unsigned push in learner 1's name, based on fragment 0's newest version
    base = max(docs.versions(0, "global"))
    forged = PushId(0, base, 1, 50)
    fields = {"steps": 4, "tokens": 1, "steps_since_push": 4, "step_seconds": 0.1}
    store.put(forged.key, b"".join(encode_push(zeros, forged, learner_step=4, **fields)))
    planted["forged_push"] = forged.key
    # 2. a genuine push of learner 0 re-uploaded under a later name
    genuine = next((p for p in docs.list_pushes() if p.learner == 0 and p.seq < 50), None)
    raw = None if genuine is None else store.get(genuine.key)
    if genuine is not None and raw is not None:  # (none left: collected meanwhile)
        replay = PushId(genuine.fragment, genuine.base, 0, 60)
        store.put(replay.key, bytes(raw))
        planted["replayed_push"] = replay.key
    # 3. a forged merge record at fragment 0's next version (a genuine one, version changed)
    head0 = max(docs.versions(0, "merge"))

    def forged_merge(v: int) -> bytes:
        return json.dumps({**merge_f0, "version": v, "base_version": v - 1}).encode()

    planted["forged_merge"] = _first_free(store, lambda v: merge_key(0, v), head0 + 1, forged_merge)
    # 4. fragment 1's version-1 record replayed at its next version
    head1 = max(docs.versions(1, "merge"))
    planted["replayed_merge"] = _first_free(
        store, lambda v: merge_key(1, v), head1 + 1, lambda v: merge_f1
    )
    # 5. an unsigned global state at fragment 1's next version
    ref1 = DecoupledStore.reference(manifest, 1)
    weights = {n: torch.full(shape, 7.0, dtype=DTYPES[d]) for n, (shape, d) in ref1.items()}
    gv = max(docs.versions(1, "global"))

    def forged_global(v: int) -> bytes:
        return encode_state(weights, name="f001", round=v, extra={"kind": "global"})

    planted["forged_global"] = _first_free(store, lambda v: global_key(1, v), gv + 1, forged_global)
    with open(out, "w") as f:
        json.dump(planted, f)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
