"""The chaos proxy's read-only mode against real S3 servers: every write (PUT, POST, DELETE)
is answered with S3's 403 AccessDenied, which the store raises as a `PermissionError` naming
the object; reads go through; once writable again the same writes succeed."""

from __future__ import annotations

import uuid

import pytest

from composer_replication.exchange.store import ObjectStore
from composer_replication.faults.proxy import ThrottleProxy

pytestmark = pytest.mark.server


@pytest.mark.parametrize("server", ["moto_server", "seaweedfs_server"])
def test_writes_are_refused_while_read_only_and_reads_go_through(
    server: str, request: pytest.FixtureRequest
) -> None:
    _, bucket, options = request.getfixturevalue(server)
    proxy = ThrottleProxy(options["endpoint_url"])
    try:
        uri = f"s3://{bucket}/ro-{uuid.uuid4().hex}"
        store = ObjectStore(uri, {**options, "endpoint_url": proxy.endpoint})
        store.put("before", b"x" * 100_000)  # large enough to need more than one recv
        proxy.read_only(True)
        assert store.get("before") == b"x" * 100_000  # reads are not writes
        with pytest.raises(PermissionError):
            store.put("during", b"y" * 200_000)
        with pytest.raises(PermissionError):
            store.put_if_absent("during-exclusive", b"z")
        with pytest.raises(PermissionError):
            store.delete("before")
        assert proxy.refused >= 3
        assert store.get("before") is not None and not store.exists("during")
        proxy.read_only(False)
        store.put("after", b"w")
        assert store.put_if_absent("during-exclusive", b"z")
        assert store.get("after") == b"w"
    finally:
        proxy.close()
