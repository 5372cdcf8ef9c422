"""`composer-replication synchronizer RUN_FOLDER_OR_URI`: run a decoupled run's synchronizer.

The driver of `composer-replication train` starts one beside itself when the run's outer-loop
mode has a synchronizer it runs (``diloco.mode = "decoupled"``, ``diloco.synchronizer =
"driver"``): `SynchronizerProcess` runs ``python -m composer_replication.run.synchronizer_process
URI`` in its own process group and restarts it when it dies. With
``"external"`` run it yourself anywhere that reaches the store, as many times as you like: the
lease (exchange/lease.py) keeps exactly one active, the others wait and take over when the
active one dies (after ``diloco.lease_ttl_s``) or stops.

RUN is a run folder (its config.json names the store) or the store URI itself (its
run_config.json, written by the driver, holds the configuration). fsspec options come from
``--storage-options`` or $COMPOSER_STORAGE_OPTIONS (JSON). A signed run (``[security] sign``)
needs the synchronizer's keys in the environment, as the driver hands them to the one it runs:
``$COMPOSER_DRIVER_PUBLIC_KEY`` and ``$COMPOSER_SIGNING_KEY`` (the ``synchronizer`` key of the
run folder's signing-keys.json); the key manifest and the run configuration are checked against
the driver's signature before anything is merged. Exit codes: 0 the run's final
versions are written, 1 an error, 2 unusable arguments, 3 fenced (the driver-run synchronizer
of a launch the run has since been resumed from: ``$COMPOSER_RUN_GENERATION`` is older than the
store's run generation, exchange/fencing.py; it writes nothing more, not even a heartbeat), 130
stopped (SIGTERM/SIGINT: the lease is released so another synchronizer can take over at once).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from composer_replication.assembly.outer import build_synchronizer
from composer_replication.exchange.fencing import Fence, FencedError
from composer_replication.exchange.signing import SYNCHRONIZER, RunKeys
from composer_replication.executors.local import spawn_in_group, terminate_groups
from composer_replication.json_types import JSONDict
from composer_replication.run.replica_env import ENV_GENERATION, EXIT_FENCED
from composer_replication.run.security import participant_keys, slot_secret_from_env

if TYPE_CHECKING:
    from types import FrameType

    from composer_replication.config import RunConfig
    from composer_replication.exchange.store import ObjectStore

__all__ = ["SynchronizerProcess", "main"]

MODULE = "composer_replication.run.synchronizer_process"
CONFIG_KEY = "run_config.json"


def resolve(target: str, storage_options: JSONDict | None) -> tuple[RunConfig, ObjectStore]:
    """(run config, store) of a run folder or a store URI (ValueError saying what is missing)."""
    from composer_replication.config import from_dict
    from composer_replication.config.schema import RunConfig
    from composer_replication.exchange.store import ObjectStore

    folder = Path(target)
    if folder.is_dir() and (folder / "config.json").is_file():
        from composer_replication.run.folder import RunFolder

        tree = json.loads((folder / "config.json").read_text())
        config = from_dict(RunConfig, tree)
        options = storage_options if storage_options is not None else config.store.storage_options
        uri = RunFolder.at(folder).stored_store_uri(config.store.uri)[0]  # "": its store/
        return config, ObjectStore(uri, options)
    if folder.is_dir() and "://" not in target and not (folder / CONFIG_KEY).is_file():
        raise ValueError(
            f"{target} is neither a run folder (no config.json) nor a store (no {CONFIG_KEY})"
        )
    store = ObjectStore(target, storage_options)
    doc = store.get_json(CONFIG_KEY)
    if doc is None:
        raise ValueError(
            f"no {CONFIG_KEY} in {store.uri}: start the run with "
            "`composer-replication train` (it writes the configuration)"
        )
    if not isinstance(doc, dict):
        raise ValueError(f"{CONFIG_KEY} in {store.uri} is not a JSON object")
    return from_dict(RunConfig, doc), store


def signing_keys(config: RunConfig, store: ObjectStore) -> tuple[RunConfig, RunKeys | None]:
    """The synchronizer's signing keys from its environment (``$COMPOSER_DRIVER_PUBLIC_KEY``
    and its own ``$COMPOSER_SIGNING_KEY``, as a replica gets its rank's), after checking the
    key manifest and the run configuration in the store against the driver's signature; with
    keys, the configuration is the one the driver signed. ValueError saying what is missing."""
    from composer_replication.config import from_dict
    from composer_replication.config.schema import RunConfig

    doc = store.get_json(CONFIG_KEY)
    if not isinstance(doc, dict):
        if config.security.sign:
            raise ValueError(f"[security] sign = true but {store.uri} has no {CONFIG_KEY}")
        return config, None
    keys = participant_keys(store, SYNCHRONIZER, doc, required=config.security.sign)
    if keys is None:
        return config, None
    return from_dict(RunConfig, doc), keys


def _fence(store: ObjectStore) -> int | None:
    """A driver-run synchronizer ($COMPOSER_RUN_GENERATION set by the driver) writes only while
    its launch is the run's newest: the store's write guard checks the run generation before
    every write (exchange/fencing.py). Returns that generation (None: run by hand, not fenced,
    as an external synchronizer outlives driver restarts by design)."""
    raw = os.environ.get(ENV_GENERATION)
    if raw is None:
        return None
    if not raw.isdigit():
        raise ValueError(f"${ENV_GENERATION}={raw!r} is not an integer >= 0")
    # with the run's slot secret only a launch of the run can fence it (a planted document
    # cannot)
    store.write_guard = Fence(store, int(raw), secret=slot_secret_from_env())
    return int(raw)


def run(config: RunConfig, store: ObjectStore, stop: threading.Event | None = None) -> int:
    """Run the synchronizer until the run is final (0), ``stop`` is set (130) or a newer launch
    of the run fenced it (`EXIT_FENCED`)."""
    generation = _fence(store)
    try:
        return _run(config, store, stop)
    except FencedError as exc:  # a resumed run's synchronizer owns the store now
        print(f"synchronizer (launch {generation}): {exc}", file=sys.stderr, flush=True)
        return EXIT_FENCED


def _run(config: RunConfig, store: ObjectStore, stop: threading.Event | None) -> int:
    config, keys = signing_keys(config, store)
    sync = build_synchronizer(config, store, keys=keys)  # ValueError: the mode has none
    if stop is not None:

        def relay() -> None:
            stop.wait()
            sync.stop()

        threading.Thread(target=relay, daemon=True).start()
    print(f"synchronizer {sync.owner}: run {config.run.name} at {store.uri}", flush=True)
    finished = sync.run()
    print(
        f"synchronizer {sync.owner}: {'final versions ' + str(sync.versions) if finished else 'stopped'}"
        f"; {json.dumps(sync.stats.as_dict())}",
        flush=True,
    )
    return 0 if finished else 130


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="composer-replication synchronizer",
        description="Run the synchronizer of a decoupled run.",
    )
    p.add_argument("run", metavar="RUN_FOLDER_OR_URI", help="a run folder or the run's store URI")
    p.add_argument(
        "--storage-options",
        default=None,
        help="fsspec options as JSON (default: $COMPOSER_STORAGE_OPTIONS or the run's)",
    )
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        raw = ns.storage_options or os.environ.get("COMPOSER_STORAGE_OPTIONS")
        options = None if raw is None else json.loads(raw)
        if options is not None and not isinstance(options, dict):
            raise ValueError("storage options must be a JSON object")
        config, store = resolve(ns.run, options)
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"synchronizer: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous: dict[signal.Signals, Callable[[int, FrameType | None], object] | int | None] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        return run(config, store, stop)
    except ValueError as exc:
        print(f"synchronizer: error: {exc}", file=sys.stderr)
        return 2
    finally:  # called in-process (the CLI, tests): give the caller its handlers back
        for prev_sig, handler in previous.items():
            signal.signal(prev_sig, handler)


class SynchronizerProcess:
    """The driver's synchronizer: a subprocess in its own process group, restarted when it
    dies (a crash, or `kill` by the chaos harness with a restart delay), stopped at the end."""

    def __init__(
        self, uri: str, env: dict[str, str], log_path: Path, *, max_restarts: int = 100
    ) -> None:
        self.command = [sys.executable, "-m", MODULE, uri]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        self.log_path = log_path
        self.max_restarts = max_restarts
        self.restarts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._not_before = 0.0
        self._lock = threading.Lock()
        self.exit_codes: list[int] = []

    @property
    def pid(self) -> int | None:
        with self._lock:
            return None if self.proc is None or self.proc.poll() is not None else self.proc.pid

    def start(self) -> None:
        with self._lock:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            # it dies with the driver (a resumed run starts its own; never two merging)
            self.proc = spawn_in_group(
                self.command, self.env, None, str(self.log_path), die_with_parent=True
            )

    def ensure_running(self) -> bool:
        """Restart it if it died (not before a requested delay); False once it finished (0)."""
        with self._lock:
            proc = self.proc
        if proc is None:
            self.start()
            return True
        code = proc.poll()
        if code is None:
            return True
        if code in (0, EXIT_FENCED):  # finished, or a newer launch owns the run
            return False
        if time.monotonic() < self._not_before or self.restarts >= self.max_restarts:
            return True
        with self._lock:
            self.exit_codes.append(code)
            self.restarts += 1
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"\n=== synchronizer exited ({code}); restart {self.restarts} ===\n")
        self.start()
        return True

    def kill(self, restart_after_s: float = 0.0) -> int | None:
        """SIGKILL it (the chaos harness); `ensure_running` restarts it after the delay."""
        pid = self.pid
        self._not_before = time.monotonic() + restart_after_s
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            assert self.proc is not None
            self.proc.wait(10)
        return pid

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM (it releases its lease), then SIGKILL after ``grace_s``; the exit code."""
        with self._lock:
            proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            terminate_groups([proc], grace_s)
        return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
