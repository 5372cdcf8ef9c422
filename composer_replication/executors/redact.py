"""Shared plumbing of the cloud executors: optional-SDK imports and credential-safe errors.

Every cloud adapter talks to its service through the vendor SDK, and the SDKs' exceptions can
carry request details (headers, URLs with signatures, echoed bodies). Nothing the driver prints
may contain a credential, so each SDK call an adapter makes goes through `sdk_errors`, which
re-raises any failure as `CloudExecutorError` with known secrets and secret-looking substrings
masked, and without the original exception chained (a chained traceback would print it).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterable, Iterator
from types import ModuleType

from composer_replication.executors.registry import pip_extra

__all__ = ["CloudExecutorError", "MissingCredentialsError", "import_sdk", "redact", "sdk_errors"]

MASK = "***"

# Substrings that look like credentials whatever the backend: bearer tokens, HF tokens, AWS
# access key ids, Modal token ids/secrets, and "secret=..." style assignments.
_PATTERNS = [
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+"),
    re.compile(r"\bhf_[A-Za-z0-9]{8,}"),
    re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{12,}"),
    re.compile(r"\ba[ks]-[A-Za-z0-9]{8,}"),
    re.compile(
        r"(?i)((?:secret|token|password|passwd|credential|signature|api[_-]?key)[\w-]*"
        r"[\"']?\s*[=:]\s*[\"']?)[^\s\"',;&]+"
    ),
]


class CloudExecutorError(RuntimeError):
    """A cloud backend call failed; the message names the operation and is credential-free."""


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with every given secret value and every credential-looking substring masked."""
    out = str(text)
    # Longest first, so a secret that contains another is masked whole.
    for secret in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        out = out.replace(secret, MASK)
    for pattern in _PATTERNS:
        out = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + MASK, out)
    return out


@contextlib.contextmanager
def sdk_errors(backend: str, operation: str, secrets: Iterable[str | None] = ()) -> Iterator[None]:
    """Re-raise any SDK failure inside the block as a redacted `CloudExecutorError`.

    Adapters validate their input before entering the block, so everything caught here came
    from the SDK. The SDK exception is deliberately not chained (`from None`): its traceback and
    attributes may hold request headers.
    """
    try:
        yield
    except CloudExecutorError:
        raise
    except Exception as exc:
        message = redact(f"{type(exc).__name__}: {exc}", secrets)
        raise CloudExecutorError(f"{backend}: {operation} failed: {message}") from None


def import_sdk(module: str, backend: str) -> ModuleType:
    """Import an optional SDK of `backend` (a registry name) or raise ImportError naming the
    pip extra that installs it (from the backend registry)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"this executor needs the '{module.split('.')[0]}' package: "
            f"pip install 'composer-replication[{pip_extra(backend)}]' ({exc})"
        ) from None


class MissingCredentialsError(RuntimeError):
    """No credentials for a cloud backend were found in the SDK's standard places."""
