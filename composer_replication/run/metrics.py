"""Metric records: written by replicas into the store, gathered by the driver into the run folder.

One record is a flat JSON object:

    {"time": 1732233600.0, "replica": 0, "kind": "train", "step": 12, "round": 1,
     "reward": 0.41, "loss/grpo": 0.03, ...}

kind is "train" (TRL's log line of one inner step: reward, per-channel losses, ...), "eval"
(`eval/accuracy`, `eval/reward` of the global model after a round), "round" (one outer
synchronisation: `round/seconds`, `round/bytes_up`, `round/bytes_down`, `round/included`), or
"event" (`event`: a string such as "start", "resumed", "done").

Replicas cannot append to an object (S3 has no append), so `ReplicaMetricsWriter` uploads
immutable numbered chunks; `MetricsCollector` (driver) reads each chunk once, in order, and
hands its records to `MetricsSink`, which appends them to metrics.jsonl and TensorBoard.
`read_metrics` reads the file back with each step once (a resume's redone steps replace the
discarded ones).

Redone steps are marked in the file itself, for readers of the raw JSONL (pandas): at a sync-mode
`--resume` to round R, `mark_resume` flags every "train", "eval" and "round" record of a step
after R * sync_every_h already in metrics.jsonl with ``"superseded": true`` (the resumed launch
writes those steps again) and appends one ``{"kind": "event", "event": "resume"}`` record per
replica (``resumed_round``, ``redo_after_step``, ``superseded_records``: how many of its records
were flagged). `pd.read_json(path, lines=True)` then gives one row per (kind, replica, step) with
``df[df["superseded"] != True]``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from composer_replication.exchange.store import ObjectStore, Store
from composer_replication.json_types import JSONDict, JSONValue, as_int

__all__ = [
    "MetricsCollector",
    "MetricsSink",
    "ReplicaMetricsWriter",
    "heal_torn_tail",
    "mark_resume",
    "read_metrics",
]

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

KINDS = ("train", "eval", "round", "event")

log = logging.getLogger(__name__)


def _clean(value: object) -> JSONValue:
    """JSON-safe value: tensors/numpy to float, NaN/inf to None, a tuple as a list (as
    `json.dumps` writes it); TypeError for a value JSON cannot hold."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool | list | dict):
        return value
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"a {type(value).__name__} is not JSON")


def status_key(rank: int) -> str:
    return f"replicas/{rank}/status.json"


def chunk_dir(rank: int) -> str:
    return f"replicas/{rank}/metrics"


WRITE_ATTEMPTS = 3  # an observability write: tries before it is skipped
WRITE_BACKOFF_S = 0.25  # the wait before the 2nd try; doubled before each next one


class ReplicaMetricsWriter:
    """Buffer a replica's records and upload them as numbered chunks (at most every flush_every_s).

    Numbering continues after the chunks already in the store, so a restarted or resumed
    replica never overwrites its earlier records (chunks are written put-if-absent).

    Observability never takes training down: a chunk or status write that fails with an
    `OSError` (the store unreachable, read-only, full) is retried ``attempts`` times with
    exponential backoff from ``backoff_s``, then skipped with a warning naming the cause; the
    records stay buffered for the next flush (none is lost once the store is back), and the
    next status document that gets through says how many writes were skipped and why
    (``skipped_writes``, ``last_skip``, ``last_skip_time``: `status` shows the replica
    ``degraded`` while that is recent). A fence (`FencedError`) is not an `OSError`: it still
    stops the replica.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        *,
        flush_every_s: float = 2.0,
        attempts: int = WRITE_ATTEMPTS,
        backoff_s: float = WRITE_BACKOFF_S,
    ) -> None:
        if attempts < 1 or not backoff_s >= 0:
            raise ValueError(f"attempts must be >= 1 and backoff_s >= 0: {attempts}, {backoff_s}")
        self.store = store
        self.rank = rank
        self.flush_every_s = flush_every_s
        self.attempts, self.backoff_s = attempts, backoff_s
        self._buffer: list[JSONDict] = []
        self._last_flush = time.monotonic()
        existing = [n for n in store.list(chunk_dir(rank)) if n.endswith(".jsonl")]
        self._seq = 1 + max((int(n.split(".")[0]) for n in existing), default=-1)
        self._status: JSONDict = {}
        self.skipped = 0  # observability writes given up on
        self.last_skip: str | None = None

    def _write(self, what: str, write: Callable[[], object]) -> bool:
        """One observability write, retried with backoff, then skipped (False) with a warning."""
        for attempt in range(self.attempts):
            try:
                write()
                return True
            except OSError as exc:
                cause = f"{type(exc).__name__}: {exc}"
                if attempt + 1 < self.attempts:
                    time.sleep(self.backoff_s * 2**attempt)
        self.skipped += 1
        self.last_skip = f"{what} not written after {self.attempts} tries ({cause})"
        self._status.update(
            skipped_writes=self.skipped, last_skip=self.last_skip, last_skip_time=time.time()
        )
        log.warning("replica %d: %s; training goes on, retried later", self.rank, self.last_skip)
        return False

    def log(self, kind: str, *, step: int, round: int, **values: object) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        record: JSONDict = {
            "time": time.time(),
            "replica": self.rank,
            "kind": kind,
            "step": int(step),
        }
        record["round"] = int(round)
        for key, raw in values.items():
            try:
                value = _clean(raw)
            except TypeError:  # not a metric: left out
                continue
            if isinstance(value, bool | int | float | str) or value is None:
                record[key] = value
        self._buffer.append(record)
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        data = "".join(json.dumps(r) + "\n" for r in self._buffer).encode()

        def put_chunk() -> None:
            key = f"{chunk_dir(self.rank)}/{self._seq:08d}.jsonl"
            while not self.store.put_if_absent(key, data):
                there = self.store.get(key)
                if there is not None and bytes(there) == data:
                    return  # ours: an earlier try whose answer was lost
                self._seq += 1  # an earlier incarnation of this rank wrote that number
                key = f"{chunk_dir(self.rank)}/{self._seq:08d}.jsonl"

        if not self._write(f"metrics chunk {self._seq}", put_chunk):
            return  # the records stay buffered for the next flush
        self._seq += 1
        self._buffer.clear()
        if self._status:
            self._write("status document", self._put_status)

    def _put_status(self) -> None:
        self.store.put_json(status_key(self.rank), self._status)

    def status(self, *, force: bool = False, **fields: object) -> None:
        """Update this replica's status document (uploaded with the next flush, or now)."""
        self._status.update({k: _clean(v) for k, v in fields.items()})
        self._status["rank"] = self.rank
        self._status["updated"] = time.time()
        if force:
            self._write("status document", self._put_status)


def heal_torn_tail(path: Path) -> str | None:
    """A driver killed mid-append can leave metrics.jsonl ending inside a record: cut the file
    back to the end of its last whole record and say so (None when there was nothing to
    heal). A whole last record without its newline only gets the newline. The cut record is
    not lost: its chunk was not counted as consumed yet (driver.json is saved after the append),
    so the collector reads that chunk again and appends it whole."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    with path.open("rb+") as fh:
        size = fh.seek(0, 2)
        back = min(size, 1 << 20)
        fh.seek(size - back)
        tail = fh.read(back)
        if tail.endswith(b"\n"):
            return None
        cut = tail.rfind(b"\n") + 1  # 0: no newline in the tail
        last = tail[cut:]
        try:
            whole = isinstance(json.loads(last), dict)
        except (UnicodeDecodeError, json.JSONDecodeError):
            whole = False
        if whole:
            fh.write(b"\n")
            return None
        if cut == 0 and back < size:
            return None  # a line longer than the window: leave it, readers skip it
        fh.truncate(size - back + cut)
    return (
        f"{path.name}: its last line was cut inside a record ({len(last)} bytes, a driver "
        "killed mid-append): cut back to the last whole record; the record is read again from "
        "its chunk"
    )


class MetricsSink:
    """Append records to metrics.jsonl and (optionally) TensorBoard, one writer per replica."""

    def __init__(self, metrics_path: Path, tensorboard_dir: Path | None = None) -> None:
        self.metrics_path = metrics_path
        self.tensorboard_dir = tensorboard_dir
        self._writers: dict[int, SummaryWriter] = {}
        self.healed = heal_torn_tail(metrics_path)  # the driver prints it
        if tensorboard_dir is not None:
            # Import now, not at the first record: a slow import mid-run delays the display, and
            # a missing package should fail before any replica starts.
            from torch.utils.tensorboard import SummaryWriter

            self._summary_writer = SummaryWriter

    def _writer(self, replica: int) -> SummaryWriter:
        if replica not in self._writers:
            assert self.tensorboard_dir is not None
            path = self.tensorboard_dir / f"replica-{replica}"
            self._writers[replica] = self._summary_writer(log_dir=str(path))
        return self._writers[replica]

    def write(self, records: Iterable[JSONDict]) -> None:
        records = list(records)
        if not records:
            return
        with self.metrics_path.open("a", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record) + "\n")
        if self.tensorboard_dir is None:
            return
        for record in records:
            writer = self._writer(as_int(record.get("replica", 0)))
            kind = record.get("kind")
            for key, value in record.items():
                if key in ("time", "replica", "kind", "step", "round") or kind == "event":
                    continue
                if isinstance(value, int | float) and not isinstance(value, bool):
                    tag = key if "/" in key else f"{kind}/{key}"
                    writer.add_scalar(tag, value, global_step=as_int(record.get("step", 0)))

    def close(self) -> None:
        for writer in self._writers.values():
            writer.flush()
            writer.close()
        self._writers.clear()


def _identity(record: JSONDict) -> str:
    """A record as its replica wrote it: `mark_resume`'s flag left out (the same record, flagged
    later in metrics.jsonl, is still the same record)."""
    return json.dumps({k: v for k, v in record.items() if k != "superseded"}, sort_keys=True)


def _records_in(path: Path) -> set[str]:
    """The identities of the records metrics.jsonl already holds (a torn line is skipped)."""
    seen: set[str] = set()
    if not path.is_file():
        return seen
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            seen.add(_identity(record))
    return seen


class MetricsCollector:
    """Driver side: pull each replica's new chunks from the store, in order, exactly once.

    `consumed` maps rank -> number of chunks already read; persist it (driver.json) so a
    resumed driver does not read them again. The driver saves it after it appended the records,
    so a driver killed in between leaves records in metrics.jsonl that the saved count does not
    cover: the first poll of a collector made on an existing metrics.jsonl skips every record the
    file already holds (the same record, to its timestamp), so no record is appended twice.
    """

    def __init__(
        self,
        store: ObjectStore,
        n_replicas: int,
        sink: MetricsSink,
        consumed: dict[int, int] | None,
    ) -> None:
        self.store = store
        self.n_replicas = n_replicas
        self.sink = sink
        self.consumed = {r: int((consumed or {}).get(r, 0)) for r in range(n_replicas)}
        self.latest: dict[int, JSONDict] = {}  # rank -> last train record seen
        # what an earlier driver appended, possibly after its last saved `consumed`; only the
        # first poll can meet such a record (it reads every chunk after the saved count)
        self._appended_before: set[str] | None = _records_in(sink.metrics_path)

    def poll(self) -> list[JSONDict]:
        """Read what is new; return the new records (already written to the sink)."""
        new: list[JSONDict] = []
        for rank in range(self.n_replicas):
            names = [n for n in self.store.list(chunk_dir(rank)) if n.endswith(".jsonl")]
            names = sorted(names, key=lambda n: int(n.split(".")[0]))
            for name in names[self.consumed[rank] :]:
                data = self.store.get(f"{chunk_dir(rank)}/{name}")
                if data is None:
                    break
                for line in bytes(data).decode("utf-8").splitlines():
                    if line.strip():
                        new.append(json.loads(line))
                self.consumed[rank] += 1
        if self._appended_before:
            new = [r for r in new if _identity(r) not in self._appended_before]
        self._appended_before = None
        for record in new:
            if record.get("kind") == "train":
                self.latest[as_int(record["replica"])] = record
        self.sink.write(new)
        return new

    def statuses(self) -> dict[int, JSONDict]:
        out = {}
        for rank in range(self.n_replicas):
            try:
                status = self.store.get_json(status_key(rank))
            except ValueError:  # not JSON: show the replica as not reporting
                continue
            if isinstance(status, dict):
                out[rank] = status
        return out


STEP_KINDS = ("train", "eval", "round")  # the kinds with one record per (replica, step)


def mark_resume(
    path: Path, sink: MetricsSink, *, resumed_round: int, redo_after_step: int, n_replicas: int
) -> dict[int, int]:
    """A resume redoes every step after `redo_after_step`: flag their records already in
    metrics.jsonl ``"superseded": true`` (the file is rewritten atomically; a torn line left
    mid-file by an older release is dropped, so the file parses) and append one "resume"
    event per replica through `sink`; returns the flagged count per replica."""
    flagged = dict.fromkeys(range(n_replicas), 0)
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        out = []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by an older release's crash: not a record, dropped
            step = record.get("step") if isinstance(record, dict) else None
            if (
                isinstance(record, dict)
                and record.get("kind") in STEP_KINDS
                and isinstance(step, int)
                and step > redo_after_step
                and not record.get("superseded")
            ):
                record["superseded"] = True
                rank = record.get("replica")
                if isinstance(rank, int):
                    flagged[rank] = flagged.get(rank, 0) + 1
                line = json.dumps(record) + "\n"
            out.append(line)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(out), encoding="utf-8")
        tmp.replace(path)
    now = time.time()
    sink.write(
        {
            "time": now,
            "replica": rank,
            "kind": "event",
            "event": "resume",
            "step": redo_after_step,
            "round": resumed_round,
            "resumed_round": resumed_round,
            "redo_after_step": redo_after_step,
            "superseded_records": count,
        }
        for rank, count in sorted(flagged.items())
    )
    return flagged


def read_metrics(path: Path) -> list[JSONDict]:
    """The records of a run's metrics.jsonl ([] when absent); a torn last line is skipped.

    A resumed run redoes the steps after the round it resumed from, so the file can hold a
    "train", "eval" or "round" record of the same (kind, replica, step) twice: the newest (the
    later line) replaces the discarded one, here, so every reader sees each step once. Events
    are all kept (they tell the story, including the interruption)."""
    if not path.is_file():
        return []
    out: list[JSONDict | None] = []
    where: dict[tuple[JSONValue, JSONValue, JSONValue], int] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("kind") in ("train", "eval", "round"):
            key = (record.get("kind"), record.get("replica"), record.get("step"))
            if key in where:
                out[where[key]] = None  # discarded by a resume
            where[key] = len(out)
        out.append(record)
    return [r for r in out if r is not None]
