"""A small OpenEnv environment server to train against: `python examples/openenv/sum_env.py`.

`SumEnv` is a single-turn OpenEnv `Environment` written with openenv-core's own server framework
(`Environment`, `Action`, `Observation`, `create_fastapi_app`) and served by uvicorn on
127.0.0.1 (`--port`, default 8000; `--port 0` takes a free one). It prints `PORT <n>` once it
accepts connections. Needs the `openenv` extra.

- `reset(seed, offset=0, reveal=False)` draws `a + b` with `random.Random(seed)` (a, b in
  0..`SUM_ENV_MAX`, then `offset` added to a) and returns the observation
  `{"prompt": "a+b=", "hint": ..., "answer": ...}` (`answer` is the sum with `reveal`, else "");
- `step(SumAction(answer=...))` scores the answer with `score(prompt, answer)`: 1.0 exact, 0.0 a
  number within 2 of the sum, -0.5 another number, -1.0 not a number; the observation's
  `feedback` says which (empty when correct) and `done` is True;
- an answer longer than 64 characters fails the action's validation (the server answers with a
  validation error, as environments do for a malformed action).

Up to `--max-sessions` (8) WebSocket sessions at once: each replica of a run holds one or two.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import socket
from typing import Any

SUM_ENV_MAX = 20


def problem(seed: int | None, offset: int = 0) -> tuple[int, int]:
    """The two addends of the episode `reset(seed, offset)` starts."""
    rng = random.Random(seed)
    return rng.randint(0, SUM_ENV_MAX) + offset, rng.randint(0, SUM_ENV_MAX)


def score(prompt: str, answer: str) -> tuple[float, str]:
    """(reward, feedback) of `answer` to `prompt` ("a+b="): the environment's rule."""
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


def build_app(max_sessions: int = 8) -> Any:
    """The FastAPI app serving `SumEnv` (OpenEnv's HTTP + WebSocket routes)."""
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
        answer: str = ""

    class SumEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True  # no state shared between sessions

        def __init__(self) -> None:
            super().__init__()
            self._state = State(episode_id=None, step_count=0)
            self._prompt = ""

        def reset(
            self,
            seed: int | None = None,
            episode_id: str | None = None,
            offset: int = 0,
            reveal: bool = False,
            **_: Any,
        ) -> SumObservation:
            a, b = problem(seed, offset)
            self._prompt = f"{a}+{b}="
            self._state = State(episode_id=episode_id, step_count=0)
            answer = str(a + b) if reveal else ""
            return SumObservation(prompt=self._prompt, hint="add the two numbers", answer=answer)

        def step(self, action: Any, timeout_s: float | None = None, **_: Any) -> SumObservation:
            if not self._prompt:
                raise RuntimeError("step before reset")
            self._state.step_count += 1
            reward, feedback = score(self._prompt, action.answer)
            return SumObservation(prompt=self._prompt, feedback=feedback, reward=reward, done=True)

        @property
        def state(self) -> State:
            return self._state

    return create_fastapi_app(SumEnv, SumAction, SumObservation, max_concurrent_envs=max_sessions)


def serve(port: int = 8000, max_sessions: int = 8) -> None:
    """Serve on 127.0.0.1:`port` until interrupted; print `PORT <n>` once listening."""
    import uvicorn

    app = build_app(max_sessions)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))  # bound here, so `--port 0` reports the port it got
    server = uvicorn.Server(uvicorn.Config(app, fd=sock.fileno(), log_level="warning"))

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        print(f"PORT {sock.getsockname()[1]}", flush=True)

    async def main() -> None:
        announcer = asyncio.create_task(announce())
        await server.serve()
        announcer.cancel()

    asyncio.run(main())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="0 = a free port")
    parser.add_argument("--max-sessions", type=int, default=8)
    args = parser.parse_args()
    serve(args.port, args.max_sessions)
