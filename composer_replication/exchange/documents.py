"""Run-level documents of an exchange: manifest, state snapshots, small JSON documents.

A mixin for :class:`ObjectStoreAllReduce` (kept apart so each module stays one concept). It
needs ``self._store`` (an ObjectStore), ``uri``, ``world_size``, ``codec``, ``keep_steps``,
``poll_interval_s`` and ``_cancel`` (threading.Event) from the host class.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch

from composer_replication.exchange import state as state_mod
from composer_replication.exchange.protocol import (
    CorruptContributionError,
    ExchangeCancelledError,
    ModelMismatchError,
    StoreTimeoutError,
    commit_key,
    parse_step_dir,
)
from composer_replication.exchange.store import ObjectStore


class RunDocumentsMixin:
    """Manifest, full-state snapshots and JSON documents stored under the run prefix."""

    _store: ObjectStore
    _cancel: threading.Event
    uri: str
    world_size: int
    codec: str
    keep_steps: int
    poll_interval_s: float

    def latest_committed_step(self) -> int | None:
        """Highest step that has a commit record, or None."""
        steps = sorted(
            (s for s in map(parse_step_dir, self._store.list("steps/")) if s is not None),
            reverse=True,
        )
        for s in steps:
            if self._store.exists(commit_key(s)):
                return s
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
        raw = json.dumps(ours, sort_keys=True).encode()
        if self._store.put_if_absent(state_mod.MANIFEST_KEY, raw):
            return
        stored_raw = self._store.get(state_mod.MANIFEST_KEY)
        try:
            stored = json.loads(bytes(stored_raw or b""))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelMismatchError(f"run manifest at {self.uri} is unreadable ({e})") from e
        diff = state_mod.manifest_diff(stored, ours)
        if diff:
            raise ModelMismatchError(
                f"this replica does not match the run at {self.uri}:\n  "
                + "\n  ".join(diff)
                + "\nuse a new run prefix or the model/world size/codec the run was started with"
            )

    def publish_state(
        self,
        state: dict[str, torch.Tensor],
        *,
        round: int,
        name: str = "global",
        extra: dict[str, Any] | None = None,
    ) -> bool:
        """put-if-absent a full state dict for ``round``; False if that round already exists."""
        if not isinstance(state, dict):
            raise ValueError("publish_state(state: dict[str, Tensor], *, round, name, extra)")
        if not isinstance(round, int) or isinstance(round, bool) or not 0 <= round < 10**10:
            raise ValueError(f"round must be an int in [0, 1e10), got {round!r}")
        blob = state_mod.encode_state(state, name=state_mod.check_state_name(name), round=round,
                                  extra=extra)  # fmt: skip
        wrote = self._store.put_if_absent(state_mod.state_key(name, round), blob)
        if wrote:
            for fname in self._store.list(state_mod.state_prefix(name)):
                r = state_mod.parse_state_name(fname)
                if r is not None and r <= round - self.keep_steps:
                    self._store.delete(state_mod.state_prefix(name) + fname)
        return wrote

    def fetch_state(
        self, *, name: str = "global", round: int | None = None
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None:
        """(round, tensors, extra) of ``round`` (None = latest), or None if there is none."""
        rounds = [
            r for r in map(state_mod.parse_state_name, self._store.list(state_mod.state_prefix(name)))
            if r is not None
        ]  # fmt: skip
        if round is None:
            if not rounds:
                return None
            round = max(rounds)
        blob = self._store.get(state_mod.state_key(name, round))
        if blob is None:
            return None
        tensors, extra = state_mod.decode_state(blob, name=name, round=round)
        return round, tensors, extra

    def put_json(self, key: str, obj: Any, *, exclusive: bool = True) -> bool:
        """Store a small JSON document; exclusive=True is put-if-absent (False if it existed)."""
        raw = json.dumps(obj, sort_keys=True).encode()
        key = state_mod.check_doc_key(key)
        if exclusive:
            return self._store.put_if_absent(key, raw)
        self._store.put(key, raw)
        return True

    def get_json(self, key: str) -> Any:
        """The JSON document at ``key`` or None if absent."""
        raw = self._store.get(state_mod.check_doc_key(key))
        if raw is None:
            return None
        try:
            return json.loads(bytes(raw))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptContributionError(f"document {key!r} at {self.uri} is not JSON") from e

    def wait_for_json(self, key: str, timeout_s: float) -> Any:
        """Poll until ``key`` exists; StoreTimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            obj = self.get_json(key)
            if obj is not None:
                return obj
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(f"document {key!r} did not appear at {self.uri} "
                                        f"within {timeout_s} s")  # fmt: skip
            if self._cancel.wait(self.poll_interval_s):
                raise ExchangeCancelledError(f"wait for {key!r} cancelled")
