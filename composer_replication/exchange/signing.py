"""Ed25519 signatures on everything that decides a round (``[security] sign = true``).

Who holds what:

- the driver generates one key pair per rank (identity ``rank-<r>``), one for the synchronizer
  (``synchronizer``) and its own (``driver``); it hands each replica ONLY its own private key
  (``COMPOSER_SIGNING_KEY``, through the backend's secret mechanism) plus the driver's public key
  (``COMPOSER_DRIVER_PUBLIC_KEY``), and publishes every public key in the run's key manifest
  ``keys.json``, signed by the driver's key. A replica trusts the manifest only if the driver's
  signature verifies with the public key it was given out of band, so nobody who can merely
  write to the bucket can substitute keys.
- every contribution header, commit record, published state header and run manifest carries
  ``run_id``, ``signer`` and ``signature``: an Ed25519 signature over the canonical JSON of the
  record without ``signature`` (sorted keys, no whitespace, ASCII), prefixed by a domain string.
  The record binds what a replay would change: the run id, the kind, the round/step, the rank and
  the payload's sha256 checksum (signing forces sha256: xxh3-128 is not collision resistant, so a
  signature over it would not bind the payload).

A record is refused (`SignatureError`) when it is unsigned, signed by an identity that may not
sign it (another rank's contribution, a commit by a rank other than its ``committed_by``), signed
for another run, or its signature does not verify (forged or modified). The round/step/rank
checks of the protocol then refuse a correctly signed object replayed at another key.

What signing does not do: stop someone with write access from deleting objects or blocking a
slot (a denial of service), or a rank that holds a valid key from committing a record with
unfair weights; see docs/security.md.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from composer_replication.exchange.vocabulary import CorruptContributionError
from composer_replication.fields import setting

if TYPE_CHECKING:  # cryptography is imported where a key is used (the [security] extra)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

__all__ = [
    "DRIVER",
    "DRIVER_KEY_ENV",
    "KEYS_KEY",
    "KEY_ENV",
    "SYNCHRONIZER",
    "RunKeys",
    "SecurityConfig",
    "SignatureError",
    "canonical_bytes",
    "generate_private_key",
    "make_key_manifest",
    "new_run_id",
    "parse_key_manifest",
    "public_key_of",
    "rank_identity",
]

KEY_ENV = "COMPOSER_SIGNING_KEY"  # this participant's private key (hex), a secret
DRIVER_KEY_ENV = "COMPOSER_DRIVER_PUBLIC_KEY"  # the driver's public key (hex), not secret
KEYS_KEY = "keys.json"  # the signed key manifest in the run prefix
DRIVER = "driver"
SYNCHRONIZER = "synchronizer"
DOMAIN = b"composer-replication/signature/v1\n"
SIGNATURE_FIELDS = ("run_id", "signer", "signature")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX128 = re.compile(r"^[0-9a-f]{128}$")


class SignatureError(CorruptContributionError):
    """A record is unsigned, mis-signed, signed by the wrong identity or for another run."""


def rank_identity(rank: int) -> str:
    """The identity whose key signs rank ``rank``'s objects: ``rank-<r>``."""
    return f"rank-{int(rank)}"


def new_run_id() -> str:
    """A fresh random run id (binds signatures to one run)."""
    return secrets.token_hex(16)


def canonical_bytes(record: Mapping[str, object]) -> bytes:
    """What is signed: DOMAIN + the record without ``signature`` as canonical JSON."""
    body = {k: v for k, v in record.items() if k != "signature"}
    try:
        text = json.dumps(
            body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot sign a record that is not plain JSON: {e}") from None
    return DOMAIN + text.encode()


def _private(hex_key: str, what: str) -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if not isinstance(hex_key, str) or not _HEX64.match(hex_key.strip().lower()):
        raise ValueError(f"{what} must be 64 hex characters (an Ed25519 private key)")
    return Ed25519PrivateKey.from_private_bytes(bytes.fromhex(hex_key.strip().lower()))


def _public(hex_key: str, what: str) -> Ed25519PublicKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if not isinstance(hex_key, str) or not _HEX64.match(hex_key.strip().lower()):
        raise ValueError(f"{what} must be 64 hex characters (an Ed25519 public key)")
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(hex_key.strip().lower()))


def generate_private_key() -> str:
    """A new Ed25519 private key, as 64 hex characters."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import (
        Encoding,
        NoEncryption,
        PrivateFormat,
    )

    raw = Ed25519PrivateKey.generate().private_bytes(
        Encoding.Raw, PrivateFormat.Raw, NoEncryption()
    )
    return raw.hex()


def public_key_of(private_hex: str) -> str:
    """The public key (64 hex characters) of a private key."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    key = _private(private_hex, "private key").public_key()
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def _sign(private_key: Ed25519PrivateKey, record: Mapping[str, object]) -> str:
    return private_key.sign(canonical_bytes(record)).hex()


def _verify(public_key: Ed25519PublicKey, record: Mapping[str, object], signature: str) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        public_key.verify(bytes.fromhex(signature), canonical_bytes(record))
    except (InvalidSignature, ValueError):
        return False
    return True


def make_key_manifest(
    run_id: str, public_keys: Mapping[str, str], driver_private_hex: str
) -> dict[str, Any]:
    """The key manifest record (``keys.json``), signed by the driver."""
    keys = {str(k): v for k, v in public_keys.items()}
    for identity, key in keys.items():
        _public(key, f"public key of {identity!r}")
    driver_public = public_key_of(driver_private_hex)
    if keys.get(DRIVER, driver_public) != driver_public:
        raise ValueError("the manifest's 'driver' key is not the signing driver key")
    keys[DRIVER] = driver_public
    record = {
        "format": 1,
        "kind": "keys",
        "run_id": run_id,
        "signer": DRIVER,
        "public_keys": dict(sorted(keys.items())),
    }
    record["signature"] = _sign(_private(driver_private_hex, "driver key"), record)
    return record


def parse_key_manifest(raw: bytes | memoryview | None, driver_public_hex: str) -> RunKeys:
    """Verify ``keys.json`` with the driver's public key; returns the run's public keys."""
    what = f"key manifest {KEYS_KEY}"
    if raw is None:
        raise SignatureError(f"{what} is missing: the driver publishes it before launching")
    try:
        record = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SignatureError(f"{what} is not JSON ({e})") from None
    keys = record.get("public_keys") if isinstance(record, dict) else None
    if not (
        isinstance(record, dict)
        and record.get("kind") == "keys"
        and record.get("signer") == DRIVER
        and isinstance(record.get("run_id"), str)
        and isinstance(record.get("signature"), str)
        and isinstance(keys, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items())
    ):
        raise SignatureError(f"{what} is malformed or unsigned")
    driver = _public(driver_public_hex, DRIVER_KEY_ENV)
    if not _verify(driver, record, record["signature"]):
        raise SignatureError(
            f"{what} is not signed by this run's driver key (forged, modified, or "
            f"{DRIVER_KEY_ENV} belongs to another run)"
        )
    return RunKeys(run_id=record["run_id"], public_keys=keys)


@dataclass
class RunKeys:
    """One participant's view of the run's keys: the run id, every identity's public key, and
    (for a signer) its own identity and private key."""

    run_id: str
    public_keys: dict[str, str]
    identity: str | None = None
    private_key_hex: str | None = field(default=None, repr=False)
    _private_key: Ed25519PrivateKey | None = field(default=None, repr=False, compare=False)
    _publics: dict[str, Ed25519PublicKey] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.identity is None) != (self.private_key_hex is None):
            raise ValueError("RunKeys: give both identity and private_key_hex, or neither")
        if self.identity is not None and self.private_key_hex is not None:
            expected = self.public_keys.get(self.identity)
            if expected is None:
                raise ValueError(f"the run's key manifest has no key for {self.identity!r}")
            if public_key_of(self.private_key_hex) != expected:
                raise ValueError(
                    f"the private key given to {self.identity!r} ({KEY_ENV}) does not match "
                    f"its public key in {KEYS_KEY} (a key from another run?)"
                )
            self._private_key = _private(self.private_key_hex, KEY_ENV)

    def with_identity(self, identity: str, private_key_hex: str) -> RunKeys:
        """The same public keys, signing as ``identity``."""
        return RunKeys(self.run_id, dict(self.public_keys), identity, private_key_hex)

    @property
    def can_sign(self) -> bool:
        return self._private_key is not None

    def sign(self, record: Mapping[str, object]) -> dict[str, object]:
        """``record`` plus ``run_id``, ``signer`` (this identity) and ``signature``."""
        if self._private_key is None or self.identity is None:
            raise ValueError("these RunKeys hold no private key; they can only verify")
        out = {k: v for k, v in record.items() if k not in SIGNATURE_FIELDS}
        out["run_id"] = self.run_id
        out["signer"] = self.identity
        out["signature"] = _sign(self._private_key, out)
        return out

    def verify(self, record: Mapping[str, object], *, signers: Collection[str], what: str) -> None:
        """Raise SignatureError unless ``record`` is signed, for this run, by one of ``signers``
        (identities; ``"rank-*"`` allows any rank)."""
        signature = record.get("signature")
        signer = record.get("signer")
        if not isinstance(signature, str) or not isinstance(signer, str):
            raise SignatureError(f"{what} is not signed (signing is on for this run)")
        allowed = signer in signers or ("rank-*" in signers and signer.startswith("rank-"))
        if not allowed:
            raise SignatureError(
                f"{what} is signed by {signer!r}, but only {sorted(signers)} may sign it "
                "(a forgery by another participant?)"
            )
        if record.get("run_id") != self.run_id:
            raise SignatureError(
                f"{what} is signed for run {record.get('run_id')!r}, not this run "
                f"{self.run_id!r} (replayed from another run)"
            )
        key = self._publics.get(signer)
        if key is None:
            hex_key = self.public_keys.get(signer)
            if hex_key is None:
                raise SignatureError(f"{what} is signed by {signer!r}, who has no key in this run")
            key = self._publics[signer] = _public(hex_key, f"public key of {signer!r}")
        if not _HEX128.match(signature) or not _verify(key, record, signature):
            raise SignatureError(f"{what}: the signature does not verify (forged or modified)")


@dataclass(frozen=True)
class SecurityConfig:
    """Signed contributions (docs/security.md)."""

    sign: bool = setting(
        False,
        "Ed25519-sign every contribution, commit record, state and manifest; the driver makes "
        "one key per rank and hands each replica only its own (object-store exchange; "
        "decoupled mode: pushes, merge records and states)",
    )
