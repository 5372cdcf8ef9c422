"""`ThrottleProxy`: a TCP proxy in front of an S3 endpoint that the chaos harness throttles.

Every replica (and the synchronizer) is pointed at `ThrottleProxy.endpoint` instead of the S3
server: "throttle" limits the bytes per second through it, "read_only" answers every write
(PUT, POST, DELETE) with S3's 403 AccessDenied, as a bucket whose write permission was taken
away does, and a kill ``during="upload"`` finds a PUT in flight through it (`inflight_puts`) to
cut in the middle.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import TypedDict

__all__ = ["ThrottleProxy"]


class Request(TypedDict):
    """One HTTP request the proxy is following on a client connection."""

    method: str
    path: str
    sent: int  # body bytes forwarded so far
    length: int  # the Content-Length


WRITE_METHODS = frozenset({"PUT", "POST", "DELETE"})


def _access_denied(path: str) -> bytes:
    """S3's answer to a write the caller may not make: 403 AccessDenied; the connection then
    closes (the request's body, if any, is not read)."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
        f"<Message>Access Denied (the store is read-only)</Message><Resource>{path}</Resource>"
        "</Error>"
    ).encode()
    head = (
        "HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head + body


class ThrottleProxy:
    """A TCP proxy on 127.0.0.1 in front of an S3 endpoint: limits bytes per second (both
    directions, shared) while throttled, refuses writes with 403 AccessDenied while read-only,
    and tracks the PUT requests in flight (method, path, body bytes sent and expected), so the
    harness can kill a client half-way through one.

    Point the replicas' ``endpoint_url`` at `endpoint`.
    """

    def __init__(self, upstream: str) -> None:
        m = re.match(r"^https?://([^:/]+):(\d+)", upstream)
        if m is None:
            raise ValueError(f"ThrottleProxy needs an http://host:port endpoint, got {upstream!r}")
        self.upstream = (m.group(1), int(m.group(2)))
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(128)
        self.port = self._server.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.rate: float | None = None  # bytes per second while throttled
        self.writes_refused = False  # read-only: writes answered 403 AccessDenied
        self.refused = 0  # writes refused so far
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._last = time.monotonic()
        self._inflight: dict[int, Request] = {}
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="chaos-proxy", daemon=True)
        self._thread.start()

    def throttle(self, rate_bytes_s: float | None) -> None:
        """Limit to ``rate_bytes_s`` (None: full speed)."""
        with self._lock:
            self.rate = rate_bytes_s
            self._tokens = 0.0
            self._last = time.monotonic()

    def read_only(self, on: bool) -> None:
        """Refuse every write (PUT, POST, DELETE) with 403 AccessDenied (True) or pass them on."""
        with self._lock:
            self.writes_refused = on

    def inflight_puts(self) -> list[Request]:
        """PUT requests whose body has started but not finished: {path, sent, length}."""
        with self._lock:
            return [
                r.copy()
                for r in self._inflight.values()
                if r["method"] == "PUT" and 0 < r["sent"] < r["length"]
            ]

    def close(self) -> None:
        self._stop.set()
        try:
            self._server.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.close()
            except OSError:
                pass

    def _take(self, n: int) -> None:
        """Block until ``n`` bytes may pass (token bucket at the current rate)."""
        while True:
            with self._lock:
                rate = self.rate
                if rate is None:
                    return
                now = time.monotonic()
                self._tokens = min(rate * 0.05, self._tokens + (now - self._last) * rate)
                self._last = now
                if self._tokens >= n or self._tokens >= rate * 0.05:
                    self._tokens -= n
                    return
                wait = (min(n, rate * 0.05) - self._tokens) / rate
            time.sleep(max(wait, 0.001))

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            cid = id(client)
            threading.Thread(
                target=self._pump, args=(client, upstream, cid, True), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(upstream, client, cid, False), daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, cid: int, requests: bool) -> None:
        """Copy ``src`` to ``dst`` (throttled). On a client's side (``requests``) the bytes are
        parsed into requests first, and a write refused while read-only is answered here."""
        buf = b""
        try:
            while True:
                data = src.recv(16384)
                if not data:
                    break
                refused: str | None = None
                if requests:
                    data, buf, refused = self._track(cid, buf + data)
                for i in range(0, len(data), 4096):
                    chunk = data[i : i + 4096]
                    self._take(len(chunk))
                    dst.sendall(chunk)
                if refused is not None:
                    src.sendall(_access_denied(refused))
                    src.shutdown(socket.SHUT_WR)
                    src.settimeout(5.0)  # read what the client still sends (the body), so
                    while src.recv(65536):  # that it reads the answer, not a reset
                        pass
                    break
        except OSError:
            pass
        finally:
            with self._lock:
                self._inflight.pop(cid, None)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _track(self, cid: int, buf: bytes) -> tuple[bytes, bytes, str | None]:
        """Follow HTTP/1.1 requests on a client connection (headers, then Content-Length body
        bytes): (the bytes to forward, the unparsed remainder held back until its header is
        whole, the path of a write refused while read-only: nothing of it is forwarded)."""
        forward = b""
        while buf:
            with self._lock:
                req = self._inflight.get(cid)
            if req is not None and req["sent"] < req["length"]:
                take = min(len(buf), req["length"] - req["sent"])
                with self._lock:
                    req["sent"] += take
                forward, buf = forward + buf[:take], buf[take:]
                if req["sent"] >= req["length"]:
                    with self._lock:
                        self._inflight.pop(cid, None)
                continue
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return forward, buf, None
            head = buf[:end].decode("latin-1", "replace").split("\r\n")
            method, _, rest = head[0].partition(" ")
            path = rest.rpartition(" ")[0]
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length" and value.strip().isdigit():
                    length = int(value.strip())
            with self._lock:
                if self.writes_refused and method in WRITE_METHODS:
                    self.refused += 1
                    return forward, b"", path
                self._inflight[cid] = {"method": method, "path": path, "sent": 0, "length": length}
                if length == 0:
                    self._inflight.pop(cid, None)
            forward, buf = forward + buf[: end + 4], buf[end + 4 :]
        return forward, b"", None
