"""Independent float64 reference of the synchronizer's chain (tests only).

From the store alone (merge records, pushes, stored versions) recompute every version of every
fragment in float64 with the formulas written out here, and compare with what was published.
Nothing here calls the synchronizer's code.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from safetensors.torch import load as st_load

from composer_replication.exchange.store import ObjectStore


def _load_state(store: ObjectStore, key: str) -> dict[str, torch.Tensor] | None:
    raw = store.get(key)
    return None if raw is None else st_load(bytes(raw))


def _push_tensors(store: ObjectStore, name: str) -> dict[str, torch.Tensor]:
    """Decode an fp32 push by hand: safetensors parts t<i>.q in the header's name order."""
    raw = bytes(store.get(f"decoupled/push/{name}"))
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["composer_replication"])
    assert meta["codec"] == "fp32"
    parts = st_load(raw)
    return {
        nm: parts[f"t{i}.q"].double().view(shape)
        for i, (nm, shape) in enumerate(zip(meta["names"], meta["shapes"]))
    }


def replay_fragment(store: ObjectStore, p: int) -> dict[str, Any]:
    """Recompute fragment p's versions from version 0 and its merge records (float64).

    Returns {"versions": [...], "max_abs_diff": worst |reference - stored| over stored
    versions, "consumed": every push name consumed, with duplicates kept}.
    """
    base = f"decoupled/f{p:03d}/"
    theta = {
        k: v.double() for k, v in _load_state(store, f"{base}global/{0:010d}.safetensors").items()
    }
    mom: dict[str, torch.Tensor] = {}
    versions = sorted(int(n[:10]) for n in store.list(f"{base}merge/") if n.endswith(".json"))
    assert versions == list(range(1, len(versions) + 1)), f"gap in the chain: {versions}"
    worst = 0.0
    consumed: list[str] = []
    for v in versions:
        rec = json.loads(bytes(store.get(f"{base}merge/{v:010d}.json")))
        consumed += rec["consumed"]
        decided = rec["decisions"]
        accepted = [e for e in rec["inputs"] if decided[e["push"]]["included"]]
        assert accepted, f"record {v} merged nothing"
        g = {k: torch.zeros_like(t) for k, t in theta.items()}
        deltas = [(decided[e["push"]]["weight"], _push_tensors(store, e["push"])) for e in accepted]
        assert abs(sum(w for w, _ in deltas) - 1.0) < 1e-9
        if rec["merge"] == "mean":
            for w, d in deltas:
                for k in g:
                    g[k] += w * d[k]
        else:  # rda: norm-weighted mean times unit mean direction
            for k in g:
                norm = sum(w * float(d[k].norm()) for w, d in deltas)
                direction = sum(
                    w * (d[k] / d[k].norm() if d[k].norm() > 0 else 0 * d[k]) for w, d in deltas
                )
                g[k] = direction / direction.norm() * norm
        lr, mu, nest = rec["outer"]["lr"], rec["outer"]["momentum"], rec["outer"]["nesterov"]
        for k in theta:
            mom[k] = g[k] if k not in mom else mu * mom[k] + g[k]
            update = g[k] + mu * mom[k] if nest else mom[k]
            theta[k] = theta[k] - lr * update
        stored = _load_state(store, f"{base}global/{v:010d}.safetensors")
        if stored is not None:
            worst = max(
                worst, max(float((stored[k].double() - theta[k]).abs().max()) for k in theta)
            )
    return {"versions": versions, "max_abs_diff": worst, "consumed": consumed, "theta": theta}
