"""`HeartbeatWriter`: a member's heartbeat (exchange/liveness.py), written from a thread.

A replica writes its heartbeat every `HEARTBEAT_EVERY_S` from start-up on (role ``"replica"``,
decoupled learners ``"learner"``); ``fields`` (set once the outer loop exists) adds its round
and step. `close` stops the thread and, given a final state ("done", "failed"), writes it once.
A write that finds the run fenced by a newer launch calls ``on_fenced`` (the replica exits
without writing anything more); any other store error is logged and the next beat retries.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from composer_replication.exchange.fencing import FencedError
from composer_replication.exchange.liveness import HEARTBEAT_EVERY_S, write_heartbeat
from composer_replication.exchange.store import Store

__all__ = ["HeartbeatWriter"]

log = logging.getLogger(__name__)


def _no_fields() -> dict[str, Any]:
    return {}


class HeartbeatWriter:
    """See the module docstring; the thread starts at construction."""

    def __init__(
        self,
        store: Store,
        role: str,
        member: int | str,
        *,
        on_fenced: Callable[[FencedError], None],
        every_s: float = HEARTBEAT_EVERY_S,
    ) -> None:
        self.store, self.role, self.member, self.every_s = store, role, member, every_s
        self.on_fenced = on_fenced
        self.fields: Callable[[], dict[str, Any]] = _no_fields  # JSON-able
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._thread.start()

    def beat(self, state: str = "running") -> None:
        try:
            write_heartbeat(self.store, self.role, self.member, state=state, **self.fields())
        except FencedError as exc:  # a newer launch owns the run: write nothing more
            self.on_fenced(exc)
        except (OSError, ValueError) as exc:
            log.warning("%s %s: heartbeat failed: %r", self.role, self.member, exc)

    def _loop(self) -> None:
        while True:
            self.beat()
            if self._stop.wait(self.every_s):
                return

    def close(self, state: str | None = None) -> None:
        """Stop the thread; with ``state``, write that final heartbeat (once)."""
        if self._closed:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        if state is not None:
            self._closed = True
            self.beat(state)
