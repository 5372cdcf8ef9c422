"""Pieces shared by the stand-ins: a threaded loopback HTTP server and a local "container"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def rfc3339(t: float | None) -> str | None:
    """Kubernetes/HF style timestamp (UTC, 'Z')."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class Container:
    """One local process standing in for a container: argv + env, output to a log file.

    `exit_code` follows the container runtimes' convention: a process killed by signal S
    reports 128 + S (SIGTERM -> 143), which is what Kubernetes, HF Jobs and SageMaker show.
    """

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, cwd: str) -> None:
        self.log_path = log_path
        self.started_at = time.time()
        self.finished_at: float | None = None
        self._log = open(log_path, "wb")
        full_env = dict(os.environ)
        full_env.update(env)
        try:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                argv,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
            self._spawn_error: int | None = None
        except OSError as exc:  # like a runtime's "executable not found": exit 127
            self._log.write(f"exec failed: {exc}\n".encode())
            self._log.flush()
            self.proc = None
            self._spawn_error = 127
            self.finished_at = time.time()

    @property
    def exit_code(self) -> int | None:
        if self.proc is None:
            return self._spawn_error
        rc = self.proc.poll()
        if rc is None:
            return None
        if self.finished_at is None:
            self.finished_at = time.time()
            self._log.close()
        return 128 - rc if rc < 0 else rc

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(timeout)
        _ = self.exit_code

    def text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class JobLoop(ABC):
    """Base of the stand-ins whose jobs move on by themselves.

    `_start_loop()` (at the end of __init__) starts a daemon thread that calls `_tick()` every
    50 ms under `self._lock` (the lock `handle` takes too); `close()` stops it, then kills and
    reaps every container still listed by `_containers()`.
    """

    def _start_loop(self) -> None:
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            with self._lock:
                self._tick()

    @abstractmethod
    def _tick(self) -> None:
        """Advance every job one step (called with the lock held)."""

    @abstractmethod
    def _containers(self) -> Iterable[Container | None]:
        """Every job's (or pod's) container, None where none was started."""

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with self._lock:
            for container in self._containers():
                if container is not None:
                    container.kill()
                    container.wait()


class StandinServer:
    """A ThreadingHTTPServer on 127.0.0.1 that dispatches to `app.handle(method, path, ...)`.

    `app.handle` returns (status, body, content_type) where body is bytes, a JSON-able object,
    or an iterator of bytes (streamed with chunked encoding, used for server-sent events).
    Every request is recorded in `app.requests` as (method, path, headers, parsed body).
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        handler = _make_handler(app)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> StandinServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        close = getattr(self.app, "close", None)
        if close is not None:
            close()


def _make_handler(app: Any) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

        def _dispatch(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body: Any = json.loads(raw) if raw else None
            except ValueError:
                body = raw
            headers = {k.lower(): v for k, v in self.headers.items()}
            app.requests.append((method, self.path, headers, body))
            status, payload, ctype = app.handle(method, self.path, headers, body)
            if isinstance(payload, bytes | str | dict | list) or payload is None:
                data = (
                    payload.encode()
                    if isinstance(payload, str)
                    else payload
                    if isinstance(payload, bytes)
                    else b""
                    if payload is None
                    else json.dumps(payload).encode()
                )
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            # A stream: chunked transfer encoding, one chunk per item.
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for chunk in payload:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_DELETE(self) -> None:
            self._dispatch("DELETE")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def do_PATCH(self) -> None:
            self._dispatch("PATCH")

    return Handler
