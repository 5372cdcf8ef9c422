"""A real OpenEnv environment server on 127.0.0.1 for tests (pytest plugin, see tests/conftest.py).

The server is examples/openenv/sum_env.py (`SumEnv`, written with openenv-core's own server
framework and served by uvicorn) in a subprocess on a free port. `problem` and `score` are that
module's: the environment's own rule, which the tests compare the task adapter's rewards and
feedback with.

Fixture: ``openenv_server`` (one server per test module, started on first use) yields the base
URL ``http://127.0.0.1:PORT``; ``run_openenv_server(log_dir)`` is the same as a context manager (a
server of one's own, e.g. to kill it). Module scope, not session scope: the server holds at most
``max_sessions`` sessions, and a test elsewhere that leaves sessions open (a replica killed by a
timeout) must not make the next module's tests fail with "no free session".
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "openenv" / "sum_env.py"
_spec = importlib.util.spec_from_file_location("sum_env", SCRIPT)
assert _spec is not None and _spec.loader is not None
sum_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sum_env)  # imports nothing of openenv until a server is built
problem = sum_env.problem
score = sum_env.score


@contextlib.contextmanager
def run_openenv_server(log_dir: Path) -> Iterator[str]:
    """Start the server in a subprocess; yield its base URL; stop it (SIGTERM, then SIGKILL)."""
    log_path = log_dir / "openenv_server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # blocks until the server listens (or dies)
            if not line.startswith("PORT "):
                log.flush()
                raise RuntimeError(f"OpenEnv test server did not start: {log_path.read_text()}")
            # Keep reading what the server prints: an undrained pipe fills up (64 KiB) and then
            # blocks the server in its next print, which a test sees as a hung environment.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            yield f"http://127.0.0.1:{int(line.split()[1])}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def openenv_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("openenv", reason="needs the `openenv` extra (openenv-core)")
    # openenv.core takes seconds to import (it loads its web UI's stack); pay it here, once, not
    # in whichever test connects first
    import openenv.core.generic_client  # noqa: F401

    with run_openenv_server(tmp_path_factory.mktemp("openenv")) as url:
        yield url
