"""Per-replica resume checkpoints: what one replica needs to continue a run bit-exactly.

After every committed outer round (sync mode, one fragment) each replica writes its trainer's
resume state (`ComposerReplicationTrainer.resume_state`: weights, AdamW state, LR scheduler,
data position, python/numpy/torch RNG states, TAID, EMA teacher, channel-3 traces) under the
run prefix; the outer optimizer state and round are the published global state of that round
(``states/global/``). Layout (no pickle anywhere; nothing read back is trusted)::

    resume/rank-<r>/<round:010d>/<nonce>.safetensors   the tensors (exchange.outer_state format)
    resume/rank-<r>/<round:010d>/<nonce>.json          the JSON skeleton of the nested state
    resume/rank-<r>/<round:010d>.json                  the manifest, written LAST

The manifest names both objects with their size and sha256: data written under a fresh key
first and committed by the small manifest afterwards, so a torn checkpoint (killed while
writing) has no manifest and is never seen, and a damaged one (truncated, overwritten, NaN)
fails its checks. `load_replica_state` validates everything (manifest fields, sizes,
checksums, skeleton, finite floating tensors) before returning; the trainer then checks
names/shapes/dtypes against its own model and optimizer.

Decoupled DiLoCo learners keep the same format under ``resume/learner-<r>/<step:010d>...``
(``kind="learner"``; the index is the learner's inner step at a push, see
diloco/decoupled/learner_state.py): `newest_replica_state` returns the newest one that passes every check.

`resume_point` (used by ``train --resume``) picks the newest round R whose global state is
valid and for which EVERY replica has a valid resume state (round 0, the initial weights,
needs none: the replicas start fresh there), warning with one line about each bad object it
skips (when no round after 0 qualifies, the newest valid global round, resumed inexactly); `rollback_to` then removes everything the store holds beyond R (global states, the
exchange's step records, resume states), so the relaunched replicas redo those rounds exactly
as the interrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, get_args

import torch

from composer_replication.exchange.retry import STATE_WRITE_RETRY_S, retry_write
from composer_replication.exchange.signing import RunKeys, SignatureError, rank_identity
from composer_replication.exchange.store import ObjectStore
from composer_replication.json_types import JSONValue

__all__ = [
    "FORMAT",
    "ReplicaStateError",
    "ResumableTrainer",
    "load_replica_state",
    "newest_replica_state",
    "prune_replica_states",
    "replica_state_rounds",
    "resume_plan",
    "resume_point",
    "rollback_to",
    "save_replica_state",
]

log = logging.getLogger(__name__)

FORMAT = 1
PREFIX = "resume"
StateKind = Literal["rank", "learner"]  # sync replicas (by round), decoupled learners (by step)
STATE_KINDS: tuple[StateKind, ...] = get_args(StateKind)
_MANIFEST_RE = re.compile(r"^(\d{10})\.json$")
_NONCE_RE = re.compile(r"^[0-9a-f]{16}$")


class ResumableTrainer(Protocol):
    """The trainer whose resume state a writer saves (`ComposerReplicationTrainer`)."""

    def resume_state(self) -> dict[str, object]:
        """Weights, inner optimizer, LR schedule, data position and RNG states, as
        `save_replica_state` stores them (RuntimeError when there is none to take now)."""
        ...


class ReplicaStateError(ValueError):
    """A resume state that is absent, torn, damaged or not this run's."""


def _rank_prefix(rank: int, kind: StateKind = "rank") -> str:
    if kind not in STATE_KINDS:
        raise ValueError(f"state kind {kind!r} is not one of {list(STATE_KINDS)}")
    return f"{PREFIX}/{kind}-{int(rank)}"


def _manifest_key(rank: int, round: int, kind: StateKind = "rank") -> str:
    return f"{_rank_prefix(rank, kind)}/{round:010d}.json"


def _data_prefix(rank: int, round: int, kind: StateKind = "rank") -> str:
    return f"{_rank_prefix(rank, kind)}/{round:010d}"


def save_replica_state(
    store: ObjectStore,
    *,
    rank: int,
    round: int,
    step: int,
    state: Mapping[str, Any],
    kind: StateKind = "rank",
    keys: RunKeys | None = None,
) -> str:
    """Write `state` (tensors + JSON scalars) for (rank, round) and commit it; returns the
    manifest key. Data first under a fresh nonce, the manifest last. ``kind="learner"``: a
    decoupled learner's state, indexed by its step (``round`` = ``step``). ``keys`` (a signed
    run): the manifest, which holds each object's sha256, is signed with this rank's key."""
    from safetensors.torch import save as st_save

    from composer_replication.exchange.outer_state import encode_state

    tensors, skeleton = encode_state(dict(state))
    # Fresh, unshared copies: safetensors refuses tensors that share storage (tied weights).
    blob = st_save({k: v.clone() for k, v in tensors.items()})
    doc = json.dumps({"skeleton": skeleton}, allow_nan=False).encode()
    nonce = secrets.token_hex(8)
    base = f"{_data_prefix(rank, round, kind)}/{nonce}"
    _retrying(f"{base}.safetensors", lambda: store.put(f"{base}.safetensors", blob))
    _retrying(f"{base}.json", lambda: store.put(f"{base}.json", doc))
    manifest = {
        "format": FORMAT,
        "rank": int(rank),
        "round": int(round),
        "step": int(step),
        "nonce": nonce,
        "time": time.time(),
        "tensors": {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()},
        "skeleton": {"bytes": len(doc), "sha256": hashlib.sha256(doc).hexdigest()},
    }
    if keys is not None and keys.can_sign:
        manifest = keys.sign(manifest)
    key = _manifest_key(rank, round, kind)
    _retrying(key, lambda: store.put_json(key, manifest))
    # an earlier incarnation's data for this round is no longer referenced (garbage: a delete
    # the store refuses leaves it for the next save or prune)
    try:
        for name in store.list(_data_prefix(rank, round, kind)):
            if not name.startswith(nonce):
                store.delete(f"{_data_prefix(rank, round, kind)}/{name}")
    except OSError as e:
        log.warning("rank %d: an older resume state of %d not deleted yet (%r)", rank, round, e)
    return key


def _retrying(key: str, write: Callable[[], bool | None]) -> None:
    """A resume state's write of ``key``, retried through a store that refuses writes for up to
    `STATE_WRITE_RETRY_S`, then a `StoreTimeoutError` (the replica fails loudly and is
    restarted). Repeating it is safe: the data objects are under a fresh nonce and the
    manifest, written last, is one whole object."""
    retry_write(
        lambda _left: write(),
        what=f"writing the resume state object {key}",
        within_s=STATE_WRITE_RETRY_S,
    )


def replica_state_rounds(store: ObjectStore, rank: int, kind: StateKind = "rank") -> list[int]:
    """Rounds (learners: steps) with a committed (manifest-bearing) resume state of `rank`,
    oldest first."""
    out = []
    for name in store.list(_rank_prefix(rank, kind)):
        m = _MANIFEST_RE.match(name)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def _blob(store: ObjectStore, key: str, spec: JSONValue, what: str) -> bytes:
    if not isinstance(spec, Mapping):
        raise ReplicaStateError(f"{what}: the manifest does not describe {key}")
    raw = store.get(key)
    if raw is None:
        raise ReplicaStateError(f"{what}: {key} is missing")
    data = bytes(raw)
    if len(data) != spec.get("bytes"):
        raise ReplicaStateError(
            f"{what}: {key} has {len(data)} bytes, the manifest says "
            f"{spec.get('bytes')} (truncated?)"
        )
    if hashlib.sha256(data).hexdigest() != spec.get("sha256"):
        raise ReplicaStateError(f"{what}: {key} fails its sha256 checksum")
    return data


def load_replica_state(
    store: ObjectStore,
    *,
    rank: int,
    round: int,
    kind: StateKind = "rank",
    keys: RunKeys | None = None,
) -> dict[str, Any]:
    """The validated resume state of (rank, round); ReplicaStateError saying what is wrong.
    ``keys`` (a signed run): the manifest must be signed by this rank, for this run."""
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    from composer_replication.exchange.outer_state import decode_state

    what = (
        f"resume state of replica {rank} round {round}"
        if kind == "rank"
        else f"resume state of learner {rank} step {round}"
    )
    try:
        manifest = store.get_json(_manifest_key(rank, round, kind))
    except ValueError:
        raise ReplicaStateError(f"{what}: the manifest is not JSON") from None
    if manifest is None:
        raise ReplicaStateError(f"{what}: not in the store")
    if not (
        isinstance(manifest, dict)
        and manifest.get("format") == FORMAT
        and manifest.get("rank") == rank
        and manifest.get("round") == round
        and isinstance(manifest.get("step"), int)
        and isinstance(manifest.get("nonce"), str)
        and _NONCE_RE.match(manifest["nonce"])
    ):
        raise ReplicaStateError(f"{what}: the manifest does not describe this state")
    if keys is not None:
        try:
            keys.verify(manifest, signers=[rank_identity(rank)], what=f"{what}: the manifest")
        except SignatureError as exc:
            raise ReplicaStateError(str(exc)) from None
    base = f"{_data_prefix(rank, round, kind)}/{manifest['nonce']}"
    blob = _blob(store, f"{base}.safetensors", manifest.get("tensors"), what)
    doc = _blob(store, f"{base}.json", manifest.get("skeleton"), what)
    try:
        tensors = st_load(blob)
        skeleton = json.loads(doc)["skeleton"]
        state = decode_state(tensors, skeleton)
    except (SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise ReplicaStateError(f"{what}: unreadable ({exc})") from None
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ReplicaStateError(f"{what}: tensor {name} holds non-finite values")
    if not isinstance(state, dict) or state.get("global_step") != manifest["step"]:
        raise ReplicaStateError(f"{what}: its step does not match the manifest")
    return state


def prune_replica_states(
    store: ObjectStore, rank: int, keep: int, kind: StateKind = "rank"
) -> None:
    """Remove `rank`'s resume states beyond the newest `keep` (manifest first)."""
    rounds = replica_state_rounds(store, rank, kind)
    try:
        for r in rounds[: max(0, len(rounds) - keep)]:
            store.delete(_manifest_key(rank, r, kind))
            store.delete_prefix(_data_prefix(rank, r, kind))
    except OSError as e:  # the store refuses deletes for now: pruned at the next save
        log.warning("rank %d: older resume states not pruned yet (%r)", rank, e)


def newest_replica_state(
    store: ObjectStore,
    rank: int,
    kind: StateKind,
    *,
    check: Callable[[int, Mapping[str, object]], str | None] | None = None,
    warn: Callable[[str], None] | None = None,
    keys: RunKeys | None = None,
) -> tuple[int, str, dict[str, object]] | None:
    """The newest of `rank`'s resume states that passes every check (and `check`: why the
    state of an index is unusable, None when it is fine): (index, manifest key, state), or
    None when none does; `warn` gets one line per state skipped and why."""
    say = warn or log.warning
    for r in reversed(replica_state_rounds(store, rank, kind)):
        try:
            state = load_replica_state(store, rank=rank, round=r, kind=kind, keys=keys)
        except ReplicaStateError as exc:
            say(f"{exc}; skipped")
            continue
        why = None if check is None else check(r, state)
        if why is not None:
            say(f"resume state of {kind} {rank} at {r}: {why}; skipped")
            continue
        return r, _manifest_key(rank, r, kind), state
    return None


def _global_rounds(store: ObjectStore) -> list[int]:
    from composer_replication.exchange.document_format import parse_state_name, state_prefix

    rounds = (parse_state_name(n) for n in store.list(state_prefix("global")))
    return sorted((r for r in rounds if r is not None), reverse=True)


def _global_state_ok(store: ObjectStore, round: int) -> str | None:
    """Why the published global state of `round` is unusable (None when it is fine)."""
    from composer_replication.exchange.contribution_screening import screen_state
    from composer_replication.exchange.document_format import decode_state, state_key
    from composer_replication.exchange.protocol import CorruptContributionError

    blob = store.get(state_key("global", round))
    if blob is None:
        return "missing"
    try:
        tensors, _ = decode_state(blob, name="global", round=round)
    except (CorruptContributionError, ValueError) as exc:
        return str(exc)
    return screen_state(tensors)


def resume_point(
    store: ObjectStore, n_replicas: int, *, warn: Callable[[str], None] | None = None
) -> int:
    """The newest round every replica can resume from exactly; see the module docstring.
    `warn` gets one line per bad object skipped. When no round after 0 has every replica's
    resume state (a run of an older version, all of them damaged), the newest valid global
    round, with a warning: the replicas then continue from its weights with fresh inner state
    rather than lose every round."""
    say = warn or log.warning
    newest_valid: int | None = None
    for r in _global_rounds(store):
        why = _global_state_ok(store, r)
        if why is not None:
            say(f"global state of round {r} is unusable, skipped: {why}")
            continue
        if newest_valid is None:
            newest_valid = r
        if r == 0:
            break
        missing = []
        for rank in range(n_replicas):
            if r not in replica_state_rounds(store, rank):
                missing.append(rank)
                continue
            try:
                load_replica_state(store, rank=rank, round=r)
            except ReplicaStateError as exc:
                say(f"{exc}; skipped")
                missing.append(rank)
        if not missing:
            return r
        log.info("round %d: no usable resume state of replicas %s", r, missing)
    if newest_valid:
        say(
            f"no round has every replica's resume state: resuming from the global state of "
            f"round {newest_valid} with fresh inner optimizer and sampling state (not exact)"
        )
    return newest_valid or 0


def resume_plan(round_: int) -> str:
    """What resuming at `round_` (from `resume_point`) means, for the driver's printout and
    `status`: round 0 is the initial weights, so resuming there starts the run over."""
    if round_ <= 0:
        return (
            "starting over from outer round 0 (no later round has a usable global state "
            "and resume state; every inner step is redone)"
        )
    return (
        f"resuming at outer round {round_} (the newest round every replica saved its exact "
        "state for)"
    )


def rollback_to(store: ObjectStore, round: int, n_replicas: int) -> None:
    """Forget every round after `round`: global states, exchange step records, resume states
    (the relaunched replicas redo those rounds); at round 0 also a damaged initial state."""
    from composer_replication.exchange.document_format import state_key
    from composer_replication.exchange.protocol import HEAD_KEY, step_prefix

    for r in _global_rounds(store):
        if r > round:
            store.delete(state_key("global", r))
    if round == 0 and 0 in _global_rounds(store) and _global_state_ok(store, 0) is not None:
        # starting over: a damaged initial state goes too, so the first replica publishes the
        # initial weights again (put-if-absent) instead of every replica failing to load it
        store.delete(state_key("global", 0))
    for name in store.list("steps"):
        if name.isdigit() and int(name) > round:
            store.delete_prefix(step_prefix(int(name)).rstrip("/"))
    store.delete(HEAD_KEY)  # a hint of a forgotten step would mark the redone ones stale
    for rank in range(n_replicas):
        for r in replica_state_rounds(store, rank):
            if r > round:
                store.delete(_manifest_key(rank, r))
                store.delete_prefix(_data_prefix(rank, r))
