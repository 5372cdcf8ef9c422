"""Whether a process of this machine still runs: the one check the driver (is an earlier driver
of this run still running? are the replicas of a crashed launch gone?) and `status` (is the run's
driver gone?) share."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie, killed but not reaped, does not:
    a killed driver's replicas may be reparented to an init that never reaps)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc (macOS), or it exited while we looked
        return True
    return state not in (b"Z", b"X")
