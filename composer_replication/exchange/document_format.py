"""The format of a run's documents (`run_documents.RunDocuments` writes and reads them): where
each lives in the run prefix, the manifest's fields, a state snapshot's bytes. Pure functions.

- The manifest pins what every replica must agree on (world size, codec, model fingerprint).
  The first replica writes it with put-if-absent; a replica whose model differs is refused
  with a diff before it uploads anything.
- A state snapshot (``states/<name>/<round:010d>.safetensors``) holds a full state dict in its
  original dtypes (lossless) plus a JSON header with a sha256 and caller-provided ``extra``.
  Round 0 of ``global`` is the initial weights every replica starts from; later rounds let a
  restarted replica fetch the latest global weights and rejoin.
- A small JSON document (``config.json``, ...) lives at any relative key but the protocol's
  own (`check_doc_key`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from typing import Any

import torch
from safetensors.torch import save as st_save

from composer_replication.exchange import wire
from composer_replication.exchange.protocol import FORMAT, HEADER_KEY, tensors_digest
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.vocabulary import CorruptContributionError
from composer_replication.json_types import JSONDict, JSONValue, as_dict

# who may sign a published state: any rank (sync mode) or the synchronizer (decoupled mode)
STATE_SIGNERS = frozenset({"rank-*", "synchronizer"})

MANIFEST_KEY = "manifest.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
_RESERVED = ("steps/", "states/", ".tmp/", MANIFEST_KEY)


def check_state_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.startswith("."):
        raise ValueError(f"state name {name!r} must match [A-Za-z0-9_.-]+ (e.g. 'global')")
    return name


def check_doc_key(key: str) -> str:
    """Validate a run-document key: relative, no '..', not one of the protocol's own keys."""
    if not isinstance(key, str) or not _KEY_RE.match(key) or ".." in key.split("/"):
        raise ValueError(f"document key {key!r} must be a relative path like 'config.json'")
    if key == MANIFEST_KEY or any(key.startswith(p) for p in _RESERVED[:-1]):
        raise ValueError(f"document key {key!r} is reserved for the exchange protocol")
    return key


def state_prefix(name: str) -> str:
    return f"states/{check_state_name(name)}/"


def state_key(name: str, round: int) -> str:
    return f"{state_prefix(name)}{round:010d}.safetensors"


def parse_state_name(fname: str) -> int | None:
    stem, dot, ext = fname.partition(".")
    return (
        int(stem) if dot and ext == "safetensors" and stem.isdigit() and len(stem) == 10 else None
    )


def model_fingerprint(
    model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor],
) -> JSONDict:
    """Parameter names, shapes and dtypes of an ``nn.Module`` (named_parameters) or a dict.

    Returns ``{"parameters": {name: [shape, dtype]}, "num_parameters": int}`` (JSON-able).
    """
    items: list[tuple[str, torch.Tensor]]
    if isinstance(model_or_state_dict, torch.nn.Module):
        items = list(model_or_state_dict.named_parameters())
    elif isinstance(model_or_state_dict, dict):
        items = list(model_or_state_dict.items())
    else:
        raise ValueError("model_fingerprint expects an nn.Module or a dict of tensors")
    params: JSONDict = {}
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"model_fingerprint: {name!r} is not a tensor")
        params[name] = [list(t.shape), str(t.dtype).removeprefix("torch.")]
    return {"parameters": params, "num_parameters": sum(t.numel() for _, t in items)}


def manifest_diff(stored: Mapping[str, JSONValue], ours: Mapping[str, JSONValue]) -> list[str]:
    """Human-readable differences between two manifests (empty = same run)."""
    out = []
    for key in ("world_size", "codec"):
        if stored.get(key) != ours.get(key):
            out.append(f"{key}: stored {stored.get(key)!r}, this replica {ours.get(key)!r}")
    sp = as_dict(as_dict(stored.get("fingerprint")).get("parameters", {}))
    op = as_dict(as_dict(ours.get("fingerprint")).get("parameters", {}))
    missing, extra = sorted(set(sp) - set(op)), sorted(set(op) - set(sp))
    changed = [n for n in sorted(set(sp) & set(op)) if sp[n] != op[n]]
    if missing:
        out.append(f"parameters missing here: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        out.append(f"parameters not in the run: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for n in changed[:5]:
        out.append(f"{n}: stored {sp[n]}, this replica {op[n]}")
    if stored.get("fingerprint") != ours.get("fingerprint") and not (missing or extra or changed):
        out.append("model fingerprints differ")
    return out


def encode_state(
    state: dict[str, torch.Tensor],
    *,
    name: str,
    round: int,
    extra: Mapping[str, JSONValue] | None,
    keys: RunKeys | None = None,
) -> bytes:
    """Serialise a full state dict losslessly (header signed with ``keys``). Tensors are
    copied so tied weights are fine."""
    if not state:
        raise ValueError("publish_state: the state dict is empty")
    tensors = {}
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"publish_state: {k!r} is not a tensor")
        # clone: safetensors refuses tensors that share storage (tied embeddings)
        tensors[k] = v.detach().to("cpu").contiguous().clone()
    header = {
        "format": FORMAT,
        "kind": "state",
        "name": name,
        "round": round,
        "extra": extra or {},
        "sha256": tensors_digest(tensors),
    }
    try:
        header = header if keys is None else keys.sign(header)
        meta = json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"publish_state: extra must be JSON-serialisable ({e})") from e
    return st_save(tensors, metadata={HEADER_KEY: meta})


def decode_state(
    blob: bytes | memoryview,
    *,
    name: str,
    round: int,
    keys: RunKeys | None = None,
    signers: Collection[str] = STATE_SIGNERS,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Validate a state snapshot (its signature too, with ``keys``: by one of ``signers``);
    returns (tensors, extra)."""
    what = f"state {name!r} round {round}"
    meta, views, _ = wire.unframe(blob, what)  # one header parser for every object we read
    try:
        h = json.loads(meta[HEADER_KEY])
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise CorruptContributionError(f"{what}: missing or unreadable header") from e
    if keys is not None and isinstance(h, dict):
        keys.verify(h, signers=signers, what=what)
    if not (
        isinstance(h, dict)
        and h.get("format") == FORMAT
        and h.get("kind") == "state"
        and h.get("name") == name
        and h.get("round") == round
        and isinstance(h.get("extra"), dict)
    ):
        raise CorruptContributionError(f"{what}: header does not describe this snapshot")
    # copies the caller owns (the views alias the fetched buffer, read-only for remote stores)
    tensors = {k: t.clone() for k, t in views.items()}
    if tensors_digest(tensors) != h.get("sha256"):
        raise CorruptContributionError(f"{what}: sha256 checksum mismatch")
    return tensors, h["extra"]
