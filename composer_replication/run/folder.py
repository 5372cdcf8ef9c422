"""The run folder `<runs_dir>/<name>/`: everything one training run leaves behind.

    config.toml        the resolved configuration (load it again with `train config.toml`)
    config.json        the same, as the replicas received it
    driver.json        driver state: status, start/end, replica handles, exit codes, attempts
    driver.json.bak    the same, written right after it (read when driver.json is damaged)
    metrics.jsonl      every metric record of every replica (see run/metrics.py)
    tensorboard/       TensorBoard event files (`tensorboard --logdir runs/`)
    logs/              replica-<rank>.log (stdout/stderr of each replica)
    plots/             PNG plots drawn by `composer-replication report`
    checkpoints/       round-<k>/ save_pretrained folders (+ outer_state.safetensors), final/
    summary.md         the report's markdown summary
    store/             the object store when store.uri is empty (file://)
    writer-secrets.json  SECRET: per-rank writer secrets and the slot secret (run/security.py)
    signing-keys.json  SECRET: every rank's private key (`security.sign = true`)

The two secret files never leave this folder; `report` and `status` warn that a copy to share
must leave them out. An existing folder is never reused unless the caller asks to resume or overwrite.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from composer_replication.exchange.store import ObjectStore
from composer_replication.json_types import JSONDict, JSONValue

__all__ = ["OWNER_KEY", "RunFolder", "claim_store", "default_run_name", "owner_conflict"]


def default_run_name(now: float | None = None) -> str:
    """'run-YYYYmmdd-HHMMSS' in local time."""
    return time.strftime("run-%Y%m%d-%H%M%S", time.localtime(now))


@dataclass(frozen=True)
class RunFolder:
    """Paths of one run folder (nothing is created until `create`)."""

    root: Path

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> RunFolder:
        return cls(Path(path).expanduser().resolve())

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def config_toml(self) -> Path:
        return self.root / "config.toml"

    @property
    def config_json(self) -> Path:
        return self.root / "config.json"

    @property
    def driver_json(self) -> Path:
        return self.root / "driver.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def summary(self) -> Path:
        return self.root / "summary.md"

    @property
    def store(self) -> Path:
        return self.root / "store"

    def recorded_store_uri(self, uri: str) -> str:
        """What the saved config records for the run's store ``uri``: "" (the folder's own
        store, as an empty store.uri means) when it is this folder's ``store/``, so that a
        moved or copied folder, or a config.toml loaded for a new run, never names another
        folder's store; any other store as given."""
        return "" if _local_path(uri) == self.store else uri

    def stored_store_uri(self, recorded: str) -> tuple[str, str | None]:
        """(the store a saved config's store.uri names for this folder, a note or None).

        "" is this folder's ``store/``. A folder saved by an older release recorded the
        absolute path of its own store: when that path is another run folder's ``store/`` and
        this folder has a store of its own (it was moved or copied), this folder's is meant."""
        if not recorded:
            return str(self.store), None
        path = _local_path(recorded)
        if (
            path is not None
            and path != self.store
            and path.name == "store"
            and (path.parent / "config.json").is_file()
            and self.store.is_dir()
        ):
            return str(self.store), (
                f"config.json names {path}, the store of the run folder {path.parent}; this "
                f"folder has its own ({self.store}): resuming that one"
            )
        return recorded, None

    def configured_store(self, tree: Mapping[str, JSONValue]) -> str:
        """The store a saved config.json tree names for this folder (`stored_store_uri`)."""
        section = tree.get("store")
        uri = section.get("uri") if isinstance(section, Mapping) else None
        return self.stored_store_uri(uri if isinstance(uri, str) else "")[0]

    def exists(self) -> bool:
        return self.root.exists()

    def is_run(self) -> bool:
        """True when this folder holds a run (its resolved config is there)."""
        return self.config_json.is_file()

    def create(self, *, overwrite: bool = False) -> None:
        """Make the folder and its sub-folders; an existing folder only with overwrite."""
        if self.root.exists():
            if not overwrite:
                raise FileExistsError(str(self.root))
            shutil.rmtree(self.root)
        for sub in (self.root, self.logs, self.plots, self.checkpoints):
            sub.mkdir(parents=True, exist_ok=True)

    # -- driver state
    @property
    def driver_backup(self) -> Path:
        """The same state as driver.json, written right after it (never both at once)."""
        return self.root / "driver.json.bak"

    def read_driver(self) -> JSONDict:
        """driver.json's state ({} when there is none); a damaged one is replaced by its
        backup (`driver_damage` says so)."""
        return self.read_driver_checked()[0]

    def driver_damage(self) -> str | None:
        """Why driver.json cannot be read as written, and what is shown instead, or None."""
        return self.read_driver_checked()[1]

    def read_driver_checked(self) -> tuple[JSONDict, str | None]:
        """(driver state, None) or, driver.json damaged (cut, not JSON, not an object):
        (its backup's state or {}, a sentence saying so)."""
        state, why = _read_state(self.driver_json)
        if why is None:
            return state, None
        backup, bad = _read_state(self.driver_backup)
        if bad is None and backup:
            return backup, f"driver.json is damaged ({why}); shown from driver.json.bak"
        return {}, f"driver.json is damaged ({why}) and has no usable backup"

    def write_driver(self, state: JSONDict) -> None:
        """Write driver.json atomically (a temporary file, fsynced, renamed over it), then its
        backup the same way: a crash can cut at most one of the two."""
        text = json.dumps(state, indent=1, default=str)
        for path in (self.driver_json, self.driver_backup):
            tmp = path.with_name(path.name + ".tmp")
            with tmp.open("w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)

    def update_driver(self, **changes: JSONValue) -> JSONDict:
        state = self.read_driver()
        state.update(changes)
        self.write_driver(state)
        return state


def _read_state(path: Path) -> tuple[JSONDict, str | None]:
    """(the JSON object at ``path``, None), ({}, None) when absent, or ({}, why damaged)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError) as exc:
        return {}, f"{type(exc).__name__}: {exc}"
    try:
        state = json.loads(text)
    except json.JSONDecodeError as exc:
        return {}, f"not JSON: {exc.msg} at character {exc.pos} of {len(text)}"
    if not isinstance(state, dict):
        return {}, "not a JSON object"
    return state, None


def _local_path(uri: str) -> Path | None:
    """The resolved folder of a ``file://`` (or plain path) store URI; None for a remote one
    or a URI that does not parse."""
    try:
        local = ObjectStore(uri).local_path
    except ValueError:
        return None
    return None if local is None else local.resolve()


OWNER_KEY = "run_owner.json"  # whose store this is: the run folder (and host) that claimed it


def claim_store(store: ObjectStore, folder: RunFolder) -> None:
    """Record in the store that ``folder`` owns it (every launch: a fresh run, a resume)."""
    store.put_json(
        OWNER_KEY,
        {
            "format": 1,
            "kind": "owner",
            "folder": str(folder.root),
            "name": folder.name,
            "host": socket.gethostname(),
        },
    )


def owner_conflict(store: ObjectStore, folder: RunFolder) -> str | None:
    """Which other run owns ``store`` (a sentence), or None when it is ``folder``'s, holds no
    run, or its owner's folder is gone from this host. Stores of older releases hold no
    owner record: their run_config.json's run.name decides."""
    if _local_path(store.uri) is not None and _within(_local_path(store.uri), folder.root):
        return None  # inside the folder that --overwrite replaces: its own
    try:
        doc = store.get_json(OWNER_KEY)
        config = store.get_json("run_config.json") if doc is None else None
    except ValueError:  # damaged: whose it is cannot be told
        return f"{store.uri} holds a run whose owner record cannot be read"
    if isinstance(doc, dict) and isinstance(doc.get("folder"), str):
        owner = Path(doc["folder"])
        if owner == folder.root:
            return None
        if doc.get("host") == socket.gethostname() and not (owner / "config.json").is_file():
            return None  # its run folder is gone: nobody else's any more
        return f"{store.uri} belongs to the run folder {owner} (host {doc.get('host')})"
    run = config.get("run") if isinstance(config, dict) else None
    name = run.get("name") if isinstance(run, dict) else None
    if isinstance(name, str) and name != folder.name:
        return f"{store.uri} belongs to run {name!r} (its run_config.json)"
    return None


def _within(path: Path | None, root: Path) -> bool:
    return path is not None and (path == root or root in path.parents)
