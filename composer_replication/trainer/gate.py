"""Channel 2's teacher gate: distil only while the hinted teacher is measurably better.

Each generation batch probes a few hinted rows (`trainer._gate_on_teacher`): the teacher's
sampled completion is scored, and so is its student (the row's group mean rollout reward). One
probed row gives one paired difference ``teacher - student``. With ~8 probed rows of a shaped
reward a batch's mean difference has a standard error near 0.15, far above the advantages a
teacher actually has (a few hundredths to a few tenths), so a gate on one batch's sign opens about
half the time whatever the teacher is worth. `TeacherGate` decides on the last ``window`` paired
differences instead: open while their mean exceeds its standard error (the teacher ahead by more
than the noise of its own measurement), closed otherwise. A single difference (the run's first
probe) opens it when positive.

The window is part of the trainer's exact-resume state (`state()` / `load_state()`: a list of
floats, JSON-safe).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

__all__ = ["TeacherGate"]


class TeacherGate:
    """The last `window` paired teacher-minus-student differences and the decision on them."""

    def __init__(self, window: int) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sdpo_gate_window must be an int >= 1, got {window!r}")
        self.window = window
        self._diffs: deque[float] = deque(maxlen=window)

    def add(self, differences: Iterable[float]) -> None:
        """Record one batch's paired differences (NaN ones, unscored, are left out)."""
        self._diffs.extend(float(d) for d in differences if not math.isnan(float(d)))

    @property
    def mean(self) -> float:
        """Mean difference over the window (NaN while empty)."""
        return math.fsum(self._diffs) / len(self._diffs) if self._diffs else math.nan

    @property
    def standard_error(self) -> float:
        """Standard error of `mean` (sample standard deviation / sqrt(n)); 0 for one value,
        NaN while empty."""
        n = len(self._diffs)
        if n == 0:
            return math.nan
        if n == 1:
            return 0.0
        mean = self.mean
        var = math.fsum((d - mean) ** 2 for d in self._diffs) / (n - 1)
        return math.sqrt(var / n)

    def is_open(self) -> bool:
        """Whether the teacher is ahead by more than its standard error (closed while empty)."""
        return bool(self._diffs) and self.mean > self.standard_error

    def state(self) -> list[float]:
        """The window, oldest first (for the trainer's resume state)."""
        return list(self._diffs)

    def load_state(self, values: Sequence[float]) -> None:
        """Replace the window with `values` (a `state()`); its last `window` finite ones."""
        if not isinstance(values, Sequence) or isinstance(values, str):
            raise ValueError("the teacher gate's state must be a list of floats")
        out: list[float] = []
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"the teacher gate's state holds {v!r}, not a finite float")
            out.append(float(v))
        self._diffs = deque(out, maxlen=self.window)
