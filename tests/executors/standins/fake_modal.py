"""A fake of the small part of the `modal` client that ModalExecutor uses (no token, no network).

It behaves like Modal where the executor can tell: a function must be spawned inside a running
app, `FunctionCall.get(timeout=0)` raises the builtin TimeoutError while the call runs, a call
past its function timeout raises `modal.exception.FunctionTimeoutError`, cancel terminates the
container, logs come back as entries with `.message`. Each spawned call runs the real
`run_replica` function body in its own local process (the "container"), with the function's
env and its named secrets' values as environment, so exit codes and logs are real.

Every call into the fake is recorded in `calls` as (name, args, kwargs), so a test can check
each one against the installed modal package's real signatures.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import modal.exception as modal_exception  # real exception classes: the adapter catches them

from .common import Container

RESULT_MARK = "@@MODAL_RESULT@@"
_RUNNER = (
    "import json, sys\n"
    "from composer_replication.executors.modal import run_replica\n"
    "r = run_replica(json.loads(sys.argv[1]), json.loads(sys.argv[2]))\n"
    f"print({RESULT_MARK!r} + json.dumps(r), flush=True)\n"
)


@dataclass
class LogEntry:
    message: str


class FakeModal:
    def __init__(
        self,
        workdir: Path,
        *,
        secrets: dict[str, dict[str, str]] | None = None,
        token: tuple[str | None, str | None] = ("ak-fakeTokenId123", "as-fakeTokenSecret456"),
    ) -> None:
        self.workdir = Path(workdir)
        self.secret_store = secrets or {}
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.spawned: list[FakeFunctionCall] = []
        self.app_runs: list[str] = []  # "enter" / "exit"
        self.running = False
        self.fail_spawn_after: int | None = None
        values = {"token_id": token[0], "token_secret": token[1]}
        self.config = SimpleNamespace(config=SimpleNamespace(get=lambda key: values.get(key)))
        self.exception = modal_exception
        fake = self

        class App:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                fake._record("App", args, kwargs)
                self.functions: list[FakeFunction] = []

            def function(self, *args: Any, **kwargs: Any):
                fake._record("App.function", args, kwargs)

                def decorate(fn: Any) -> FakeFunction:
                    f = FakeFunction(fake, fn, kwargs)
                    self.functions.append(f)
                    return f

                return decorate

            @contextmanager
            def run(self, *args: Any, **kwargs: Any):
                fake._record("App.run", args, kwargs)
                fake.running = True
                fake.app_runs.append("enter")
                try:
                    yield self
                finally:
                    fake.running = False
                    fake.app_runs.append("exit")

        class Image:
            @staticmethod
            def from_registry(*args: Any, **kwargs: Any) -> Any:
                fake._record("Image.from_registry", args, kwargs)
                return SimpleNamespace(kind="image", tag=args[0] if args else kwargs["tag"])

        class Secret:
            @staticmethod
            def from_name(*args: Any, **kwargs: Any) -> Any:
                fake._record("Secret.from_name", args, kwargs)
                return SimpleNamespace(kind="secret", name=args[0] if args else kwargs["name"])

            @staticmethod
            def from_dict(*args: Any, **kwargs: Any) -> Any:
                fake._record("Secret.from_dict", (), {})  # values are never recorded
                values = dict(args[0] if args else kwargs["env_dict"])
                name = f"ephemeral-{len(fake.secret_store)}"
                fake.secret_store[name] = values
                return SimpleNamespace(kind="secret", name=name)

        def cloud_bucket_mount(*args: Any, **kwargs: Any) -> Any:
            fake._record("CloudBucketMount", args, kwargs)
            return SimpleNamespace(kind="cloud_bucket_mount", **kwargs)

        class FunctionCall:
            @staticmethod
            def from_id(*args: Any, **kwargs: Any) -> Any:
                fake._record("FunctionCall.from_id", args, kwargs)
                call_id = args[0] if args else kwargs["function_call_id"]
                for call in fake.spawned:
                    if call.object_id == call_id:
                        return call
                raise modal_exception.NotFoundError(f"function call {call_id} not found")

        self.App, self.Image, self.Secret = App, Image, Secret
        self.CloudBucketMount, self.FunctionCall = cloud_bucket_mount, FunctionCall

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.calls.append((name, args, kwargs))

    def close(self) -> None:
        for call in self.spawned:
            call.container.kill(signal.SIGKILL)
            call.container.wait()


class FakeFunction:
    def __init__(self, fake: FakeModal, fn: Any, options: dict[str, Any]) -> None:
        self.fake, self.fn, self.options = fake, fn, options

    def with_options(self, *args: Any, **kwargs: Any) -> FakeFunction:
        self.fake._record("Function.with_options", args, kwargs)
        return FakeFunction(self.fake, self.fn, {**self.options, **kwargs})

    def spawn(self, *args: Any, **kwargs: Any) -> FakeFunctionCall:
        self.fake._record("Function.spawn", args, kwargs)
        if not self.fake.running:
            raise modal_exception.ExecutionError("Function has not been hydrated (app not running)")
        fake = self.fake
        if fake.fail_spawn_after is not None and len(fake.spawned) >= fake.fail_spawn_after:
            raise modal_exception.ResourceExhaustedError("injected: GPU quota exhausted")
        command, env = args
        container_env: dict[str, str] = dict(self.options.get("env") or {})
        for secret in self.options.get("secrets") or []:
            container_env.update(fake.secret_store[secret.name])
        call_id = f"fc-{len(fake.spawned):02d}{int(time.time() * 1000) % 100000}"
        argv = [sys.executable, "-c", _RUNNER, json.dumps(command), json.dumps(env)]
        log = fake.workdir / f"{call_id}.log"
        call = FakeFunctionCall(
            fake,
            call_id,
            Container(argv, container_env, log, str(fake.workdir)),
            self.options.get("timeout", 300),
        )
        fake.spawned.append(call)
        return call


class FakeFunctionCall:
    def __init__(self, fake: FakeModal, object_id: str, container: Container, timeout: int) -> None:
        self.fake, self.object_id, self.container, self.timeout = (
            fake,
            object_id,
            container,
            timeout,
        )
        self.cancelled = False
        self.timed_out = False

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self.fake._record("FunctionCall.get", args, kwargs)
        code = self.container.exit_code
        if code is None and time.time() - self.container.started_at > self.timeout:
            self.timed_out = True
            self.container.kill(signal.SIGKILL)
            self.container.wait()
            code = self.container.exit_code
        if code is None:
            raise TimeoutError()  # the builtin, as modal's poll_function raises
        if self.timed_out:
            raise modal_exception.FunctionTimeoutError(f"Function timed out after {self.timeout}s")
        if self.cancelled:
            raise modal_exception.RemoteError("Function call was cancelled")
        for line in self.container.text().splitlines():
            if line.startswith(RESULT_MARK):
                return json.loads(line[len(RESULT_MARK) :])
        raise modal_exception.RemoteError(f"container exited with {code} before returning")

    def cancel(self, *args: Any, **kwargs: Any) -> None:
        self.fake._record("FunctionCall.cancel", args, kwargs)
        self.cancelled = True
        # terminate_containers=True: the container goes away at once, whatever runs in it.
        self.container.kill(
            signal.SIGKILL if kwargs.get("terminate_containers") else signal.SIGTERM
        )

    @property
    def logs(self) -> FakeLogs:
        return FakeLogs(self)


class FakeLogs:
    def __init__(self, call: FakeFunctionCall) -> None:
        self.call = call

    def _entries(self) -> list[LogEntry]:
        lines = self.call.container.text().splitlines(keepends=True)
        return [LogEntry(x) for x in lines if not x.startswith(RESULT_MARK)]

    def tail(self, *args: Any, **kwargs: Any):
        self.call.fake._record("FunctionCallLogsManager.tail", args, kwargs)
        n = args[0] if args else kwargs.get("entries", 100)
        yield from self._entries()[-n:]

    def fetch(self, *args: Any, **kwargs: Any):
        self.call.fake._record("FunctionCallLogsManager.fetch", args, kwargs)
        yield from self._entries()
