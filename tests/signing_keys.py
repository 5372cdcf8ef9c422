"""Signing keys for tests (exchange/signing.py): a driver-signed key manifest written to a store,
the verifier every participant builds from it, and each identity's own signing keys."""

from __future__ import annotations

import json

from composer_replication.exchange.signing import (
    DRIVER,
    KEYS_KEY,
    RunKeys,
    generate_private_key,
    make_key_manifest,
    parse_key_manifest,
    public_key_of,
)
from composer_replication.exchange.store import ObjectStore


def run_keys(
    store: ObjectStore, identities: list[str], run_id: str = "run-1"
) -> tuple[RunKeys, dict[str, RunKeys]]:
    """Write the key manifest of ``identities`` (plus the driver) to ``store``; return the
    verifier (no private key) and, per identity, keys that sign as it."""
    private = {identity: generate_private_key() for identity in identities}
    private[DRIVER] = generate_private_key()
    public = {k: public_key_of(v) for k, v in private.items()}
    manifest = make_key_manifest(run_id, public, private[DRIVER])
    store.put_if_absent(KEYS_KEY, json.dumps(manifest).encode())
    verifier = parse_key_manifest(store.get(KEYS_KEY), public[DRIVER])
    return verifier, {i: verifier.with_identity(i, private[i]) for i in identities}
