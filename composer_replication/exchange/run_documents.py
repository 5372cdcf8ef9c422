"""`RunDocuments`: writes and reads a run's documents (manifest, state snapshots, small JSON
documents; their format is exchange/document_format.py) through a `Store`.

`RunDocuments` is the base class of :class:`ObjectStoreAllReduce` (kept apart so each module
stays one concept) and usable on its own by anyone holding a `Store` (a driver, the torchft
path's state archive). It owns everything it uses: the store, the run's world size and codec,
how many state rounds to keep, the poll interval and the event that cancels its waits, and
(signing on) the run's keys: then the manifest and every state snapshot are signed when written
and refused when read unless correctly signed (exchange/signing.py). A state with non-finite
values is never published nor loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from composer_replication.exchange import document_format
from composer_replication.exchange.contribution_screening import screen_state
from composer_replication.exchange.protocol import commit_key, parse_commit, parse_step_dir
from composer_replication.exchange.signing import RunKeys, SignatureError
from composer_replication.exchange.store import Store
from composer_replication.exchange.vocabulary import (
    CorruptContributionError,
    ExchangeCancelledError,
    ModelMismatchError,
    StoreTimeoutError,
)
from composer_replication.exchange.wire import Buffer
from composer_replication.json_types import JSONValue

log = logging.getLogger(__name__)


class RunDocuments:
    """Manifest, full-state snapshots and JSON documents stored under the run prefix.

        ``keep_steps``: state rounds older than the newest ``keep_steps`` are deleted when a newer
        one is published. Setting ``cancelled`` aborts `wait_for_json` (and, in ObjectStoreAllReduce,
    every exchange wait).
    """

    def __init__(
        self,
        store: Store,
        *,
        world_size: int,
        codec: str,
        keep_steps: int,
        poll_interval_s: float,
        cancelled: threading.Event | None = None,
        keys: RunKeys | None = None,
        mac_secret: bytes | None = None,
    ) -> None:
        self.store = store
        self.keys = keys
        # unsigned runs: the run's slot secret, which MACs the manifest (`ensure_manifest`)
        self.mac_secret = mac_secret
        # objects read to decide where the run is and refused: (key, why); the manager takes
        # them into its round records ("rejected" events of rank -1)
        self.refusals: list[tuple[str, str]] = []
        self.world_size = world_size
        self.codec = codec
        self.keep_steps = keep_steps
        self.poll_interval_s = poll_interval_s
        self.cancelled = cancelled if cancelled is not None else threading.Event()

    @property
    def uri(self) -> str:
        return self.store.uri

    def latest_committed_step(self) -> int | None:
        """Highest step whose commit record is confirmed (`unconfirmed_commit`), or None. A
        step directory holding a record that does not confirm (planted, malformed, no chain)
        is skipped with a warning."""
        steps = sorted(
            (s for s in map(parse_step_dir, self.store.list("steps/")) if s is not None),
            reverse=True,
        )
        for s in steps:
            if not self.store.exists(commit_key(s)):
                continue
            why = self.unconfirmed_commit(s)
            if why is None:
                return s
            log.warning("not counting step %d as committed: %s", s, why)
        return None

    def unconfirmed_commit(self, step: int) -> str | None:
        """Why ``step`` cannot be believed committed, or None when it can: its commit record
        exists and is well formed (signing on: signed by the rank it names), and so is the
        previous step's (the chain: the committer of step s deletes step s - ``keep_steps``
        only, so with ``keep_steps >= 2`` a real commit always has its predecessor beside it;
        a lone record planted far ahead does not; a run rolled back to round r restarts the
        chain from the global state of r, which stands in for its predecessor)."""
        why = self._bad_commit(step)
        if why is not None or step <= 1 or self.keep_steps < 2:
            return why
        before = self._bad_commit(step - 1)
        if before is not None and not self.state_exists(round=step - 1):
            return f"step {step} does not follow a committed step ({before})"
        return None

    def _bad_commit(self, step: int) -> str | None:
        raw = self.store.get(commit_key(step))
        if raw is None:
            return f"step {step} has no commit record"
        try:
            parse_commit(raw, step=step, world_size=self.world_size, keys=self.keys)
        except CorruptContributionError as e:  # SignatureError included
            return str(e)
        return None

    def ensure_manifest(self, fingerprint: dict[str, Any]) -> None:
        """Write the run manifest if absent; raise ModelMismatchError if the stored one differs."""
        ours = json.loads(
            json.dumps(
                {
                    "format": 1,
                    "kind": "manifest",
                    "world_size": self.world_size,
                    "codec": self.codec,
                    "fingerprint": fingerprint,
                },
                sort_keys=True,
            )
        )
        signed = ours if self.keys is None else self.keys.sign(ours)
        if self.keys is None and self.mac_secret is not None:
            signed = {**ours, "mac": self._manifest_mac(ours)}
        raw = json.dumps(signed, sort_keys=True).encode()
        for _ in range(3):  # a planted manifest (unsigned runs with a MAC) is replaced
            if self.store.put_if_absent(document_format.MANIFEST_KEY, raw):
                return
            stored_raw = self.store.get(document_format.MANIFEST_KEY)
            why = self._not_the_runs_manifest(stored_raw)
            if why is None:
                break
            log.warning(
                "run manifest at %s refused (%s): replaced with this replica's", self.uri, why
            )
            self.refusals.append((document_format.MANIFEST_KEY, f"run manifest refused: {why}"))
            self.store.delete(document_format.MANIFEST_KEY)
        try:
            stored = json.loads(bytes(stored_raw or b""))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelMismatchError(f"run manifest at {self.uri} is unreadable ({e})") from e
        if self.keys is not None and isinstance(stored, dict):
            self.keys.verify(stored, signers={"rank-*"}, what=f"run manifest at {self.uri}")
        diff = document_format.manifest_diff(stored, ours)
        if diff:
            raise ModelMismatchError(
                f"this replica does not match the run at {self.uri}:\n  "
                + "\n  ".join(diff)
                + "\nuse a new run prefix or the model/world size/codec the run was started with"
            )

    def _manifest_mac(self, doc: Mapping[str, JSONValue]) -> str:
        assert self.mac_secret is not None
        body = json.dumps({k: v for k, v in doc.items() if k != "mac"}, sort_keys=True)
        return hmac.new(self.mac_secret, b"manifest:" + body.encode(), hashlib.sha256).hexdigest()

    def _not_the_runs_manifest(self, raw: Buffer | None) -> str | None:
        """Unsigned runs with a MAC secret: why the stored manifest was not written by a
        replica of this run (unreadable, no MAC or a wrong one), else None (and always None
        without a secret or with signing on, which has its own check)."""
        if self.keys is not None or self.mac_secret is None or raw is None:
            return None
        try:
            doc = json.loads(bytes(raw))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"not JSON ({e})"
        mac = doc.get("mac") if isinstance(doc, dict) else None
        if not isinstance(mac, str) or not hmac.compare_digest(mac, self._manifest_mac(doc)):
            return "its MAC does not verify (not written by a replica of this run)"
        return None

    def publish_state(
        self,
        state: dict[str, torch.Tensor],
        *,
        round: int,
        name: str = "global",
        extra: Mapping[str, JSONValue] | None = None,
        stride: int = 1,
    ) -> bool:
        """put-if-absent a full state dict for ``round``; False if that round already exists.

        Then deletes, without listing, the rounds that fall out of the newest ``keep_steps``
        (``stride``: the spacing of published rounds, e.g. a checkpoint every 2 rounds).
        Raises ValueError for a state with non-finite values (it would poison every rejoin).
        """
        if not isinstance(state, dict):
            raise ValueError("publish_state(state: dict[str, Tensor], *, round, name, extra)")
        if not isinstance(round, int) or isinstance(round, bool) or not 0 <= round < 10**10:
            raise ValueError(f"round must be an int in [0, 1e10), got {round!r}")
        bad = screen_state(state)
        if bad is not None:
            raise ValueError(f"publish_state: refusing state {name!r} round {round}: {bad}")
        blob = document_format.encode_state(
            state,
            name=document_format.check_state_name(name),
            round=round,
            extra=extra,
            keys=self.keys,
        )
        wrote = self.store.put_if_absent(document_format.state_key(name, round), blob)
        if wrote:
            newest_gone = round - self.keep_steps
            window = range(max(0, newest_gone - max(self.keep_steps, stride) + 1), newest_gone + 1)
            self.store.delete_many([document_format.state_key(name, r) for r in window])
        return wrote

    def fetch_state(
        self, *, name: str = "global", round: int | None = None
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None:
        """(round, tensors, extra) of ``round`` (None = latest), or None if there is none.

        Latest: a damaged state (truncated, checksum, non-finite values) is skipped with a
        one-line warning and the newest good one is returned; the first error is raised when
        none is good. A state with a missing or wrong signature raises at once."""
        if round is None:
            rounds = [
                r
                for r in map(
                    document_format.parse_state_name,
                    self.store.list(document_format.state_prefix(name)),
                )
                if r is not None
            ]
            first: CorruptContributionError | None = None
            for r in sorted(rounds, reverse=True):
                try:
                    found = self._fetch_state(name, r)
                except SignatureError:
                    raise  # a forged state is an attack to report, not damage to route around
                except CorruptContributionError as exc:
                    log.warning("skipping a damaged state (%s); trying an older one", exc)
                    first = first or exc
                    continue
                if found is not None:
                    return found
            if first is not None:
                raise first
            return None
        return self._fetch_state(name, round)

    def _fetch_state(
        self, name: str, round: int
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None:
        blob = self.store.get(document_format.state_key(name, round))
        if blob is None:
            return None
        tensors, extra = document_format.decode_state(blob, name=name, round=round, keys=self.keys)
        bad = screen_state(tensors)
        if bad is not None:
            raise CorruptContributionError(f"state {name!r} round {round} is refused: {bad}")
        return round, tensors, extra

    def state_exists(self, *, name: str = "global", round: int) -> bool:
        """Whether the state of ``round`` is stored (one small GET, never a listing)."""
        return self.store.has_object(document_format.state_key(name, round))

    def put_json(self, key: str, obj: JSONValue, *, exclusive: bool = True) -> bool:
        """Store a small JSON document; exclusive=True is put-if-absent (False if it existed)."""
        return self.store.put_json(document_format.check_doc_key(key), obj, exclusive=exclusive)

    def get_json(self, key: str) -> JSONValue:
        """The JSON document at ``key`` or None if absent (CorruptContributionError if not JSON)."""
        try:
            return self.store.get_json(document_format.check_doc_key(key))
        except ValueError as e:
            raise CorruptContributionError(f"document {key!r} at {self.uri} is not JSON") from e

    def wait_for_json(self, key: str, timeout_s: float) -> JSONValue:
        """Poll until ``key`` exists; StoreTimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            obj = self.get_json(key)
            if obj is not None:
                return obj
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(
                    f"document {key!r} did not appear at {self.uri} within {timeout_s} s"
                )
            if self.cancelled.wait(self.poll_interval_s):
                raise ExchangeCancelledError(f"wait for {key!r} cancelled")
