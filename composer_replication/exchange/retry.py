"""Riding out a store that refuses writes for a while: `retry_write`.

An object store can refuse writes for seconds to minutes and then take them again: a bucket
policy changed and changed back, a full disk behind a file:// store being cleared, a lost
connection, S3's 503 SlowDown. A training-state write (a contribution, an owner record, a
global state, a replica's resume state, a checkpoint) is retried with backoff through such a spell, and fails loudly, as a
`StoreTimeoutError` naming the write and the last error, once it lasts longer than the write's
limit. Observability writes (metrics chunks, status) have their own rule: a few tries, then
skipped with a warning (run/metrics.py), since nothing trains on them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from composer_replication.exchange.vocabulary import StoreTimeoutError

__all__ = ["RETRY_FIRST_S", "RETRY_MAX_S", "STATE_WRITE_RETRY_S", "retry_write"]

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_FIRST_S = 0.1  # the wait before the second try; doubled before each next one
RETRY_MAX_S = 5.0  # the longest wait between two tries
# How long a global state, a replica's resume state or a checkpoint rides out a store that refuses
# writes before the replica fails loudly (a contribution's limit is the exchange's upload_timeout_s).
STATE_WRITE_RETRY_S = 120.0


def retry_write(
    put: Callable[[float], T],
    *,
    what: str,
    within_s: float,
    first_s: float = RETRY_FIRST_S,
    between: Callable[[], None] | None = None,
) -> T:
    """``put(seconds left)`` until it returns. A store error (`OSError`) is retried with backoff
    (``first_s``, doubled up to `RETRY_MAX_S`), each logged as a warning naming ``what``, until
    ``within_s`` seconds have passed since the first try; then it is raised as a
    `StoreTimeoutError` naming ``what`` and the error (chained). A `TimeoutError` (a write that
    hung past its own limit) is raised at once. ``between`` runs before each retry (a
    cancellation check may raise there). ``put`` must be safe to repeat: put-if-absent, or a
    whole-object put whose readers see one version or the other."""
    deadline = time.monotonic() + within_s
    delay = first_s
    while True:
        try:
            return put(max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise
        except OSError as e:
            if time.monotonic() + delay >= deadline:
                raise StoreTimeoutError(
                    f"{what} kept failing for {within_s:g} s, the longest it may: {e!r}"
                ) from e
            log.warning("%s failed (%r); retrying in %.2g s", what, e, delay)
        time.sleep(delay)
        delay = min(2 * delay, RETRY_MAX_S)
        if between is not None:
            between()
