"""Progress of a running training: a live table on a terminal, plain log lines elsewhere.

The driver calls `update(rows)` about once a second with one `ReplicaRow` per replica (built
from the replicas' status documents in the store and the executor's handles). Both modes show
the run's progress: a bar of the inner steps done over all replicas, each replica's inner steps
per second (over the last minute of progress) and the time left at that rate. The live mode
(rich) redraws a table in place; the plain mode prints one line when something worth a line
changed (an outer round, a state change), every `plain_every_s` seconds while the steps or
rewards move, and every `quiet_every_s` seconds when nothing at all changed (so a start-up prints
one "starting" line, not one every 15 s, and a stalled run still shows it is alive), so a CI log
stays readable; "none" prints nothing.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.live import Live
    from rich.table import Table

__all__ = ["Progress", "ReplicaRow", "choose_mode"]


@dataclass
class ReplicaRow:
    """What the display shows of one replica."""

    rank: int
    state: str = "pending"
    step: int = 0
    max_steps: int = 0
    round: int = 0
    reward: float | None = None
    eval_accuracy: float | None = None
    seconds_since_update: float | None = None


def choose_mode(setting: str, stream: TextIO) -> str:
    """'auto' -> 'live' on a terminal with rich installed, else 'plain'."""
    if setting != "auto":
        return setting
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return "plain"
    try:
        import rich  # noqa: F401
    except ImportError:
        return "plain"
    return "live"


BAR_WIDTH = 20
RATE_WINDOW_S = 60.0  # steps per second are measured over the last minute of progress


def _duration(seconds: float) -> str:
    """``0:01:55``; days are hours (``27:00:00``)."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


class Progress:
    """Show per-replica step, outer round and reward (see the module docstring)."""

    def __init__(
        self,
        mode: str,
        *,
        title: str,
        n_rounds: int | None,
        stream: TextIO | None = None,
        plain_every_s: float = 15.0,
        quiet_every_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in ("live", "plain", "none"):
            raise ValueError(f"progress mode must be live, plain or none, got {mode!r}")
        self.mode = mode
        self.title = title
        self.n_rounds = n_rounds  # None: no fixed number (decoupled mode's global versions)
        self.stream = stream if stream is not None else sys.stdout
        self.plain_every_s = plain_every_s
        self.quiet_every_s = quiet_every_s
        self._clock = clock
        self._start = clock()
        self._last_line = 0.0
        self._last_key: tuple[tuple[str, int], ...] | None = None
        self._last_content: str | None = None
        self._live: Live | None = None
        # (time, inner steps done over all replicas), one sample per change, the last minute
        self._samples: deque[tuple[float, int]] = deque()
        if mode == "live":
            from rich.console import Console
            from rich.live import Live

            self._live = Live(
                console=Console(file=self.stream), refresh_per_second=4, transient=False
            )
            self._live.start()

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def message(self, text: str) -> None:
        """A line of text above the display (or just a line)."""
        if self.mode == "none":
            return
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def _sample(self, rows: list[ReplicaRow]) -> None:
        done = sum(min(r.step, r.max_steps) if r.max_steps else r.step for r in rows)
        now = self._clock()
        if not self._samples or self._samples[-1][1] != done:
            self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()

    def overall(self, rows: list[ReplicaRow]) -> str:
        """``[#####...............]  25%  1.30 steps/s  ETA 0:01:55``: the inner steps done over
        all replicas, each replica's steps per second and the time left at that rate ("-" while
        no step has been measured)."""
        total = sum(r.max_steps for r in rows)
        if total <= 0:
            return ""
        done = sum(min(r.step, r.max_steps) for r in rows)
        fraction = done / total
        filled = int(fraction * BAR_WIDTH)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        rate = None  # inner steps per second, all replicas together
        if len(self._samples) >= 2:
            (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
            if t1 > t0 and d1 > d0:
                rate = (d1 - d0) / (t1 - t0)
        if rate is None:
            return f"[{bar}] {fraction:4.0%}  - steps/s  ETA -"
        eta = _duration((total - done) / rate)
        return f"[{bar}] {fraction:4.0%}  {rate / len(rows):.2f} steps/s  ETA {eta}"

    def update(self, rows: list[ReplicaRow]) -> None:
        if self.mode == "none":
            return
        self._sample(rows)
        if self._live is not None:
            self._live.update(self._table(rows))
            return
        # A line per outer round or lifecycle change; evaluating/checkpointing flicker too often.
        busy = ("training", "evaluating", "checkpointing")
        key = tuple(("training" if r.state in busy else r.state, r.round) for r in rows)
        content = self._content(rows)
        now = self._clock()
        since = now - self._last_line
        if (
            key != self._last_key
            or (content != self._last_content and since >= self.plain_every_s)
            or since >= self.quiet_every_s
        ):
            self._last_key = key
            self._last_content = content
            self._last_line = now
            print(self._line(rows), file=self.stream, flush=True)

    def _of(self, round_: int) -> str:
        return str(round_) if self.n_rounds is None else f"{round_}/{self.n_rounds}"

    def _content(self, rows: list[ReplicaRow]) -> str:
        """The line without its time stamp."""
        done_round = min((r.round for r in rows), default=0)
        parts = [f"round {self._of(done_round)}"]
        for r in rows:
            parts.append(
                f"r{r.rank} {r.state} step {r.step}/{r.max_steps} reward {_num(r.reward, 2)}"
            )
        return " | ".join(parts)

    def _line(self, rows: list[ReplicaRow]) -> str:
        overall = self.overall(rows)
        return f"[{self.elapsed:6.1f}s] {self._content(rows)}" + (
            f" | {overall}" if overall else ""
        )

    def _table(self, rows: list[ReplicaRow]) -> Table:
        from rich.table import Table
        from rich.text import Text

        overall = self.overall(rows)
        table = Table(
            title=f"{self.title}  ({self.elapsed:.0f}s)",
            title_justify="left",
            caption=Text(overall) if overall else None,  # Text: no markup in "[###...]"
            caption_justify="left",
        )
        for column in ("replica", "state", "step", "round", "reward", "eval acc", "updated"):
            table.add_column(column, justify="right" if column != "state" else "left")
        for r in rows:
            ago = "-" if r.seconds_since_update is None else f"{r.seconds_since_update:.0f}s ago"
            table.add_row(
                str(r.rank),
                r.state,
                f"{r.step}/{r.max_steps}",
                self._of(r.round),
                _num(r.reward),
                _num(r.eval_accuracy),
                ago,
            )
        return table

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
