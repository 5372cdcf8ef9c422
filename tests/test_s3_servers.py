"""The test S3 servers' start-up (tests/s3_servers.py): a SeaweedFS that cannot serve the test's
bucket is started again instead of failing every test of an xdist worker after 120 s."""

from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

import pytest
import s3_servers
import s3fs


def test_a_server_that_refuses_the_readiness_write_is_given_up_quickly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A SeaweedFS without the bucket answers the write "Access Denied." (it may not auto-create
    # the bucket): what CI saw for 120 s. The wait ends after ANSWERED_ERRORS_S, naming the error.
    monkeypatch.setattr(s3_servers, "ANSWERED_ERRORS_S", 2.0)
    data_dir = tempfile.mkdtemp(prefix="seaweedfs-test-")
    proc, endpoint = s3_servers._start_weed(data_dir, "composer-test-served")
    log = Path(data_dir) / "weed.log"
    try:
        s3_servers._wait_for_bucket(endpoint, "composer-test-served", proc, log)
        t0 = time.monotonic()
        with pytest.raises(s3_servers._ExitedEarly, match="Access Denied") as err:
            s3_servers._wait_for_bucket(endpoint, "composer-test-not-there", proc, log)
        assert 2.0 <= time.monotonic() - t0 < 60
        assert "auto-create bucket composer-test-not-there" in str(err.value)  # the log's tail
    finally:
        s3_servers._stop(proc)


def test_a_start_that_loses_its_port_is_retried_on_other_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = socket.socket()  # bound, not listening: the server cannot bind it, a client is refused
    taken.bind(("127.0.0.1", 0))
    chosen: list[list[int]] = []
    free_ports = s3_servers._free_ports

    def first_s3_port_taken(n: int) -> list[int]:
        ports = free_ports(n)
        if not chosen:
            ports[6] = taken.getsockname()[1]  # the S3 port (names' index 3, even slots)
        chosen.append(ports)
        return ports

    monkeypatch.setattr(s3_servers, "_free_ports", first_s3_port_taken)
    try:
        with s3_servers.run_seaweedfs() as (endpoint, bucket, options):
            assert len(chosen) == 2 and endpoint.endswith(f":{chosen[1][6]}")
            fs = s3fs.S3FileSystem(**options)
            fs.pipe_file(f"{bucket}/x", b"1")
            assert fs.cat_file(f"{bucket}/x") == b"1"
    finally:
        taken.close()
