"""A real OpenEnv environment server on 127.0.0.1 for tests (pytest plugin, see tests/conftest.py).

`SumEnv` is a small single-turn OpenEnv `Environment` written against openenv-core's own server
framework (`Environment`, `Action`, `Observation`, `create_fastapi_app`), served by uvicorn in a
subprocess:

- `reset(seed, offset=0)` draws `a + b` with `random.Random(seed)` (a, b in 0..`SUM_ENV_MAX`, then
  `offset` added to a) and returns the observation `{"prompt": "a+b=", "hint": ...}`;
- `step(SumAction(answer=...))` scores the answer with `score(prompt, answer)` below:
  1.0 exact, 0.0 a number within 2 of the sum, -0.5 another number, -1.0 not a number; the
  observation's `feedback` says which (empty when correct); `done` is True;
- an answer longer than 64 characters fails the action's validation (the server answers with a
  validation error, as a real environment does for a malformed action).

`score` is the independent reference the tests compare the adapter's rewards with.

Fixture: ``openenv_server`` (session-scoped, started on first use) yields the base URL ``http://127.0.0.1:PORT``. The
same server runs as ``python tests/openenv_server.py`` (prints ``PORT <n>`` once listening); the
socket is bound by this script before uvicorn starts, so there is no port race.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SUM_ENV_MAX = 20


def problem(seed: int | None, offset: int = 0) -> tuple[int, int]:
    rng = random.Random(seed)
    return rng.randint(0, SUM_ENV_MAX) + offset, rng.randint(0, SUM_ENV_MAX)


def score(prompt: str, answer: str) -> tuple[float, str]:
    """(reward, feedback) of `answer` to `prompt` ("a+b="): the environment's own rule."""
    a, b = (int(x) for x in re.findall(r"\d+", prompt))
    text = answer.strip()
    if not re.fullmatch(r"-?\d+", text):
        return -1.0, f"{text[:20]!r} is not a number; reply with the sum only."
    value = int(text)
    if value == a + b:
        return 1.0, ""
    side = "small" if value < a + b else "large"
    if abs(value - (a + b)) <= 2:
        return 0.0, f"Close, but {value} is too {side}."
    return -0.5, f"{value} is too {side}."


def _build_app() -> Any:
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class SumAction(Action):
        answer: str = Field(..., max_length=64, description="the sum, digits only")

    class SumObservation(Observation):
        prompt: str = ""
        hint: str = ""
        feedback: str = ""

    class SumEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state = State(episode_id=None, step_count=0)
            self._prompt = ""

        def reset(
            self, seed: int | None = None, episode_id: str | None = None, offset: int = 0, **_: Any
        ):
            a, b = problem(seed, offset)
            self._prompt = f"{a}+{b}="
            self._state = State(episode_id=episode_id, step_count=0)
            return SumObservation(prompt=self._prompt, hint="add the two numbers")

        def step(self, action: SumAction, timeout_s: float | None = None, **_: Any):  # type: ignore[override]
            if not self._prompt:
                raise RuntimeError("step before reset")
            self._state.step_count += 1
            reward, feedback = score(self._prompt, action.answer)
            return SumObservation(prompt=self._prompt, feedback=feedback, reward=reward, done=True)

        @property
        def state(self) -> State:
            return self._state

    return create_fastapi_app(SumEnv, SumAction, SumObservation, max_concurrent_envs=8)


@contextlib.contextmanager
def run_openenv_server(log_dir: Path) -> Iterator[str]:
    """Start the server in a subprocess; yield its base URL; stop it (SIGTERM, then SIGKILL)."""
    log = (log_dir / "openenv_server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, __file__],
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
            raise RuntimeError(
                f"OpenEnv test server did not start: {(log_dir / 'openenv_server.log').read_text()}"
            )
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def openenv_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("openenv", reason="needs the `openenv` extra (openenv-core)")
    # openenv.core takes seconds to import (it loads its web UI's stack); pay it here, once, not
    # in whichever test connects first
    import openenv.core.generic_client  # noqa: F401

    with run_openenv_server(tmp_path_factory.mktemp("openenv")) as url:
        yield url


def _serve() -> None:
    import asyncio

    import uvicorn

    app = _build_app()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, fd=sock.fileno(), log_level="warning"))

    async def announce() -> None:  # once started, the socket accepts connections
        while not server.started:
            await asyncio.sleep(0.01)
        print(f"PORT {sock.getsockname()[1]}", flush=True)

    async def main() -> None:
        announcer = asyncio.create_task(announce())
        await server.serve()
        announcer.cancel()

    asyncio.run(main())


if __name__ == "__main__":
    _serve()
