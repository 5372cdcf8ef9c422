"""The run folder `<runs_dir>/<name>/`: everything one training run leaves behind.

    config.toml        the resolved configuration (load it again with `train config.toml`)
    config.json        the same, as the replicas received it
    driver.json        driver state: status, start/end, replica handles, exit codes
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
    def read_driver(self) -> dict[str, Any]:
        try:
            return json.loads(self.driver_json.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def write_driver(self, state: dict[str, Any]) -> None:
        tmp = self.driver_json.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=1, default=str))
        os.replace(tmp, self.driver_json)

    def update_driver(self, **changes: object) -> dict[str, Any]:
        state = self.read_driver()
        state.update(changes)
        self.write_driver(state)
        return state
