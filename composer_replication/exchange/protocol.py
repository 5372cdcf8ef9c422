"""Object-store exchange protocol: keys, payload format, validation and commit records.

Layout under one run prefix (see docs/object-store.md)::

    manifest.json                                  run manifest (put-if-absent)
    steps/<step:010d>/contrib/<rank:05d>[-<slot>].safetensors   one immutable contribution per rank
    steps/<step:010d>/owner/<rank:05d>[-<slot>].json    "I wrote my slot" (writer id), unsigned
    steps/<step:010d>/squat/<rank:05d>[-<slot>].json    "my slot holds an object I did not write"
    steps/<step:010d>/commit.json                  the step's decision (put-if-absent, first wins)
    steps/head.json                                hint: the newest committed step (overwritten)
    states/<name>/<round:010d>.safetensors         full state dicts (initial / global weights)
    <other>.json                                   small run documents (put_json / get_json)

A contribution is a safetensors file whose ``__metadata__`` holds one JSON header (rank, step,
tokens, inner steps, codec, original names/shapes/dtypes, ``writer``: a random id of the upload
that lets a rank tell its own object from one planted in its slot, and ``checksum``:
``{"algo": "xxh3-128" or "sha256", "value": hex}`` of the data section, i.e. of the encoded
tensors). With signing on (exchange/signing.py) the header, commit records and state headers
also carry ``run_id``, ``signer`` and ``signature``. Tensor
``t<i>.<part>`` is part ``q``/``s``/``z`` (codec ``sparseloco``: ``i``/``q``/``s``/``m``) of the
i-th name in the header (names are never used as safetensors keys, so no parameter name can
collide with a part name). Nothing read from the
store is ever unpickled: parsing is JSON plus ``safetensors.torch.load``.

``<slot>``: the per-writer part of a rank's keys for one step, derived from the run's slot
secret (`ObjectStoreAllReduce.slot`), so only the rank's own writer (and its readers, who hold
the secret) knows where its upload goes: an object planted at any other key is never read. Without
a slot secret (library use) the keys are the plain ``<rank:05d>`` ones.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from composer_replication.exchange import checksums, codecs, wire
from composer_replication.exchange.contribution_screening import AggregatePolicy, Decision
from composer_replication.exchange.rules import is_rule_name
from composer_replication.exchange.signing import RunKeys, rank_identity
from composer_replication.exchange.vocabulary import (
    DTYPES,
    CommitRecord,
    Contribution,
    CorruptContributionError,
    ExchangeCancelledError,
    ModelMismatchError,
    StepResult,
    StoreTimeoutError,
    dtype_name,
)

__all__ = [
    "DTYPES",
    "FORMAT",
    "HEADER_KEY",
    "HEAD_KEY",
    "CommitRecord",
    "Contribution",
    "CorruptContributionError",
    "ExchangeCancelledError",
    "Encoding",
    "ModelMismatchError",
    "StepResult",
    "StoreTimeoutError",
    "commit_key",
    "contrib_key",
    "decode_contribution",
    "dtype_name",
    "encode_contribution",
    "make_commit",
    "owner_key",
    "parse_commit",
    "parse_contrib_name",
    "parse_step_dir",
    "squat_key",
    "step_keys",
    "step_prefix",
    "tensors_digest",
]  # the vocabulary (errors, Contribution, StepResult, DTYPES) is re-exported from its leaf

FORMAT = 1
HEADER_KEY = "composer_replication"


def step_prefix(step: int) -> str:
    return f"steps/{step:010d}/"


def _slot_name(rank: int, slot: str) -> str:
    return f"{rank:05d}-{slot}" if slot else f"{rank:05d}"


def contrib_key(step: int, rank: int, slot: str = "") -> str:
    """Rank ``rank``'s contribution to ``step`` (``slot``: its per-writer part, module doc)."""
    return f"{step_prefix(step)}contrib/{_slot_name(rank, slot)}.safetensors"


def commit_key(step: int) -> str:
    return f"{step_prefix(step)}commit.json"


HEAD_KEY = "steps/head.json"  # the newest committed step, as a hint (see ObjectStoreAllReduce)


def owner_key(step: int, rank: int, slot: str = "") -> str:
    """Where rank ``rank`` confirms it wrote its slot (unsigned runs: ``{"writer": id}``)."""
    return f"{step_prefix(step)}owner/{_slot_name(rank, slot)}.json"


def squat_key(step: int, rank: int, slot: str = "") -> str:
    """Where rank ``rank`` reports that its slot holds an object it did not write."""
    return f"{step_prefix(step)}squat/{_slot_name(rank, slot)}.json"


def step_keys(step: int, world_size: int, slots: Sequence[str] | None = None) -> list[str]:
    """Every key a step may hold (what garbage collection deletes, without listing);
    ``slots[r]``: rank r's per-writer part of the step's keys (None: plain keys)."""
    out = [commit_key(step)]
    for r in range(world_size):
        slot = "" if slots is None else slots[r]
        out += [contrib_key(step, r, slot), owner_key(step, r, slot), squat_key(step, r, slot)]
    return out


def parse_step_dir(name: str) -> int | None:
    """``'0000000012'`` -> 12; anything else -> None."""
    return int(name) if name.isdigit() and len(name) == 10 else None


def parse_contrib_name(name: str) -> int | None:
    """``'00003.safetensors'`` or ``'00003-<slot>.safetensors'`` -> 3; anything else -> None."""
    stem, dot, ext = name.partition(".")
    rank, _, slot = stem.partition("-")
    ok = dot and ext == "safetensors" and rank.isdigit() and len(rank) == 5
    return int(rank) if ok and (slot.isalnum() or not slot) else None


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the raw bytes of ``tensors`` in sorted-key order (keys included)."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].contiguous().reshape(-1)  # 0-dim tensors cannot be viewed as bytes
        h.update(key.encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


# ----------------------------------------------------------------------------- contributions


@dataclass(frozen=True)
class Encoding:
    """How a payload's tensors are written: the ``codec``, what codec ``sparseloco`` keeps
    (``sparse``; None: `sparse.SparseSpec`'s defaults) and the ``checksum`` algorithm of the data
    section (None: :func:`checksums.default_checksum`; signed payloads are always sha256)."""

    codec: codecs.CodecName = codecs.DEFAULT
    sparse: codecs.SparseSpec | None = None
    checksum: str | None = None


def encode_contribution(
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    step: int,
    tokens: int | None,
    inner_steps: int | None,
    encoding: Encoding,
    extra: Mapping[str, object] | None = None,
    writer: str | None = None,
    keys: RunKeys | None = None,
) -> tuple[list[wire.Buffer], Contribution]:
    """Encode ``tensors`` as a safetensors payload (header + zero-copy data buffers).

    Returns the payload as a list of buffers (``b"".join`` gives the file) and the same data as
    a Contribution, written as ``encoding`` says. The header's ``checksum`` is ``{"algo": ...,
    "value": ...}`` of the data section (``keys``: sha256, signed). ``extra`` (a JSON object) is
    stored in the header as is (covered by the signature) and returned in ``Contribution.extra``.
    """
    codec, checksum = encoding.codec, encoding.checksum
    if keys is not None and checksum not in (None, "sha256"):
        raise ValueError(f"signed contributions are checksummed with sha256, not {checksum!r}")
    if keys is not None:
        checksum = "sha256"
    algo = checksums.default_checksum() if checksum is None else checksums.check_checksum(checksum)
    encoder = codecs.configured(codec, encoding.sparse)
    names = sorted(tensors)
    parts: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names):
        for part, t in encoder.encode(tensors[name]).items():
            parts[f"t{i}.{part}"] = t
    entries, buffers = wire.layout(parts)
    digest = checksums.digest(buffers, algo)
    shapes = [list(tensors[n].shape) for n in names]
    dtypes = [dtype_name(tensors[n].dtype) for n in names]
    header = {
        "format": FORMAT,
        "kind": "contribution",
        "rank": rank,
        "step": step,
        "tokens": tokens,
        "inner_steps": inner_steps,
        "codec": codec,
        "names": names,
        "shapes": shapes,
        "dtypes": dtypes,
        "checksum": {"algo": algo, "value": digest},
        "writer": writer,
    }
    if extra:
        header["extra"] = extra
    if keys is not None:
        header = keys.sign(header)
    payload: list[wire.Buffer] = [wire.header_bytes(entries, {HEADER_KEY: json.dumps(header)})]
    payload += buffers
    contrib = Contribution(
        rank=rank,
        step=step,
        tokens=tokens,
        inner_steps=inner_steps,
        codec=codec,
        names=names,
        shapes=shapes,
        dtypes=dtypes,
        digest=digest,
        parts=parts,
        nbytes=sum(memoryview(b).nbytes for b in payload),
        checksum_algo=algo,
        extra=dict(extra or {}),
        writer=writer,
    )
    return payload, contrib


def _opt_nonneg_int(v: object) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def _is_checksum(v: object) -> bool:
    """``{"algo": <known algorithm>, "value": <str>}``, nothing else."""
    return (
        isinstance(v, dict)
        and set(v) == {"algo", "value"}
        and v["algo"] in checksums.CHECKSUMS
        and isinstance(v["value"], str)
    )


def decode_contribution(
    blob: wire.Buffer,
    *,
    step: int,
    rank: int,
    reference: dict[str, tuple[list[int], str]] | None = None,
    keys: RunKeys | None = None,
) -> Contribution:
    """Validate ``blob`` (the object at ``contrib_key(step, rank)``) and return it.

    ``reference`` maps name -> (shape, dtype name) of this replica's own tensors; a contribution
    whose names/shapes/dtypes differ is refused. Raises CorruptContributionError on any problem:
    truncation, foreign or pickled payload, bad checksum, wrong step/rank, wrong shapes/dtypes,
    and with ``keys`` (signing on) a missing or wrong signature (`signing.SignatureError`).
    """
    what = f"contribution of rank {rank} for step {step}"
    meta, parts, data = wire.unframe(blob, what)  # FrameError is a CorruptContributionError
    try:
        h = json.loads(meta[HEADER_KEY])
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise CorruptContributionError(f"{what}: missing or unreadable protocol header") from e
    if not isinstance(h, dict) or h.get("format") != FORMAT or h.get("kind") != "contribution":
        raise CorruptContributionError(f"{what}: not a format-{FORMAT} contribution header")
    if h.get("step") != step or h.get("rank") != rank:
        raise CorruptContributionError(
            f"{what}: header says rank {h.get('rank')!r} step {h.get('step')!r} "
            "(a stale or misplaced object)"
        )
    if keys is not None:  # before anything else: an unsigned object is not looked at further
        keys.verify(h, signers={rank_identity(rank)}, what=what)
        if not isinstance(h.get("checksum"), dict) or h["checksum"].get("algo") != "sha256":
            raise CorruptContributionError(f"{what}: a signed contribution must use sha256")
    if "checksum" not in h:
        raise CorruptContributionError(
            f"{what}: header has no checksum (written by an older version of this package?)"
        )
    checksum = h["checksum"]
    if isinstance(checksum, dict) and checksum.get("algo") not in checksums.CHECKSUMS:
        raise CorruptContributionError(
            f"{what}: unknown checksum algorithm {checksum.get('algo')!r}; this version "
            f"verifies {sorted(checksums.CHECKSUMS)} (was it written by a newer version?)"
        )
    names, shapes, dtypes = h.get("names"), h.get("shapes"), h.get("dtypes")
    ok = (
        isinstance(names, list)
        and isinstance(shapes, list)
        and isinstance(dtypes, list)
        and len(names) == len(shapes) == len(dtypes) > 0
        and all(isinstance(n, str) for n in names)
        and all(
            isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes
        )
        and all(d in DTYPES for d in dtypes)
        and codecs.is_codec_name(h.get("codec"))
        and _is_checksum(h.get("checksum"))
        and _opt_nonneg_int(h.get("tokens"))
        and _opt_nonneg_int(h.get("inner_steps"))
        and isinstance(h.get("extra", {}), dict)
        and (h.get("writer") is None or isinstance(h.get("writer"), str))
    )
    if not ok:
        raise CorruptContributionError(f"{what}: malformed header fields")
    assert isinstance(names, list) and isinstance(shapes, list) and isinstance(dtypes, list)
    if reference is not None:
        theirs = {n: (list(s), d) for n, s, d in zip(names, shapes, dtypes)}
        ours = {n: (list(s), d) for n, (s, d) in reference.items()}
        if theirs != ours:
            diff = sorted(set(theirs) ^ set(ours)) or [
                n for n in sorted(theirs) if theirs[n] != ours[n]
            ]
            raise CorruptContributionError(
                f"{what}: tensor names/shapes/dtypes differ from this replica's "
                f"(first differences: {diff[:5]})"
            )
    algo, value = h["checksum"]["algo"], h["checksum"]["value"]
    try:
        actual = checksums.digest([data], algo)
    except ImportError as e:  # cannot verify it, so cannot use it
        raise CorruptContributionError(f"{what}: cannot verify its checksum: {e}") from None
    if actual != value:
        raise CorruptContributionError(f"{what}: {algo} checksum mismatch (corrupted payload)")
    codec = codecs.get(h["codec"])
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for i, shape in enumerate(shapes):
        try:  # sparseloco parts describe their layout in part "m" (checked here)
            want = codec.expected_parts(math.prod(shape), parts.get(f"t{i}.m"))
        except ValueError as e:
            raise CorruptContributionError(f"{what}: tensor {names[i]!r}: {e}") from None
        for part, spec in want.items():
            expected[f"t{i}.{part}"] = spec
    got = {k: (t.dtype, tuple(t.shape)) for k, t in parts.items()}
    if got != expected:
        raise CorruptContributionError(f"{what}: encoded tensors do not match the header")
    contrib = Contribution(
        rank=rank,
        step=step,
        tokens=h["tokens"],
        inner_steps=h["inner_steps"],
        codec=h["codec"],
        names=names,
        shapes=shapes,
        dtypes=dtypes,
        digest=value,
        parts=parts,
        nbytes=memoryview(blob).nbytes,
        checksum_algo=algo,
        extra=h.get("extra", {}),
        private=not memoryview(blob).readonly,
        writer=h.get("writer"),
    )
    for name, shape, encoded in contrib.encoded():  # scales/offsets: a few values per 2048
        why = codec.check_parts(encoded, math.prod(shape))
        if why is not None:
            raise CorruptContributionError(f"{what}: tensor {name!r}: {why}")
    return contrib


# ----------------------------------------------------------------------------- commit records


def make_commit(
    *,
    step: int,
    world_size: int,
    included: list[Contribution],
    weighting: str,
    committed_by: int,
    excluded: dict[int, str],
    decisions: list[Decision] | None = None,
    aggregate: str = AggregatePolicy.aggregate,
    trim: int = 0,
    keys: RunKeys | None = None,
) -> dict[str, Any]:
    """Build the commit record deciding ``step``: the included ranks, weights, clip scales and
    checksums (``{"algo": ..., "value": ...}`` per rank: readers refuse any object that differs),
    the merge method, and every screening decision. ``decisions`` (contribution_screening.screen)
    give the weights and scales; without them weights are equal or proportional to the tokens."""
    ranks = sorted(c.rank for c in included)
    if decisions is not None:
        chosen = {d.rank: d for d in decisions if d.included}
        if sorted(chosen) != ranks:
            raise ValueError(f"decisions include {sorted(chosen)}, contributions {ranks}")
        weights = {r: chosen[r].weight for r in ranks}
        scales = {r: chosen[r].scale for r in ranks}
    else:
        total = sum(c.tokens or 0 for c in included) if weighting == "tokens" else 0
        if total > 0:
            weights = {c.rank: (c.tokens or 0) / total for c in included}
        else:  # equal weighting (also the fallback when every included replica reports 0 tokens)
            weights = {c.rank: 1.0 / len(included) for c in included}
        scales = {r: 1.0 for r in ranks}
    record = {
        "format": FORMAT,
        "kind": "commit",
        "step": step,
        "world_size": world_size,
        "included_ranks": ranks,
        "weights": {str(r): float(weights[r]) for r in ranks},
        "scales": {str(r): float(scales[r]) for r in ranks},
        "aggregate": aggregate,
        "trim": int(trim),
        "checksums": {str(c.rank): c.checksum for c in included},
        "writers": {str(c.rank): c.writer for c in included},
        "tokens": {str(c.rank): c.tokens for c in included},
        "weighting": weighting,
        "excluded": {str(r): why for r, why in sorted(excluded.items())},
        "decisions": {str(d.rank): d.to_json() for d in decisions or []},
        "committed_by": committed_by,
    }
    return record if keys is None else keys.sign(record)


def parse_commit(
    raw: wire.Buffer, *, step: int, world_size: int, keys: RunKeys | None = None
) -> CommitRecord:
    """Validate a commit record read from the store; returns it with int rank keys.

    With ``keys`` (signing on) the record must be signed by the rank it names as
    ``committed_by`` (a `signing.SignatureError` otherwise).
    """
    what = f"commit record of step {step}"
    try:
        c = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptContributionError(f"{what} is not JSON ({e}); the step cannot complete") from e
    if keys is not None and isinstance(c, dict):
        by = c.get("committed_by")
        if not (isinstance(by, int) and not isinstance(by, bool) and 0 <= by < world_size):
            raise CorruptContributionError(f"{what} names no committing rank of this run")
        keys.verify(c, signers={rank_identity(by)}, what=what)
    ranks = c.get("included_ranks") if isinstance(c, dict) else None
    ok = (
        isinstance(c, dict)
        and c.get("format") == FORMAT
        and c.get("kind") == "commit"
        and c.get("step") == step
        and isinstance(ranks, list)
        and len(ranks) > 0
        and all(isinstance(r, int) and 0 <= r < world_size for r in ranks)
        and ranks == sorted(set(ranks))
        and isinstance(c.get("weights"), dict)
        and isinstance(c.get("checksums"), dict)
        and isinstance(c.get("scales", {}), dict)
        and set(c["weights"]) == set(c["checksums"]) == {str(r) for r in ranks}
        and set(c.get("scales", {})) <= {str(r) for r in ranks}
        and all(_is_weight(w) for w in c["weights"].values())
        and all(_is_weight(w) for w in c.get("scales", {}).values())
        and all(_is_checksum(v) for v in c["checksums"].values())
        and is_rule_name(c.get("aggregate", "mean"))
        and isinstance(c.get("trim", 0), int)
        and 0 <= 2 * c.get("trim", 0) < len(ranks)
    )
    if not ok:
        raise CorruptContributionError(f"{what} is malformed; the step cannot complete")
    c["weights"] = {int(r): w for r, w in c["weights"].items()}
    c["scales"] = {int(r): w for r, w in (c.get("scales") or {}).items()}
    c["checksums"] = {int(r): d for r, d in c["checksums"].items()}
    c["writers"] = {int(r): w for r, w in (c.get("writers") or {}).items()}
    c["excluded"] = {int(r): why for r, why in (c.get("excluded") or {}).items()}
    record: CommitRecord = c  # validated above, rank keys now ints
    return record


def _is_weight(w: object) -> bool:
    return isinstance(w, float) and math.isfinite(w) and w >= 0
