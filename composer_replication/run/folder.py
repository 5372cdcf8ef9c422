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

An existing folder is never reused unless the caller asks to resume or overwrite.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunFolder", "default_run_name"]


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

    def read_driver(self) -> dict[str, Any]:
        """driver.json's state ({} when there is none); a damaged one is replaced by its
        backup (`driver_damage` says so)."""
        return self.read_driver_checked()[0]

    def driver_damage(self) -> str | None:
        """Why driver.json cannot be read as written, and what is shown instead, or None."""
        return self.read_driver_checked()[1]

    def read_driver_checked(self) -> tuple[dict[str, Any], str | None]:
        """(driver state, None) or, driver.json damaged (cut, not JSON, not an object):
        (its backup's state or {}, a sentence saying so)."""
        state, why = _read_state(self.driver_json)
        if why is None:
            return state, None
        backup, bad = _read_state(self.driver_backup)
        if bad is None and backup:
            return backup, f"driver.json is damaged ({why}); shown from driver.json.bak"
        return {}, f"driver.json is damaged ({why}) and has no usable backup"

    def write_driver(self, state: dict[str, Any]) -> None:
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

    def update_driver(self, **changes: object) -> dict[str, Any]:
        state = self.read_driver()
        state.update(changes)
        self.write_driver(state)
        return state


def _read_state(path: Path) -> tuple[dict[str, Any], str | None]:
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
