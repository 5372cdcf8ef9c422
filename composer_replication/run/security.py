"""`[security] sign = true`: the run's keys, from the driver to each replica (docs/security.md).

Driver (`prepare_signing`, before the launch):
  1. one Ed25519 key pair per rank (``rank-<r>``), one for the synchronizer and the driver's own,
     kept in ``<run folder>/signing-keys.json`` (mode 0600, never uploaded; a resumed run reuses
     them, ``--overwrite`` makes new ones);
  2. the key manifest ``keys.json`` (every public key and the run id, signed by the driver) and a
     driver signature over the run configuration (``run_config.sig.json``) in the store;
  3. what the replicas get: the driver's public key for everyone (`RunSecrets.env`) and each
     rank's private key for that rank only (`RunSecrets.per_rank`, handed over by the executor's
     secret mechanism).
Replica (`participant_keys`): trusts the key manifest and the run configuration only if the
driver's signature verifies with the public key from its environment, so a bucket writer can
neither swap keys nor switch signing off by rewriting ``run_config.json``.

Unsigned runs (`writer_secrets`, `writer_secret_from_env`): one random writer secret per rank,
kept in ``<run folder>/writer-secrets.json`` (mode 0600, reused on resume) and handed to rank r
only, as ``$COMPOSER_WRITER_SECRET``. The exchange derives the writer ids of the rank's uploads
from it, so a restarted replica recognises what its earlier incarnation uploaded and nobody
without the secret can predict the id of a future upload.

Every run, signed or not (`slot_secret`, `slot_secret_from_env`): one random slot secret for the
run, kept in the same file and handed to every rank as ``$COMPOSER_SLOT_SECRET`` through the
same per-rank secret mechanism. The exchange derives the key of each rank's upload from it
(`ObjectStoreAllReduce.slot`), so an object planted where a rank's upload would go is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from composer_replication.config import ConfigError
from composer_replication.exchange.signing import (
    DRIVER,
    DRIVER_KEY_ENV,
    KEY_ENV,
    KEYS_KEY,
    SYNCHRONIZER,
    RunKeys,
    SignatureError,
    canonical_bytes,
    generate_private_key,
    make_key_manifest,
    new_run_id,
    parse_key_manifest,
    public_key_of,
    rank_identity,
)
from composer_replication.json_types import JSONValue

if TYPE_CHECKING:
    from pathlib import Path

    from composer_replication.config import RunConfig
    from composer_replication.exchange.store import ObjectStore
    from composer_replication.run.folder import RunFolder

__all__ = [
    "CONFIG_SIGNATURE_KEY",
    "KEYS_FILE",
    "WRITER_SECRETS_FILE",
    "SLOT_SECRET_ENV",
    "WRITER_SECRET_ENV",
    "RunSecrets",
    "participant_keys",
    "secret_files",
    "secrets_warning",
    "prepare_signing",
    "slot_secret",
    "slot_secret_from_env",
    "writer_secret_from_env",
    "writer_secrets",
]

KEYS_FILE = "signing-keys.json"  # in the run folder, never in the store
WRITER_SECRETS_FILE = "writer-secrets.json"  # in the run folder, never in the store
WRITER_SECRET_ENV = "COMPOSER_WRITER_SECRET"  # rank r's writer secret (hex), rank r only
SLOT_SECRET_ENV = "COMPOSER_SLOT_SECRET"  # the run's slot secret (hex), every rank
CONFIG_SIGNATURE_KEY = "run_config.sig.json"
SECRET_FILES = (WRITER_SECRETS_FILE, KEYS_FILE)  # what a shared copy of a run folder must leave out


def secret_files(root: Path) -> list[str]:
    """The names of the secret files the run folder `root` holds (SECRET_FILES that exist)."""
    return [name for name in SECRET_FILES if (root / name).is_file()]


def secrets_warning(root: Path, names: list[str]) -> str:
    """The line `report` and `status` print for a run folder holding secrets: what they are and
    how to share the folder without them."""
    excludes = " ".join(f"--exclude {name}" for name in names)
    verb = "holds" if len(names) == 1 else "hold"
    return (
        f"do not share {' and '.join(names)}: {verb} this run's per-rank secrets, with which "
        f"anyone who can write to its store passes for its replicas; share a copy without "
        f"{'it' if len(names) == 1 else 'them'} (rsync -a {excludes} {root}/ DEST/)"
    )


@dataclass
class RunSecrets:
    """The driver's side of a signed run."""

    run_id: str
    private: dict[str, str] = field(repr=False)  # identity -> private key (hex)
    keys: RunKeys = field(repr=False)  # the run's public keys, signing as the driver

    @property
    def env(self) -> dict[str, str]:
        """For every replica (not secret): the driver's public key."""
        return {DRIVER_KEY_ENV: self.keys.public_keys[DRIVER]}

    def per_rank(self, n: int) -> dict[int, dict[str, str]]:
        """Rank r's own private key, for rank r only."""
        return {r: {KEY_ENV: self.private[rank_identity(r)]} for r in range(n)}

    def keys_for(self, identity: str) -> RunKeys:
        """The run's keys signing as ``identity`` (e.g. the synchronizer the driver runs)."""
        return self.keys.with_identity(identity, self.private[identity])


def config_digest(doc: Mapping[str, JSONValue]) -> str:
    """sha256 of the run configuration as replicas read it (canonical JSON)."""
    return hashlib.sha256(canonical_bytes(doc)).hexdigest()


def _load_or_create(folder: RunFolder, n: int) -> tuple[str, dict[str, str]]:
    path = folder.root / KEYS_FILE
    if path.is_file():
        doc = json.loads(path.read_text())
        private = dict(doc["private"])
        missing = [rank_identity(r) for r in range(n) if rank_identity(r) not in private]
        if missing:
            raise ConfigError(f"{path} has no keys for {missing}; start a new run to sign it")
        return str(doc["run_id"]), private
    identities = [DRIVER, SYNCHRONIZER, *(rank_identity(r) for r in range(n))]
    run_id = new_run_id()
    private = {identity: generate_private_key() for identity in identities}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"run_id": run_id, "private": private}, f, indent=1)
    return run_id, private


def prepare_signing(
    config: RunConfig, folder: RunFolder, store: ObjectStore, config_doc: Mapping[str, JSONValue]
) -> RunSecrets | None:
    """Keys, key manifest and config signature of a signed run (None when signing is off).

    Raises ConfigError when the store already holds another run's key manifest.
    """
    if not config.security.sign:
        return None
    run_id, private = _load_or_create(folder, config.backend.n_replicas)
    public = {identity: public_key_of(key) for identity, key in private.items()}
    record = make_key_manifest(run_id, public, private[DRIVER])
    if not store.put_if_absent(KEYS_KEY, json.dumps(record, sort_keys=True).encode()):
        try:
            stored = parse_key_manifest(store.get(KEYS_KEY), public[DRIVER])
        except SignatureError as exc:
            raise ConfigError(
                f"{store.uri}{KEYS_KEY} belongs to another run ({exc}); use a new store prefix "
                "or --overwrite"
            ) from None
        if stored.run_id != run_id or stored.public_keys != record["public_keys"]:
            raise ConfigError(f"{store.uri}{KEYS_KEY} holds other keys; use --overwrite")
    keys = RunKeys(run_id, record["public_keys"]).with_identity(DRIVER, private[DRIVER])
    signature = keys.sign({"kind": "run_config", "sha256": config_digest(config_doc)})
    store.put_json(CONFIG_SIGNATURE_KEY, signature)
    return RunSecrets(run_id=run_id, private=private, keys=keys)


def participant_keys(
    store: ObjectStore,
    identity: str,
    config_doc: Mapping[str, JSONValue],
    *,
    required: bool,
    environ: Mapping[str, str] | None = None,
) -> RunKeys | None:
    """This participant's keys from its environment, after checking the key manifest and the
    run configuration against the driver's signature. None when the environment holds no
    driver key and signing is not ``required`` (signing off).

    Raises ValueError saying what is missing or wrong (the replica exits with code 2).
    """
    env = os.environ if environ is None else environ
    driver_key = env.get(DRIVER_KEY_ENV, "").strip()
    private = env.get(KEY_ENV, "").strip()
    if not driver_key:
        if required:
            raise ValueError(
                f"[security] sign = true but ${DRIVER_KEY_ENV} is not set: start the run with "
                "`composer-replication train`, whose driver hands every replica its keys"
            )
        return None
    if not private:
        raise ValueError(
            f"${DRIVER_KEY_ENV} is set but ${KEY_ENV} is not: this replica got no private key "
            "(check that the backend passes secrets)"
        )
    keys = parse_key_manifest(store.get(KEYS_KEY), driver_key)
    signature = store.get_json(CONFIG_SIGNATURE_KEY)
    if not isinstance(signature, dict):
        raise SignatureError(f"{store.uri}{CONFIG_SIGNATURE_KEY} is missing: config not signed")
    keys.verify(signature, signers={DRIVER}, what="run configuration signature")
    if signature.get("sha256") != config_digest(config_doc):
        raise SignatureError(
            f"{store.uri}run_config.json is not the configuration the driver signed (modified "
            "in the store?)"
        )
    return keys.with_identity(identity, private)


def _stored_secrets(folder: RunFolder, ranks: int, slot: bool) -> dict[str, str]:
    """The run folder's secrets file (``"0"``... per rank, ``"slot"``), completed with new
    random secrets for the ranks below ``ranks`` (and the slot, if ``slot``) it lacks."""
    path = folder.root / WRITER_SECRETS_FILE
    stored: dict[str, str] = {}
    if path.is_file():
        doc = json.loads(path.read_text())
        stored = {str(k): str(v) for k, v in (doc.get("secrets") or {}).items()}
    missing = [str(r) for r in range(ranks) if str(r) not in stored]
    missing += ["slot"] if slot and "slot" not in stored else []
    if missing:
        stored.update({name: os.urandom(32).hex() for name in missing})
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"secrets": stored}, f, indent=1)
        os.replace(tmp, path)
    return stored


def writer_secrets(folder: RunFolder, n: int) -> dict[int, dict[str, str]]:
    """Rank r's writer secret, for rank r only (created once per run folder, reused on resume;
    ranks added by a larger ``n`` get new ones)."""
    stored = _stored_secrets(folder, n, slot=False)
    return {r: {WRITER_SECRET_ENV: stored[str(r)]} for r in range(n)}


def slot_secret(folder: RunFolder) -> dict[str, str]:
    """The run's slot secret, as every rank's environment entry (created once per run folder,
    reused on resume, so a restarted rank finds its earlier upload at its key)."""
    return {SLOT_SECRET_ENV: _stored_secrets(folder, 0, slot=True)["slot"]}


def _secret_from_env(name: str, environ: Mapping[str, str] | None) -> bytes | None:
    env = os.environ if environ is None else environ
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        secret = bytes.fromhex(value)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ValueError(
            f"${name} must be >= 32 hex digits (the driver sets it); unset it to do without"
        )
    return secret


def writer_secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """This replica's writer secret (None when the environment has none: the exchange then uses a
    random one per process). Raises ValueError for a malformed value."""
    return _secret_from_env(WRITER_SECRET_ENV, environ)


def slot_secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The run's slot secret (None when the environment has none: plain keys). Raises
    ValueError for a malformed value."""
    return _secret_from_env(SLOT_SECRET_ENV, environ)
