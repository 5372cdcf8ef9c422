"""Run-level documents in the object store: config, replica status, metrics chunks, checkpoints.

The driver and the replicas share nothing but the store (a replica on Modal cannot write to the
driver's disk), so everything the driver shows comes from here. Layout under the run prefix:

    run_config.json                       resolved RunConfig (written once by the driver)
    diloco/                               ObjectStoreAllReduce's own prefix (pseudo-gradients)
    replicas/<rank>/status.json           latest status of one replica (overwritten)
    replicas/<rank>/metrics/<seq>.jsonl   immutable metric chunks, seq = 0, 1, 2, ...
    checkpoints/round-<k>/                save_pretrained folder + outer_state.safetensors
    checkpoints/round-<k>/COMMITTED       written last: the checkpoint is complete

Only JSON and safetensors are read back (never pickle).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

__all__ = ["StoreIO", "local_path", "normalise_uri"]


def normalise_uri(uri: str) -> str:
    """A URI with a scheme and a trailing '/'; bare paths become file:// URIs (absolute)."""
    if "://" not in uri:
        uri = Path(uri).expanduser().resolve().as_uri()
    return uri if uri.endswith("/") else uri + "/"


def local_path(uri: str) -> Path | None:
    """The local folder of a file:// URI, else None."""
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    return None


class StoreIO:
    """Small fsspec helper for the run prefix `uri` (see the module docstring for the layout)."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.uri = normalise_uri(uri)
        self.storage_options = dict(storage_options or {})
        self.fs, root = fsspec.core.url_to_fs(self.uri, **self.storage_options)
        self.root = root.rstrip("/")

    # -- paths
    def path(self, key: str) -> str:
        return f"{self.root}/{key.lstrip('/')}" if key else self.root

    def child_uri(self, key: str) -> str:
        """The URI of a sub-prefix (ends with '/')."""
        return self.uri + key.strip("/") + "/"

    # -- bytes and JSON
    def write_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        """Write an object; with exclusive, False (and nothing written) when it already exists."""
        path = self.path(key)
        parent = path.rsplit("/", 1)[0]
        if parent and local_path(self.uri) is not None:
            # Only local stores have folders; on S3, makedirs would CREATE A BUCKET that a typo
            # in store.uri names, instead of failing.
            self.fs.makedirs(parent, exist_ok=True)
        if exclusive:
            try:
                with self.fs.open(path, "xb") as fh:
                    fh.write(data)
                return True
            except FileExistsError:
                return False
            except OSError as exc:  # some S3 servers answer a lost race with EINVAL, not 412
                if self.fs.exists(path):
                    return False
                raise exc
        if local_path(self.uri) is not None:
            # Write-then-rename so a reader polling this file never sees half of it.
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)
        return True

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return self.fs.cat_file(self.path(key))
        except FileNotFoundError:
            return None

    def write_json(self, key: str, obj: Any, *, exclusive: bool = False) -> bool:
        return self.write_bytes(key, json.dumps(obj, indent=1).encode(), exclusive=exclusive)

    def read_json(self, key: str) -> Any | None:
        data = self.read_bytes(key)
        if data is None:
            return None
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            return None  # a torn write on a store without atomic replace; read again later

    def exists(self, key: str) -> bool:
        self.fs.invalidate_cache(self.path(key))
        return bool(self.fs.exists(self.path(key)))

    def list(self, key: str) -> list[str]:
        """Names (not paths) directly under `key`, sorted; [] when it does not exist.

        Always a fresh listing: s3fs/gcsfs cache directory listings, and the driver polls the
        same prefixes for objects other processes keep adding.
        """
        self.fs.invalidate_cache(self.path(key))
        try:
            entries = self.fs.ls(self.path(key), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def remove(self, key: str) -> None:
        path = self.path(key)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    # -- folders
    def put_dir(self, local_dir: str | Path, key: str) -> None:
        """Upload every file of a local folder to `key/` (flat or nested)."""
        local_dir = Path(local_dir)
        for file in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            rel = file.relative_to(local_dir).as_posix()
            self.write_bytes(f"{key.rstrip('/')}/{rel}", file.read_bytes())

    def get_dir(self, key: str, local_dir: str | Path) -> None:
        """Download `key/` into a local folder; hard links when the store is the same disk."""
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        base = self.path(key).rstrip("/")
        for path in sorted(self.fs.find(base)):
            rel = str(path)[len(base) :].lstrip("/")
            target = local_dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if local_path(self.uri) is not None:
                if target.exists():
                    target.unlink()
                try:
                    os.link(path, target)
                    continue
                except OSError:
                    pass  # another file system: copy below
            target.write_bytes(self.fs.cat_file(path))

    # -- preflight
    def probe_writable(self) -> None:
        """Write and delete a small object; raise OSError saying why the store is unusable."""
        key = f"_probe-{uuid.uuid4().hex[:12]}"
        try:
            self.write_bytes(key, b"ok")
            if self.read_bytes(key) != b"ok":
                raise OSError("a probe object read back differently")
        finally:
            try:
                self.remove(key)
            except Exception:  # the write failed; nothing to clean
                pass
