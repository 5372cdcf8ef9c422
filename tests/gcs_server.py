"""A GCS emulator on 127.0.0.1 for tests (pytest plugin, see tests/conftest.py).

``gcs_server`` (session-scoped fixture; also ``run_gcs()`` as a context manager for scripts)
starts ``gcp-storage-emulator`` (PyPI) in a subprocess, in memory, with one bucket, and yields
``(endpoint_url, bucket, storage_options)``; ``storage_options`` is a plain dict for gcsfs
(endpoint, anonymous token, project) that can be passed to subprocesses.

The emulator ignores upload preconditions, which the object-store protocol relies on (real GCS
refuses ``ifGenerationMatch=0`` with HTTP 412 when the object exists: that is how ``mode="create"``
is a put-if-absent). The launcher below adds exactly that rule to the emulator's object-insert
handler (media and multipart uploads, which is what gcsfs sends for bodies under 50 MiB; a
resumable upload is checked when it is opened), atomically under one lock, before the emulator's
routes are built. Everything else is the emulator's own behaviour.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BUCKET = "composer-test"

LAUNCHER = r"""
import sys, threading
from http import HTTPStatus
from gcp_storage_emulator.handlers import objects

_insert = objects.insert
_lock = threading.Lock()

def insert(request, response, storage, *args, **kwargs):
    match = request.query.get("ifGenerationMatch")
    if not match or match[0] != "0":
        return _insert(request, response, storage, *args, **kwargs)
    name = request.query.get("name", [None])[0]
    if name is None and isinstance(request.data, dict):
        name = (request.data.get("meta") or {}).get("name") or request.data.get("name")
    with _lock:  # check and create as one step, as GCS does
        try:
            storage.get_file_obj(request.params["bucket_name"], name)
            exists = True
        except Exception:
            exists = False
        if exists:
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "conditionNotMet",
                                     "errors": [{"reason": "conditionNotMet"}]}})
            return None
        return _insert(request, response, storage, *args, **kwargs)

objects.insert = insert
from gcp_storage_emulator.server import create_server  # builds its routes with the rule above

# Port 0: the server binds a free port itself (atomically: no other process can be handed the
# same one), and says which on its first stdout line.
server = create_server(sys.argv[1], 0, in_memory=True, default_bucket=sys.argv[2])
server.start()
print("PORT", server._api._httpd.server_address[1], flush=True)
threading.Event().wait()
"""


def storage_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "token": "anon", "project": "composer-test"}


@contextlib.contextmanager
def run_gcs(bucket: str = BUCKET) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Start the emulator on loopback; yields (endpoint_url, bucket, storage_options)."""
    try:
        import gcp_storage_emulator  # noqa: F401
    except ImportError:
        pytest.skip("gcp-storage-emulator is not installed: pip install composer-replication[dev]")
    log = Path(tempfile.mkdtemp(prefix="gcs-emulator-")) / "emulator.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, "127.0.0.1", bucket],
            stdout=subprocess.PIPE,
            stderr=logf,
            start_new_session=True,
            text=True,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the server listens (or exits)
        if not line.startswith("PORT "):
            proc.wait(timeout=15)
            raise RuntimeError(f"the GCS emulator did not start: {log.read_text()[-2000:]}")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # never let it block
        endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        yield endpoint, bucket, storage_options(endpoint)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        with contextlib.suppress(OSError):
            os.remove(log)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """gcp-storage-emulator on loopback; yields (endpoint_url, bucket, storage_options)."""
    with run_gcs() as server:
        yield server
