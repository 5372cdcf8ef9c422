"""The object-store protocol of Decoupled DiLoCo: learner pushes, merge records, fragment states.

Learners never wait for each other: each pushes one parameter fragment's pseudo-gradient on its own
clock, and one synchronizer (diloco/decoupled/synchronizer.py, holding the lease in
exchange/lease.py) merges each fragment when enough learners have pushed. Everything they share is
under the run prefix (docs/object-store.md, "Decoupled mode")::

    decoupled/manifest.json                                   fragment layout, learners, codec
    decoupled/push/<p:03d>-<base:010d>-<learner:05d>-<seq:04d>.safetensors   one push
    decoupled/f<p:03d>/merge/<v:010d>.json                    decision producing version v (kept)
    decoupled/f<p:03d>/global/<v:010d>.safetensors            fragment p's global weights at v
    decoupled/f<p:03d>/outer/<v:010d>.safetensors             its outer momentum at v
    decoupled/heads.json                                      newest version per fragment (hint)
    decoupled/learners/<learner:05d>.json                     a learner's progress (step, done)
    decoupled/final.json                                      the run's final versions

- A **push** is a standard contribution (exchange/protocol.py: safetensors, self-describing
  checksum, codec) of fragment p's pseudo-gradient ``global_base - local`` where ``base`` is
  the version of fragment p the learner last loaded. Its header's ``tokens`` / ``inner_steps``
  are the learner's work since it loaded that base (the merge weight); ``extra`` holds the
  fragment, the sequence number, the steps since the learner's previous push of this fragment
  (what goodput counts), the learner's seconds per inner step (the grace window's step time),
  its total step count and whether it is its final push. Pushes are written with put-if-absent
  (a learner that finds its key taken, e.g. after a restart, takes the next ``seq``), so an
  object is never half-visible and never changes.
- A **merge record** (put-if-absent, first writer wins) decides version v of fragment p: which
  pushes it merged with which weights and checksums, which it superseded, dropped or rejected,
  and the aggregation and outer-optimizer settings. Versions v's weights and momentum are a
  deterministic function of version v-1's and the listed pushes, so a synchronizer that died
  between writing the record and the states recomputes them. Records and states of a fragment
  form a chain without gaps; pushes are immutable and a push appears in at most one record.
- ``global/<v>`` and ``outer/<v>`` are full-state snapshots (exchange/document_format.py's format:
  lossless, sha256-checked). Version 0 is the initial weights (written by the first learner,
  put-if-absent) and zero momentum (``outer/0`` absent).
- ``heads.json``, the progress documents and ``final.json`` are overwritten documents: hints
  that are validated and never trusted for more than saying where to look.

Nothing read from the store is unpickled. Every reader validates what it reads and raises
`CorruptContributionError` (naming the object) for anything malformed.

**Signing** (``[security] sign = true``, a handle made with ``keys``): every object above is
signed when written and refused when read unless signed by who may write it (exchange/signing.py):
a push by its learner's key (``rank-<learner>``), the manifest and version 0 of a fragment by
any learner, merge records, versions > 0, momentum, ``heads.json`` and ``final.json`` by the
synchronizer, a progress document by its learner (or the driver, which releases a learner that
failed for good), refusal records by the synchronizer, a learner or the driver. The signed
fields bind the object to its key (fragment, version, learner, base, seq), so a correctly signed
object copied to another key (a push re-uploaded under a later name, an old merge record
replayed at the next version) is refused too. Every refused object is recorded, with why, under
``decoupled/refused/`` (`write_rejection`; the driver turns these records into "rejected"
events), and a forged merge record or state squatting a key the synchronizer is about to write
is replaced by the real one (the lease holder is the only legitimate writer there).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from composer_replication.exchange import checksums, codecs, document_format, wire
from composer_replication.exchange.protocol import (
    Encoding,
    decode_contribution,
    encode_contribution,
)
from composer_replication.exchange.signing import (
    DRIVER,
    SYNCHRONIZER,
    RunKeys,
    SignatureError,
    rank_identity,
)
from composer_replication.exchange.store import Store
from composer_replication.exchange.vocabulary import (
    DTYPES,
    Contribution,
    CorruptContributionError,
    ModelMismatchError,
    dtype_name,
)

__all__ = [
    "FINAL_KEY",
    "HEADS_KEY",
    "MANIFEST_KEY",
    "PUSH_PREFIX",
    "REFUSED_PREFIX",
    "DecoupledStore",
    "Push",
    "PushId",
    "Refusal",
    "fragment_manifest",
    "parse_merge",
]

FORMAT = 1
PREFIX = "decoupled/"
MANIFEST_KEY = "decoupled/manifest.json"
HEADS_KEY = "decoupled/heads.json"
FINAL_KEY = "decoupled/final.json"
PUSH_PREFIX = "decoupled/push/"
REFUSED_PREFIX = "decoupled/refused/"  # <push name>.json: a push used up without a merge
_PUSH_RE = re.compile(r"^(\d{3})-(\d{10})-(\d{5})-(\d{4})\.safetensors$")
MAX_FRAGMENTS = 1000
MAX_LEARNERS = 100_000
MAX_SEQ = 10_000

log = logging.getLogger(__name__)


def _nonneg_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


class Refusal(TypedDict):
    """One refusal record as `DecoupledStore.read_rejections` reads it: the key refused, why,
    who refused it and, for a push, its learner (else None)."""

    object: str
    reason: str
    by: str
    learner: int | None


@dataclass(frozen=True, order=True)
class PushId:
    """Where a push lives: fragment, the global version it is based on, learner, sequence."""

    fragment: int
    base: int
    learner: int
    seq: int

    def __post_init__(self) -> None:
        ok = (
            _nonneg_int(self.fragment)
            and self.fragment < MAX_FRAGMENTS
            and _nonneg_int(self.base)
            and self.base < 10**10
            and _nonneg_int(self.learner)
            and self.learner < MAX_LEARNERS
            and _nonneg_int(self.seq)
            and self.seq < MAX_SEQ
        )
        if not ok:
            raise ValueError(f"invalid push id {self!r}")

    @property
    def name(self) -> str:
        return f"{self.fragment:03d}-{self.base:010d}-{self.learner:05d}-{self.seq:04d}.safetensors"

    @property
    def key(self) -> str:
        return PUSH_PREFIX + self.name

    @classmethod
    def parse(cls, name: str) -> PushId | None:
        """``'002-0000000007-00003-0000.safetensors'`` -> PushId; anything else -> None."""
        m = _PUSH_RE.match(name)
        return None if m is None else cls(*(int(g) for g in m.groups()))


def _fragment_dir(fragment: int) -> str:
    return f"{PREFIX}f{fragment:03d}/"


def merge_key(fragment: int, version: int) -> str:
    return f"{_fragment_dir(fragment)}merge/{version:010d}.json"


def global_key(fragment: int, version: int) -> str:
    return f"{_fragment_dir(fragment)}global/{version:010d}.safetensors"


def outer_key(fragment: int, version: int) -> str:
    return f"{_fragment_dir(fragment)}outer/{version:010d}.safetensors"


def progress_key(learner: int) -> str:
    return f"{PREFIX}learners/{learner:05d}.json"


def _parse_version(name: str, ext: str) -> int | None:
    stem, dot, e = name.partition(".")
    return int(stem) if dot and e == ext and stem.isdigit() and len(stem) == 10 else None


# ----------------------------------------------------------------------------- pushes


@dataclass
class Push:
    """A validated push: its id, the contribution (encoded tensors) and the work behind it."""

    id: PushId
    contribution: Contribution
    steps: int  # inner steps since the learner loaded version `base` of this fragment
    tokens: int | None  # tokens since then (None: not reported)
    steps_since_push: int  # inner steps since this learner's previous push of this fragment
    # or since a newer global replaced the fragment, whichever is later: the work it adds
    step_seconds: float  # the learner's recent seconds per inner step
    learner_step: int  # the learner's total inner steps when it pushed
    final: bool  # the learner's last push of this fragment
    time: float  # the learner's wall clock when it pushed

    @property
    def checksum(self) -> dict[str, str]:
        return self.contribution.checksum

    def decode(self) -> dict[str, torch.Tensor]:
        return self.contribution.decode()


def encode_push(
    tensors: dict[str, torch.Tensor],
    pid: PushId,
    *,
    steps: int,
    tokens: int | None,
    steps_since_push: int,
    step_seconds: float,
    learner_step: int,
    final: bool = False,
    encoding: Encoding = Encoding(),
    keys: RunKeys | None = None,
) -> list[wire.Buffer]:
    """The payload of a push (a list of buffers; ``b"".join`` gives the object), written as
    ``encoding`` says."""
    if not _nonneg_int(steps) or not _nonneg_int(steps_since_push) or not _nonneg_int(learner_step):
        raise ValueError("steps, steps_since_push and learner_step must be ints >= 0")
    if not _finite(step_seconds) or step_seconds < 0:
        raise ValueError(f"step_seconds must be a finite number >= 0, got {step_seconds!r}")
    extra = {
        "fragment": pid.fragment,
        "seq": pid.seq,
        "steps_since_push": steps_since_push,
        "step_seconds": float(step_seconds),
        "learner_step": learner_step,
        "final": bool(final),
        "time": time.time(),
    }
    payload, _ = encode_contribution(
        tensors,
        rank=pid.learner,
        step=pid.base,
        tokens=tokens,
        inner_steps=steps,
        encoding=encoding,
        extra=extra,
        keys=keys,
    )
    return payload


def decode_push(
    blob: wire.Buffer,
    pid: PushId,
    reference: dict[str, tuple[list[int], str]] | None,
    keys: RunKeys | None = None,
) -> Push:
    """Validate the object at ``pid.key`` (CorruptContributionError says what is wrong; with
    ``keys`` it must be signed by learner ``pid.learner``'s key)."""
    what = f"push {pid.name}"
    c = decode_contribution(blob, step=pid.base, rank=pid.learner, reference=reference, keys=keys)
    x = c.extra
    ok = (
        x.get("fragment") == pid.fragment
        and x.get("seq") == pid.seq
        and _nonneg_int(x.get("steps_since_push"))
        and _finite(x.get("step_seconds"))
        and x["step_seconds"] >= 0
        and _nonneg_int(x.get("learner_step"))
        and isinstance(x.get("final"), bool)
        and _finite(x.get("time"))
        and _nonneg_int(c.inner_steps)
    )
    if not ok:
        raise CorruptContributionError(
            f"{what}: header fields do not describe this push (fragment/seq/steps/timing)"
        )
    return Push(
        id=pid,
        contribution=c,
        steps=int(c.inner_steps or 0),
        tokens=c.tokens,
        steps_since_push=x["steps_since_push"],
        step_seconds=float(x["step_seconds"]),
        learner_step=x["learner_step"],
        final=x["final"],
        time=float(x["time"]),
    )


# ----------------------------------------------------------------------------- manifest


def fragment_manifest(
    fragments: list[dict[str, torch.Tensor]],
    *,
    n_learners: int,
    codec: str,
    mean_only: list[list[str]] | None = None,
) -> dict[str, Any]:
    """The decoupled run manifest: per fragment its tensor names/shapes/dtypes (and the names
    merged by plain mean under ``merge='rda'``, e.g. embeddings), the learners and the codec."""
    if not fragments or any(not f for f in fragments):
        raise ValueError("need at least one fragment, each with at least one tensor")
    if not _nonneg_int(n_learners) or n_learners < 1:
        raise ValueError(f"n_learners must be an int >= 1, got {n_learners!r}")
    mean_only = mean_only or [[] for _ in fragments]
    out = []
    for f, mo in zip(fragments, mean_only):
        names = sorted(f)
        out.append(
            {
                "names": names,
                "shapes": [list(f[n].shape) for n in names],
                "dtypes": [dtype_name(f[n].dtype) for n in names],
                "mean_only": sorted(set(mo) & set(names)),
            }
        )
    return {
        "format": FORMAT,
        "kind": "decoupled-manifest",
        "n_learners": n_learners,
        "codec": codecs.check_codec(codec),
        "fragments": out,
    }


def _check_manifest(doc: object) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise CorruptContributionError(f"{MANIFEST_KEY} is not a valid decoupled-run manifest")
    ok = (
        doc.get("format") == FORMAT
        and doc.get("kind") == "decoupled-manifest"
        and _nonneg_int(doc.get("n_learners"))
        and doc["n_learners"] >= 1
        and codecs.is_codec_name(doc.get("codec"))
        and isinstance(doc.get("fragments"), list)
        and 0 < len(doc["fragments"]) <= MAX_FRAGMENTS
    )
    if ok:
        for f in doc["fragments"]:
            ok = ok and (
                isinstance(f, dict)
                and isinstance(f.get("names"), list)
                and isinstance(f.get("shapes"), list)
                and isinstance(f.get("dtypes"), list)
                and len(f["names"]) == len(f["shapes"]) == len(f["dtypes"]) > 0
                and all(isinstance(n, str) for n in f["names"])
                and all(isinstance(s, list) and all(_nonneg_int(d) for d in s) for s in f["shapes"])
                and all(d in DTYPES for d in f["dtypes"])
                and isinstance(f.get("mean_only", []), list)
            )
    if not ok:
        raise CorruptContributionError(f"{MANIFEST_KEY} is not a valid decoupled-run manifest")
    return doc


def _reference(fragment: dict[str, Any]) -> dict[str, tuple[list[int], str]]:
    return {
        n: (list(s), d)
        for n, s, d in zip(fragment["names"], fragment["shapes"], fragment["dtypes"])
    }


# ----------------------------------------------------------------------------- merge records


def parse_merge(
    raw: wire.Buffer, *, fragment: int, version: int, keys: RunKeys | None = None
) -> dict[str, Any]:
    """Validate a merge record read from ``merge_key(fragment, version)``.

    A record holds ``inputs`` (the pushes handed to the aggregation, each with its name, raw
    weight and pinned checksum), ``decisions`` (per input: included or why not, its final
    weight and clip scale), ``consumed`` (every push this record uses up: inputs, superseded
    and dropped ones), the ``merge`` / ``aggregate`` methods and the ``outer`` optimizer
    settings. With ``keys`` (signing on) it must be signed by the synchronizer's key.
    """
    what = f"merge record of fragment {fragment} version {version}"
    try:
        r = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptContributionError(f"{what} is not JSON ({e})") from None
    if not isinstance(r, dict):
        raise CorruptContributionError(f"{what} is malformed")
    if keys is not None:
        keys.verify(r, signers={SYNCHRONIZER}, what=what)
    if (r.get("fragment"), r.get("version")) != (fragment, version):
        raise CorruptContributionError(
            f"{what}: the record says fragment {r.get('fragment')!r} version "
            f"{r.get('version')!r} (replayed from another key?)"
        )
    inputs = r.get("inputs")
    ok = (
        r.get("format") == FORMAT
        and r.get("kind") == "merge"
        and r.get("fragment") == fragment
        and r.get("version") == version
        and isinstance(inputs, list)
        and len(inputs) > 0
        and isinstance(r.get("merge"), str)
        and isinstance(r.get("aggregate"), str)
        and isinstance(r.get("outer"), dict)
        and _finite(r["outer"].get("lr"))
        and _finite(r["outer"].get("momentum"))
        and isinstance(r["outer"].get("nesterov"), bool)
        and isinstance(r.get("consumed"), list)
        and all(isinstance(k, str) for k in r["consumed"])
        and isinstance(r.get("decisions"), dict)
    )
    if ok:
        assert isinstance(inputs, list)
        for entry in inputs:
            ok = ok and (
                isinstance(entry, dict)
                and isinstance(entry.get("push"), str)
                and PushId.parse(entry["push"]) is not None
                and _finite(entry.get("weight"))
                and entry["weight"] >= 0
                and isinstance(entry.get("checksum"), dict)
                and set(entry["checksum"]) == {"algo", "value"}
                and entry["checksum"]["algo"] in checksums.CHECKSUMS
                and isinstance(entry["checksum"]["value"], str)
                and entry["push"] in r["consumed"]
            )
    if not ok:
        raise CorruptContributionError(f"{what} is malformed")
    return r


# ----------------------------------------------------------------------------- the store


class DecoupledStore:
    """Decoupled DiLoCo's documents in one run prefix (see the module docstring).

    ``codec`` and ``checksum`` are what this handle writes pushes with; readers verify what each
    header names. ``keys`` (signing on): what this handle writes is signed with them and what
    it reads must be signed by who may write it (see the module docstring).
    """

    def __init__(
        self,
        store: Store,
        *,
        codec: str = codecs.DEFAULT,
        checksum: str | None = None,
        keys: RunKeys | None = None,
    ) -> None:
        self.store = store
        self.keys = keys
        self._reported: set[str] = set()
        self.codec = codecs.check_codec(codec)
        if codecs.get(codec).needs_error_feedback:
            usable = [c for c in codecs.names() if not codecs.get(c).needs_error_feedback]
            raise ValueError(
                f"codec {codec!r} is not for decoupled pushes: it drops most of each push and "
                "relies on the sender's error feedback, which decoupled pushes (each the whole "
                "change since the learner's base version, possibly replaced in the queue) would "
                f"count twice; use {'/'.join(usable)}, or mode 'sync' for this codec"
            )
        if keys is not None and checksum not in (None, "sha256"):
            raise ValueError(f"signed pushes are checksummed with sha256, not {checksum!r}")
        if keys is not None:
            checksum = "sha256"  # a signature over a non-cryptographic checksum binds nothing
        self.checksum = (
            checksums.default_checksum() if checksum is None else checksums.check_checksum(checksum)
        )
        self.encoding = Encoding(self.codec, checksum=self.checksum)

    # ------------------------------------------------------------------ signatures
    def _sign(self, doc: dict[str, Any]) -> dict[str, Any]:
        return doc if self.keys is None else self.keys.sign(doc)

    def _verified(self, key: str, doc: dict[str, Any], signers: set[str], what: str) -> bool:
        """True when signing is off or ``doc`` is signed by one of ``signers``; otherwise the
        refusal is recorded (`write_rejection`) and False."""
        if self.keys is None:
            return True
        try:
            self.keys.verify(doc, signers=signers, what=what)
        except SignatureError as e:
            self.write_rejection(key, str(e))
            return False
        return True

    @property
    def uri(self) -> str:
        return self.store.uri

    # ------------------------------------------------------------------ manifest
    def read_manifest(self) -> dict[str, Any] | None:
        raw = self.store.get(MANIFEST_KEY)
        if raw is None:
            return None
        try:
            doc = json.loads(bytes(raw))
        except (UnicodeDecodeError, json.JSONDecodeError):
            doc = None
        if self.keys is not None and isinstance(doc, dict):
            try:
                self.keys.verify(doc, signers={"rank-*"}, what=f"{MANIFEST_KEY} at {self.uri}")
            except SignatureError as e:
                self.write_rejection(MANIFEST_KEY, str(e))
                raise
        return _check_manifest(doc)

    def ensure_manifest(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Write ``manifest`` if absent; ModelMismatchError naming the differences if the stored
        one describes another fragment layout, learner count or codec."""
        ours = json.loads(json.dumps(_check_manifest(manifest), sort_keys=True))
        if self.keys is not None and self.keys.can_sign:
            ours = self.keys.sign(ours)
        self.store.put_if_absent(MANIFEST_KEY, json.dumps(ours, sort_keys=True).encode())
        stored = self.read_manifest()
        if stored is None:
            raise CorruptContributionError(f"wrote {MANIFEST_KEY} at {self.uri} but cannot read it")
        diff = [k for k in ("n_learners", "codec") if stored.get(k) != ours.get(k)]
        if len(stored["fragments"]) != len(ours["fragments"]):
            diff.append(
                f"fragments: stored {len(stored['fragments'])}, this learner "
                f"{len(ours['fragments'])}"
            )
        else:
            for i, (a, b) in enumerate(zip(stored["fragments"], ours["fragments"])):
                if a != b:
                    diff.append(f"fragment {i}: tensor names/shapes/dtypes differ")
        if diff:
            raise ModelMismatchError(
                f"this learner does not match the decoupled run at {self.uri}: {diff[:5]}; use "
                "a new run prefix or the model/num_fragments/learners/codec it was started with"
            )
        return stored

    @staticmethod
    def reference(manifest: dict[str, Any], fragment: int) -> dict[str, tuple[list[int], str]]:
        """name -> (shape, dtype name) of ``fragment`` (what its pushes must match)."""
        return _reference(manifest["fragments"][fragment])

    # ------------------------------------------------------------------ fragment states
    def _encode_state(
        self, kind: str, fragment: int, version: int, tensors: dict[str, torch.Tensor]
    ) -> bytes:
        return document_format.encode_state(
            tensors, name=f"f{fragment:03d}", round=version, extra={"kind": kind}, keys=self.keys
        )

    def _publish(
        self, key: str, kind: str, fragment: int, version: int, tensors: dict[str, torch.Tensor]
    ) -> bool:
        return self.store.put_if_absent(key, self._encode_state(kind, fragment, version, tensors))

    def _fetch(
        self,
        key: str,
        kind: str,
        fragment: int,
        version: int,
        reference: dict[str, tuple[list[int], str]] | None,
    ) -> dict[str, torch.Tensor] | None:
        blob = self.store.get(key)
        if blob is None:
            return None
        # version 0 of the weights is written by the first learner, every later state by the
        # synchronizer
        signers = {"rank-*"} if kind == "global" and version == 0 else {SYNCHRONIZER}
        try:
            tensors, extra = document_format.decode_state(
                blob, name=f"f{fragment:03d}", round=version, keys=self.keys, signers=signers
            )
        except SignatureError as e:
            self.write_rejection(key, str(e))
            raise
        if extra.get("kind") != kind:
            raise CorruptContributionError(f"{key}: not a {kind} state")
        if reference is not None:
            got = {n: (list(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()}
            if got != reference:
                raise CorruptContributionError(f"{key}: tensors differ from the run manifest")
        return tensors

    def publish_global(self, fragment: int, version: int, tensors: dict[str, torch.Tensor]) -> bool:
        """put-if-absent fragment ``fragment``'s global weights at ``version``."""
        return self._publish(global_key(fragment, version), "global", fragment, version, tensors)

    def fetch_global(
        self, fragment: int, version: int, reference: dict[str, tuple[list[int], str]] | None
    ) -> dict[str, torch.Tensor] | None:
        """The validated global weights (None if absent; CorruptContributionError if bad)."""
        return self._fetch(global_key(fragment, version), "global", fragment, version, reference)

    def publish_outer(self, fragment: int, version: int, tensors: dict[str, torch.Tensor]) -> bool:
        return self._publish(outer_key(fragment, version), "outer", fragment, version, tensors)

    def fetch_outer(
        self, fragment: int, version: int, reference: dict[str, tuple[list[int], str]] | None
    ) -> dict[str, torch.Tensor] | None:
        return self._fetch(outer_key(fragment, version), "outer", fragment, version, reference)

    def repair_global(self, fragment: int, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite a global state found corrupt (or forged) with its recomputed content."""
        self.store.put(
            global_key(fragment, version), self._encode_state("global", fragment, version, tensors)
        )

    def repair_outer(self, fragment: int, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite a momentum state found corrupt (or forged) with its recomputed content."""
        self.store.put(
            outer_key(fragment, version), self._encode_state("outer", fragment, version, tensors)
        )

    def versions(self, fragment: int, what: str = "global") -> list[int]:
        """Stored versions of ``what`` ('global', 'outer' or 'merge') of a fragment (one LIST)."""
        ext = "json" if what == "merge" else "safetensors"
        names = self.store.list(f"{_fragment_dir(fragment)}{what}/")
        return sorted(v for v in (_parse_version(n, ext) for n in names) if v is not None)

    # ------------------------------------------------------------------ heads (a hint)
    def read_heads(self, n_fragments: int) -> list[int] | None:
        """Newest version per fragment as last announced, or None (absent or invalid)."""
        raw = self.store.get(HEADS_KEY)
        if raw is None:
            return None
        try:
            doc = json.loads(bytes(raw))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        v = doc.get("versions") if isinstance(doc, dict) else None
        if isinstance(doc, dict) and not self._verified(HEADS_KEY, doc, {SYNCHRONIZER}, HEADS_KEY):
            return None
        if (
            not isinstance(doc, dict)
            or doc.get("kind") != "heads"
            or not isinstance(v, list)
            or len(v) != n_fragments
            or not all(_nonneg_int(x) for x in v)
        ):
            return None
        return list(v)

    def write_heads(self, versions: list[int], **info: Any) -> None:
        self.store.put_json(
            HEADS_KEY,
            self._sign(
                {
                    "format": FORMAT,
                    "kind": "heads",
                    "versions": list(versions),
                    "time": time.time(),
                    **info,
                }
            ),
        )

    # ------------------------------------------------------------------ pushes
    def push(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        fragment: int,
        base: int,
        learner: int,
        seq: int,
        **fields: Any,
    ) -> tuple[PushId, int]:
        """Write a push with put-if-absent, taking the next free ``seq`` if the key is taken
        (an earlier incarnation of this learner pushed at the same base). Returns its id and
        its size in bytes."""
        payload = encode_push(
            tensors,
            PushId(fragment, base, learner, seq),
            encoding=self.encoding,
            keys=self.keys,
            **fields,
        )
        for s in range(seq, MAX_SEQ):
            pid = PushId(fragment, base, learner, s)
            if s != seq:  # the header names the seq: re-encode for the new key
                payload = encode_push(
                    tensors, pid, encoding=self.encoding, keys=self.keys, **fields
                )
            if self.store.put_if_absent(pid.key, payload):
                return pid, sum(memoryview(b).nbytes for b in payload)
        raise RuntimeError(
            f"learner {learner}: {MAX_SEQ} pushes of fragment {fragment} at "
            f"base {base}; the run is not making progress"
        )

    def list_pushes(self) -> list[PushId]:
        """Every push in the store (one LIST), sorted."""
        return sorted(p for p in map(PushId.parse, self.store.list(PUSH_PREFIX)) if p is not None)

    def fetch_push(
        self, pid: PushId, reference: dict[str, tuple[list[int], str]] | None
    ) -> tuple[Push | str | None, int]:
        """(the validated push, or why it is refused, or None if absent; bytes read)."""
        raw = self.store.get(pid.key)
        if raw is None:
            return None, 0
        try:
            return decode_push(raw, pid, reference, self.keys), len(raw)
        except CorruptContributionError as e:
            return str(e), len(raw)

    def delete_push(self, pid: PushId) -> None:
        self.store.delete(pid.key)

    def write_refusal(self, pid: PushId, reason: str) -> None:
        """Record (put-if-absent, kept for good: the run's audit trail) that a push was used up
        without a merge record naming it, with why: refused (it does not decode or verify), or
        dropped or screened out when no merge happened. So that an audit can tell such a push
        from one the synchronizer never looked at."""
        doc = {
            "format": FORMAT,
            "kind": "refused",
            "push": pid.name,
            "object": pid.key,
            "reason": str(reason)[:2000],
            "time": time.time(),
        }
        self.store.put_if_absent(
            f"{REFUSED_PREFIX}{pid.name}.json", json.dumps(self._sign(doc)).encode()
        )

    def write_rejection(self, key: str, reason: str) -> None:
        """Record (put-if-absent, once per object and writer) that this participant refused the
        object at ``key`` (not a push the synchronizer consumes: a forged or replayed merge
        record, state or document), with why. Only a handle that can sign writes it (a
        verify-only reader, e.g. an audit, records nothing); a store error is logged, never
        raised (the refusal itself stands)."""
        if self.keys is None or not self.keys.can_sign or key in self._reported:
            return
        self._reported.add(key)
        by = str(self.keys.identity)
        slug = key.removeprefix(PREFIX).replace("/", "_")
        doc = {
            "format": FORMAT,
            "kind": "refused",
            "object": key,
            "by": by,
            "reason": str(reason)[:2000],
            "time": time.time(),
        }
        try:
            self.store.put_if_absent(
                f"{REFUSED_PREFIX}{slug}.{by}.json", json.dumps(self._sign(doc)).encode()
            )
        except OSError as e:
            log.warning("recording the refusal of %s failed: %r", key, e)

    def _refusal_docs(self, skip: Collection[str] = ()) -> list[tuple[str, dict[str, Any]]]:
        """(record name, record) of every well-formed refusal record not named in ``skip``
        (with keys: signed by the synchronizer, a learner or the driver)."""
        out = []
        for name in self.store.list(REFUSED_PREFIX):
            if name in skip:
                continue
            try:
                doc = self.store.get_json(REFUSED_PREFIX + name)
            except ValueError:
                continue
            if not (
                isinstance(doc, dict)
                and doc.get("kind") == "refused"
                and isinstance(doc.get("reason"), str)
            ):
                continue
            if self.keys is not None:
                try:
                    self.keys.verify(doc, signers={SYNCHRONIZER, DRIVER, "rank-*"}, what=name)
                except SignatureError:
                    continue
            out.append((name, doc))
        return out

    def read_refusals(self) -> dict[str, str]:
        """push name -> why it was refused, for every refusal record of a push (malformed
        records are skipped: they refuse nothing)."""
        out: dict[str, str] = {}
        for name, doc in self._refusal_docs():
            if (
                isinstance(doc.get("push"), str)
                and name == f"{doc['push']}.json"
                and PushId.parse(doc["push"]) is not None
            ):
                out[doc["push"]] = doc["reason"]
        return out

    def read_rejections(self, skip: Collection[str] = ()) -> dict[str, Refusal]:
        """Every refusal record (pushes and other objects) not named in ``skip`` (one LIST, one
        GET per record read), by record name: ``object`` (the key refused), ``reason``, ``by``
        (who refused it) and ``learner`` (a push's learner, else None)."""
        out: dict[str, Refusal] = {}
        for name, doc in self._refusal_docs(skip):
            push = PushId.parse(doc["push"]) if isinstance(doc.get("push"), str) else None
            out[name] = {
                "object": str(doc.get("object") or (push.key if push else name)),
                "reason": doc["reason"],
                "by": str(doc.get("by") or SYNCHRONIZER),
                "learner": None if push is None else push.learner,
            }
        return out

    # ------------------------------------------------------------------ merge records
    def write_merge(self, record: dict[str, Any]) -> bool:
        """put-if-absent the record (signed with keys); False if that version was decided
        already. With signing on, a record at that key that does not verify (forged, or
        replayed from another key) decides nothing: it is recorded as refused and replaced."""
        fragment, version = record["fragment"], record["version"]
        record = self._sign(record)
        raw = json.dumps(record, sort_keys=True, allow_nan=False).encode()
        parse_merge(raw, fragment=fragment, version=version, keys=self.keys)  # our own check
        key = merge_key(fragment, version)
        if self.store.put_if_absent(key, raw):
            return True
        if self.keys is None:
            return False
        try:
            self.read_merge(fragment, version)
        except CorruptContributionError as e:
            log.warning("%s; replacing it with this synchronizer's record", e)
            self.store.put(key, raw)
            return True
        return False

    def delete_merge(self, fragment: int, version: int) -> None:
        """Delete a merge record that decided nothing (forged or replayed: the synchronizer's
        recovery, signing on)."""
        self.store.delete(merge_key(fragment, version))

    def read_merge(self, fragment: int, version: int) -> dict[str, Any] | None:
        key = merge_key(fragment, version)
        raw = self.store.get(key)
        if raw is None:
            return None
        try:
            return parse_merge(raw, fragment=fragment, version=version, keys=self.keys)
        except CorruptContributionError as e:
            self.write_rejection(key, str(e))
            raise

    # ------------------------------------------------------------------ progress and the end
    def write_progress(self, learner: int, **doc: Any) -> None:
        self.store.put_json(
            progress_key(learner),
            self._sign(
                {
                    "format": FORMAT,
                    "kind": "progress",
                    "learner": learner,
                    "time": time.time(),
                    **doc,
                }
            ),
        )

    def read_progress(self, learner: int) -> dict[str, Any] | None:
        """A learner's progress document (None if absent or invalid: step 0, not done)."""
        try:
            doc = self.store.get_json(progress_key(learner))
        except ValueError:
            return None
        signers = {rank_identity(learner), DRIVER}  # the driver releases a failed learner
        if isinstance(doc, dict) and not self._verified(
            progress_key(learner), doc, signers, f"progress of learner {learner}"
        ):
            return None
        ok = (
            isinstance(doc, dict)
            and doc.get("kind") == "progress"
            and doc.get("learner") == learner
            and _nonneg_int(doc.get("step"))
            and isinstance(doc.get("done"), bool)
        )
        return doc if ok and isinstance(doc, dict) else None

    def write_final(self, versions: list[int], learners: dict[int, int], **info: Any) -> None:
        self.store.put_json(
            FINAL_KEY,
            self._sign(
                {
                    "format": FORMAT,
                    "kind": "final",
                    "versions": versions,
                    "learners": {str(k): v for k, v in learners.items()},
                    "time": time.time(),
                    **info,
                }
            ),
        )

    def read_final(self, n_fragments: int) -> dict[str, Any] | None:
        """The final document (versions per fragment, learners' final steps) or None."""
        try:
            doc = self.store.get_json(FINAL_KEY)
        except ValueError:
            return None
        if not isinstance(doc, dict) or not self._verified(
            FINAL_KEY, doc, {SYNCHRONIZER}, FINAL_KEY
        ):
            return None
        ok = (
            doc.get("kind") == "final"
            and isinstance(doc.get("versions"), list)
            and len(doc["versions"]) == n_fragments
            and all(_nonneg_int(v) for v in doc["versions"])
            and isinstance(doc.get("learners"), dict)
            and all(_nonneg_int(v) for v in doc["learners"].values())
        )
        if not ok:
            return None
        doc["learners"] = {int(k): v for k, v in doc["learners"].items() if k.isdigit()}
        return doc

    def clear_final(self) -> None:
        self.store.delete(FINAL_KEY)

    # ------------------------------------------------------------------ housekeeping
    def gc(self, fragment: int, version: int, keep: int, pushes: list[PushId]) -> list[PushId]:
        """Delete fragment ``fragment``'s pushes based on versions < version - keep (from
        ``pushes``, the ones the caller knows), then its states older than that. Merge records
        are kept: they are small (about 1-2 KB each) and are the run's audit trail (every merge
        with its inputs and weights); a push left in the store is covered by the records of
        the versions after its base, which a restarted synchronizer reads. Returns the pushes
        deleted."""
        floor = version - keep
        gone = [p for p in pushes if p.fragment == fragment and p.base < floor]
        for p in gone:
            self.store.delete(p.key)
        for what, key in (("global", global_key), ("outer", outer_key)):
            for v in self.versions(fragment, what):
                if 0 < v < floor:  # version 0 (the initial weights) is kept for good
                    self.store.delete(key(fragment, v))
        return gone
