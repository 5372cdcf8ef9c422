"""An OpenEnv environment as a task (optional extra `openenv`: openenv-core 0.3).

    task = get_task("openenv", env="http://127.0.0.1:8000")      # a running env server
    task = get_task("openenv:http://127.0.0.1:8000")              # the same, as in a run config
    task = get_task("openenv:coding-env:latest")                   # a Docker image (needs docker)

The task talks to the environment through openenv's own client (`GenericEnvClient`, a WebSocket
session per task object, the persistent-session API of OpenEnv servers; the server's stateless
`/reset` + `/step` routes build a fresh environment per request, so an episode cannot span them).
An image name is started with openenv's Docker launcher (`LocalDockerProvider`) on first use and
stopped when the task object is collected or the process exits.

Episodes are single-turn: one episode per completion.

* **Prompts**: `reset(seed=s)` for seeds drawn by the split's seeded RNG; the prompt is the reset
  observation's `prompt_field` (default: the first non-empty string among "prompt", "question",
  "text", "message", "instruction"). An example keeps `s` in its meta, so it is rebuilt exactly
  in any process as long as the environment is deterministic under `reset(seed=...)`; `verify`
  checks that it is (the re-reset must show the same prompt) and raises otherwise.
* **Reward** (channel 1): `reset(seed=s)`, then `step({action_field: completion})` (the completion
  cleaned of special tokens; `action_field` defaults to the action schema's one required string
  field, read from the server's `/schema`). The step's reward `r` is mapped to [0, 1] by
  `reward_range = [lo, hi]` (default [0, 1]): `(r - lo) / (hi - lo)`, clipped. The answer is
  correct when `r >= success_reward` (default `hi`).
* **Feedback** (channel 2): for an answer that is not correct, the step observation's
  `feedback_field` (default "feedback"; a non-string value is shown as compact JSON, cut to 500
  characters); when the observation has none, "The environment scored this answer R (success
  needs S)". An action the server rejects (its validation or its step raising) scores `lo` with
  the server's message as feedback.
* **Oracle** (channel 3): the reset observation's `answer_field` when given; otherwise there is no
  reference answer and the oracle teacher gives no traces (empty completions are skipped).

Everything read from the server is checked before use: observations must be JSON objects, the
prompt a non-empty string, the reward a finite number. A server that cannot be reached, that is
out of sessions, or a Docker image without a Docker daemon raises `OpenEnvUnavailable` (a
`ConnectionError`) naming the address and what to do; `check_ready()` (run by the run's
preflight) raises it before any replica starts.
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlparse

from composer_replication.json_types import JSONDict, JSONValue
from composer_replication.tasks.task import Example, Task, Verdict, clean_completion

if TYPE_CHECKING:
    from openenv.core.containers.runtime import LocalDockerProvider
    from openenv.core.sync_client import SyncEnvClient

__all__ = ["OpenEnvTask", "OpenEnvUnavailable"]

EXTRA_HINT = "install it with `pip install composer-replication[openenv]`"
PROMPT_FIELDS = ("prompt", "question", "text", "message", "instruction")
_URL_SCHEMES = ("http", "https", "ws", "wss")
# A Docker image reference: [registry[:port]/]name[/name...][:tag][@digest] (lower-case names).
_IMAGE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::\d+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)
_HOST_PORT = re.compile(r"^(?:localhost|\d{1,3}(?:\.\d{1,3}){3}|\[[0-9a-fA-F:]+\])(?::\d+)?/?$")
_SERVER_ERROR = re.compile(r"^Server error: (?P<message>.*) \(code: (?P<code>[A-Z_]+)\)$", re.S)
_FEEDBACK_LIMIT = 500
_SEED_SPACE = 2**31  # openenv's ResetRequest takes seeds >= 0


class OpenEnvUnavailable(ConnectionError):
    """The environment server cannot be used now (unreachable, out of sessions, no Docker)."""


def _require_openenv() -> ModuleType:
    try:
        from openenv.core import generic_client
    except ImportError as exc:
        raise ImportError(
            f"The openenv task needs the openenv-core package ({exc}); {EXTRA_HINT}."
        ) from exc
    return generic_client


def _server_error(exc: BaseException) -> tuple[str, str] | None:
    """(code, message) of an error the server answered with, None for any other failure."""
    match = _SERVER_ERROR.match(str(exc)) if isinstance(exc, RuntimeError) else None
    return (match["code"], match["message"]) if match else None


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


class OpenEnvTask(Task):
    """An OpenEnv environment server as a `Task` (see the module docstring).

    Args (beyond `Task`'s):
        env: the server's base URL (`http://host:port`, also https/ws/wss) or a Docker image name.
        prompt_field: reset-observation field holding the prompt (None: auto, see above).
        action_field: action field the completion is sent in (None: from the server's schema).
        feedback_field: step-observation field holding the feedback for a wrong answer.
        answer_field: reset-observation field holding a reference answer (None: no oracle).
        reward_range: `[lo, hi]` of the environment's step reward, mapped to [0, 1].
        success_reward: step reward from which an answer counts as correct (None: `hi`).
        reset_kwargs: extra keyword arguments of every `reset` (JSON values, not `seed`).
        timeout_s: seconds to wait for the server to connect or answer one message.
        capacity_wait_s: seconds to keep retrying while the server is out of sessions.
    """

    name: ClassVar[str] = "openenv"

    def __init__(
        self,
        *,
        seed: int = 0,
        n_train: int = 256,
        n_eval: int = 64,
        env: str = "",
        prompt_field: str | None = None,
        action_field: str | None = None,
        feedback_field: str = "feedback",
        answer_field: str | None = None,
        reward_range: Sequence[float] = (0.0, 1.0),
        success_reward: float | None = None,
        reset_kwargs: JSONDict | None = None,
        timeout_s: float = 60.0,
        capacity_wait_s: float = 30.0,
    ) -> None:
        super().__init__(seed=seed, n_train=n_train, n_eval=n_eval)
        self.env = self._check_env(env)
        self.is_image = urlparse(self.env).scheme not in _URL_SCHEMES
        for key, value in (
            ("prompt_field", prompt_field),
            ("action_field", action_field),
            ("answer_field", answer_field),
        ):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"openenv {key} must be a non-empty string or None, got {value!r}")
        if not isinstance(feedback_field, str) or not feedback_field:
            raise ValueError(
                f"openenv feedback_field must be a non-empty string, got {feedback_field!r}"
            )
        if (
            not isinstance(reward_range, Sequence)
            or isinstance(reward_range, str)
            or len(reward_range) != 2
        ):
            raise ValueError(f"openenv reward_range must be [lo, hi], got {reward_range!r}")
        lo = _number(reward_range[0], "openenv reward_range[0]")
        hi = _number(reward_range[1], "openenv reward_range[1]")
        if not lo < hi:
            raise ValueError(f"openenv reward_range must have lo < hi, got [{lo}, {hi}]")
        success = (
            hi if success_reward is None else _number(success_reward, "openenv success_reward")
        )
        if not lo < success <= hi:
            raise ValueError(
                f"openenv success_reward must lie in ({lo}, {hi}] (the reward_range), got {success}"
            )
        reset_kwargs = dict(reset_kwargs or {})
        if "seed" in reset_kwargs:
            raise ValueError("openenv reset_kwargs must not set 'seed'; the task's split draws it")
        try:
            json.dumps(reset_kwargs)
        except TypeError as exc:
            raise ValueError(f"openenv reset_kwargs must be JSON values: {exc}") from None
        if _number(timeout_s, "openenv timeout_s") <= 0:
            raise ValueError(f"openenv timeout_s must be > 0, got {timeout_s!r}")
        if _number(capacity_wait_s, "openenv capacity_wait_s") < 0:
            raise ValueError(f"openenv capacity_wait_s must be >= 0, got {capacity_wait_s!r}")
        self.prompt_field = prompt_field
        self.action_field = action_field
        self.feedback_field = feedback_field
        self.answer_field = answer_field
        self.reward_range = (lo, hi)
        self.success_reward = success
        self.reset_kwargs = reset_kwargs
        self.timeout_s = float(timeout_s)
        self.capacity_wait_s = float(capacity_wait_s)
        self._client: SyncEnvClient | None = None  # opened on first use
        self._base_url: str | None = None if self.is_image else self.env
        self._close: Callable[[], None] | None = None
        # One session, one episode at a time: a reset and its step must not interleave with
        # another thread's (an evaluation callback, say).
        self._lock = threading.RLock()

    @staticmethod
    def _check_env(env: object) -> str:
        if not isinstance(env, str) or not env.strip():
            raise ValueError(
                "the openenv task needs the environment: name the task 'openenv:URL_OR_IMAGE' "
                "(e.g. 'openenv:http://127.0.0.1:8000') or pass env='http://host:port'"
            )
        env = env.strip()
        parsed = urlparse(env)
        if parsed.scheme in _URL_SCHEMES:
            try:
                port = parsed.port
            except ValueError:
                port = None
            bad_port = port is None and re.search(r":[^\]]*$", parsed.netloc)  # "h:", "h:x"
            if not parsed.hostname or bad_port:
                raise ValueError(
                    f"openenv env {env!r} has no valid host and port; give http://host:port"
                )
            return env.rstrip("/")
        if _HOST_PORT.match(env):
            raise ValueError(
                f"openenv env {env!r} looks like an address without a scheme; "
                f"did you mean 'http://{env}'?"
            )
        if "://" in env or not _IMAGE.match(env):
            raise ValueError(
                f"openenv env {env!r} is neither an http(s)/ws(s) URL of a running OpenEnv "
                "server nor a Docker image name such as 'coding-env:latest'"
            )
        return env

    # ---- connection ---------------------------------------------------------------------------

    def _where(self) -> str:
        if self.is_image:
            return f"the OpenEnv container of image {self.env!r}" + (
                f" at {self._base_url}" if self._base_url else ""
            )
        return f"the OpenEnv server at {self.env}"

    def _start_container(self) -> LocalDockerProvider:
        """openenv's Docker launcher: start the image, wait for /health; return the provider."""
        from openenv.core.containers.runtime import LocalDockerProvider

        try:
            provider = LocalDockerProvider()
        except RuntimeError as exc:  # raised when `docker version` fails
            raise OpenEnvUnavailable(
                f"openenv env {self.env!r} is a Docker image, but Docker is not available here "
                f"({exc}); install Docker (and start its daemon), or start the environment "
                "server yourself and name the task 'openenv:http://HOST:PORT'"
            ) from None
        try:
            self._base_url = provider.start_container(self.env)
            provider.wait_for_ready(self._base_url, timeout_s=max(self.timeout_s, 30.0))
        except (RuntimeError, TimeoutError) as exc:
            provider.stop_container()
            raise OpenEnvUnavailable(
                f"could not start OpenEnv image {self.env!r} with Docker: {exc}"
            ) from None
        return provider

    def _connect(self) -> SyncEnvClient:
        if self._client is not None:
            return self._client
        generic_client = _require_openenv()
        provider = self._start_container() if self.is_image else None
        assert self._base_url is not None
        client = generic_client.GenericEnvClient(
            base_url=self._base_url,
            connect_timeout_s=self.timeout_s,
            message_timeout_s=self.timeout_s,
            provider=provider,
        ).sync()
        try:
            client.connect()
        except ConnectionError as exc:
            self._close_client(client)
            raise OpenEnvUnavailable(
                f"cannot reach {self._where()} ({exc}); start the environment server (see "
                "docs/recipes/openenv.md) or fix the URL in task.name"
            ) from None
        self._client = client
        # Closing the client also stops a container it started. Runs at most once: when the task
        # object is collected, at interpreter exit, or on close().
        self._close = weakref.finalize(self, OpenEnvTask._close_client, client)
        return client

    @staticmethod
    def _close_client(client: SyncEnvClient) -> None:
        try:
            client.close()
        except Exception:  # best effort: the session may already be gone
            pass

    def close(self) -> None:
        """Close the session (and stop a container this task started). Reopened on next use."""
        with self._lock:
            if self._close is not None:
                self._close()
            self._client = None
            self._close = None

    def _request(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """One client call (`reset` or `step`), reconnecting once after a dropped session and
        waiting up to `capacity_wait_s` while the server is out of sessions. Errors the server
        answered with (its validation, its environment raising) propagate as RuntimeError."""
        from websockets.exceptions import ConnectionClosed  # an openenv-core dependency

        deadline = time.monotonic() + self.capacity_wait_s
        reconnected = False
        while True:
            fresh = self._client is None
            client = self._connect()
            try:
                return getattr(client, op)(*args, **kwargs)
            except Exception as exc:
                error = _server_error(exc)
                # A server out of sessions answers a new connection with CAPACITY_REACHED and
                # closes it; the close can overtake the answer, so a new session closed before
                # its first answer counts as refused too.
                refused = (error is not None and error[0] == "CAPACITY_REACHED") or (
                    fresh and isinstance(exc, ConnectionClosed)
                )
                if refused:
                    self.close()
                    if time.monotonic() >= deadline:
                        detail = error[1] if error is not None else "it closed each new session"
                        raise OpenEnvUnavailable(
                            f"{self._where()} has no free session ({detail}); start it with "
                            "max_concurrent_envs >= 2 x the number of replicas + 1 (each "
                            "replica may hold two, the driver's preflight one), or run fewer "
                            "replicas"
                        ) from None
                    time.sleep(0.5)
                    continue
                if error is not None or not isinstance(exc, OSError | ConnectionClosed):
                    raise
                self.close()  # OSError covers ConnectionError and the message timeout
                if not reconnected:
                    reconnected = True
                    continue
                raise OpenEnvUnavailable(
                    f"lost the session with {self._where()} during {op} "
                    f"({type(exc).__name__}: {exc}); is the server still running?"
                ) from None

    def _observation(self, result: object, what: str) -> JSONDict:
        obs = getattr(result, "observation", None)
        if not isinstance(obs, dict):
            raise ValueError(
                f"{self._where()} answered {what} with observation {obs!r}; expected a JSON object"
            )
        return obs

    def _reset(self, seed: int) -> JSONDict:
        try:
            result = self._request("reset", seed=seed, **self.reset_kwargs)
        except RuntimeError as exc:  # the server's own error answer
            raise ValueError(f"{self._where()} failed reset(seed={seed}): {exc}") from None
        return self._observation(result, f"reset(seed={seed})")

    def _prompt_of(self, obs: Mapping[str, JSONValue]) -> str:
        if self.prompt_field is not None:
            value = obs.get(self.prompt_field)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(
                    f"{self._where()}: the reset observation's {self.prompt_field!r} is "
                    f"{value!r}, not a non-empty string; its fields are {self._fields(obs)}; set "
                    "task.options.prompt_field"
                )
            return value
        for key in PROMPT_FIELDS:
            value = obs.get(key)
            if isinstance(value, str) and value.strip():
                return value
        raise ValueError(
            f"{self._where()}: the reset observation has none of the prompt fields "
            f"{list(PROMPT_FIELDS)} as a non-empty string; its fields are {self._fields(obs)}; set "
            "task.options.prompt_field to the one holding the prompt"
        )

    @staticmethod
    def _fields(obs: Mapping[str, JSONValue]) -> str:
        return ", ".join(f"{k} ({type(v).__name__})" for k, v in obs.items()) or "(none)"

    def _resolve_action_field(self) -> str:
        """`action_field`, or the one required string field of the server's action schema."""
        if self.action_field is not None:
            return self.action_field
        self._connect()
        import requests  # an openenv-core dependency

        url = f"{self._base_url}/schema"
        if url.startswith("ws"):
            url = "http" + url[2:]
        try:
            response = requests.get(url, timeout=self.timeout_s)
            response.raise_for_status()
            schema = response.json()["action"]
            properties = schema["properties"]
            required = schema.get("required", [])
            if not isinstance(properties, dict) or not isinstance(required, list):
                raise TypeError("properties/required have the wrong types")
        except Exception as exc:  # unreachable, not JSON, not OpenEnv's schema shape
            raise ValueError(
                f"cannot read the action schema of {self._where()} from {url} "
                f"({type(exc).__name__}: {exc}); set task.options.action_field"
            ) from None
        strings = [
            k
            for k, v in properties.items()
            if k != "metadata" and isinstance(v, dict) and v.get("type") == "string"
        ]
        chosen = [k for k in strings if k in required] or strings
        if len(chosen) != 1:
            raise ValueError(
                f"{self._where()}: cannot tell which action field takes the completion (string "
                f"fields: {strings or 'none'}; all fields: {sorted(properties)}); set "
                "task.options.action_field"
            )
        self.action_field = chosen[0]
        return self.action_field

    # ---- the Task contract --------------------------------------------------------------------

    def check_ready(self) -> None:
        """Connect (starting the container for an image), reset once, find the prompt and the
        action field: a bad server or option fails here, before any replica starts."""
        with self._lock:
            self._prompt_of(self._reset(0))
            self._resolve_action_field()

    def _sample(self, rng: random.Random) -> tuple[str, str, JSONDict]:
        seed = rng.randrange(_SEED_SPACE)
        with self._lock:
            obs = self._reset(seed)
        answer = ""
        if self.answer_field is not None:
            value = obs.get(self.answer_field)
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                raise ValueError(
                    f"{self._where()}: the reset observation's {self.answer_field!r} is "
                    f"{value!r}, not a string or number (task.options.answer_field)"
                )
            answer = str(value)
        return self._prompt_of(obs), answer, {"reset_seed": seed}

    def oracle(self, example: Example) -> str:
        """The reference answer from `answer_field`; "" (no trace) without one."""
        return example.answer

    def _wrong_answers(self, example: Example) -> list[str]:
        return super()._wrong_answers(example) if example.answer else [""]

    def verify(self, example: Example, completion: str) -> Verdict:
        seed = example.meta.get("reset_seed")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_SPACE:
            raise ValueError(
                f"example {example.id!r} was not drawn by the openenv task (meta needs an int "
                "'reset_seed')"
            )
        with self._lock:
            return self._episode(example, seed, completion)

    def _episode(self, example: Example, seed: int, completion: str) -> Verdict:
        action_field = self._resolve_action_field()
        prompt = self._prompt_of(self._reset(seed))
        if prompt != example.prompt:
            raise ValueError(
                f"{self._where()} is not reproducible: reset(seed={seed}) now gives the prompt "
                f"{prompt[:80]!r}, not {example.prompt[:80]!r} as when the split was drawn; the "
                "environment must derive its episode from the reset seed"
            )
        lo, hi = self.reward_range
        try:
            result = self._request("step", {action_field: clean_completion(completion)})
        except RuntimeError as exc:
            error = _server_error(exc)
            if error is None:
                raise
            return Verdict(
                0.0, False, f"The environment rejected the answer: {error[1][:_FEEDBACK_LIMIT]}"
            )
        obs = self._observation(result, "step")
        raw = getattr(result, "reward", None)  # OpenEnv allows bool | int | float | None
        raw = float(raw) if isinstance(raw, bool) else raw
        if not isinstance(raw, int | float) or not math.isfinite(raw):
            raise ValueError(
                f"{self._where()}: the step reward must be a finite number, got {raw!r}; the "
                "task scores each completion by its episode's first step"
            )
        reward = min(1.0, max(0.0, (raw - lo) / (hi - lo)))
        if raw >= self.success_reward:
            return Verdict(reward, True, None)
        return Verdict(reward, False, self._feedback(obs, raw))

    def _feedback(self, obs: Mapping[str, JSONValue], raw: float) -> str:
        value = obs.get(self.feedback_field)
        if isinstance(value, str):
            text = value.strip()
        elif value is None:
            text = ""
        else:
            text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
        if not text:
            return f"The environment scored this answer {raw:g} (success needs {self.success_reward:g})."
        return text if len(text) <= _FEEDBACK_LIMIT else text[: _FEEDBACK_LIMIT - 3] + "..."
