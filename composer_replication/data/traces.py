"""Teacher trace records (channel 3's chosen side) and the store that holds them.

A trace is one teacher's completion for one prompt. On disk a trace file is JSON Lines, one record
per line::

    {"prompt_key": "3f2a...", "teacher": "gpt-4o", "completion": "...", "reward": 1.0,
     "metadata": {...}, "prompt": [{"role": "user", "content": "..."}]}

Required: ``prompt_key`` (str, see `prompt_key`), ``teacher`` (str), ``completion`` (non-empty str).
Optional: ``reward`` (float or null: the verifier's score, used to rank traces), ``metadata`` (JSON
object), ``prompt`` (the chat prompt itself; when present its key must match ``prompt_key``).

Prompts are matched by key, not by text, so a trace file is independent of the dataset's row order
and can be shared between runs: ``prompt_key`` is the sha256 of the normalised chat prompt.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from composer_replication.json_types import JSONDict

Prompt = str | list[dict[str, Any]]

REQUIRED_FIELDS: tuple[str, ...] = ("prompt_key", "teacher", "completion")
KNOWN_FIELDS: frozenset[str] = frozenset(
    {"prompt_key", "teacher", "completion", "reward", "metadata", "prompt"}
)


class TraceJson(TypedDict):
    """One trace record as JSON (a line of a trace file; `TraceRecord.to_json`)."""

    prompt_key: str
    teacher: str
    completion: str
    reward: float | None
    metadata: JSONDict
    prompt: NotRequired[Prompt]


class TraceFormatError(ValueError):
    """A trace file has a bad record; the message names the file and line (``path:line: ...``)."""


def normalize_prompt(prompt: Prompt) -> list[dict[str, str]]:
    """The canonical form hashed by `prompt_key`.

    A plain string becomes one user message. Each message keeps only ``role`` (lower-cased,
    stripped) and ``content`` (line endings folded to ``\\n``, surrounding whitespace stripped), so
    the same question loaded from different sources (CRLF files, extra message keys such as
    ``name`` or ``tool_calls: None``) maps to the same key. Content given as a list of typed parts
    keeps only the text parts, joined in order.
    """
    if isinstance(prompt, str):
        messages: list[Any] = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        messages = prompt
    else:
        raise ValueError(
            f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}"
        )
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(
                f"chat message {i} must be a mapping with 'role' and 'content', got {message!r:.80}"
            )
        content = message["content"]
        if isinstance(content, list):
            content = "".join(
                str(part.get("text", "")) for part in content if isinstance(part, Mapping)
            )
        elif content is None:
            content = ""
        text = str(content).replace("\r\n", "\n").replace("\r", "\n").strip()
        out.append({"role": str(message["role"]).strip().lower(), "content": text})
    return out


def prompt_key(prompt: Prompt) -> str:
    """Stable hex sha256 of the normalised chat prompt (see `normalize_prompt`).

    Stable across processes, Python versions and machines: the normalised messages are serialised
    as compact JSON with sorted keys and UTF-8 text before hashing.
    """
    canonical = json.dumps(
        normalize_prompt(prompt), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TraceRecord:
    """One teacher completion for one prompt (see the module docstring for the JSONL form)."""

    prompt_key: str
    teacher: str
    completion: str
    reward: float | None = None
    metadata: JSONDict = field(default_factory=dict)
    prompt: Prompt | None = None

    def to_json(self) -> TraceJson:
        """The JSONL dict (``prompt`` only when known)."""
        record: TraceJson = {
            "prompt_key": self.prompt_key,
            "teacher": self.teacher,
            "completion": self.completion,
            "reward": self.reward,
            "metadata": dict(self.metadata),
        }
        if self.prompt is not None:
            record["prompt"] = self.prompt
        return record

    @classmethod
    def from_json(cls, obj: object, *, where: str = "<record>") -> TraceRecord:
        """Validate one decoded JSON object; errors are `TraceFormatError` prefixed by ``where``."""
        if not isinstance(obj, Mapping):
            raise TraceFormatError(f"{where}: a trace record must be a JSON object")
        missing = [name for name in REQUIRED_FIELDS if name not in obj]
        if missing:
            raise TraceFormatError(
                f"{where}: missing required field(s) {', '.join(missing)} "
                f"(a trace needs {', '.join(REQUIRED_FIELDS)})"
            )
        unknown = sorted(set(obj) - KNOWN_FIELDS)
        if unknown:
            raise TraceFormatError(
                f"{where}: unknown field(s) {', '.join(unknown)}; put extra data under 'metadata'"
            )
        for name in REQUIRED_FIELDS:
            if not isinstance(obj[name], str):
                raise TraceFormatError(
                    f"{where}: field {name!r} must be a string, got {type(obj[name]).__name__}"
                )
        if not obj["prompt_key"] or not obj["teacher"]:
            raise TraceFormatError(f"{where}: 'prompt_key' and 'teacher' must be non-empty")
        if not obj["completion"].strip():
            raise TraceFormatError(f"{where}: 'completion' is empty")
        reward = obj.get("reward")
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, int | float):
                raise TraceFormatError(
                    f"{where}: 'reward' must be a number or null, got {reward!r}"
                )
            if not math.isfinite(float(reward)):
                raise TraceFormatError(f"{where}: 'reward' must be finite, got {reward!r}")
            reward = float(reward)
        metadata = obj.get("metadata") or {}
        if not isinstance(metadata, Mapping):
            raise TraceFormatError(f"{where}: 'metadata' must be a JSON object")
        prompt = obj.get("prompt")
        if prompt is not None:
            try:
                key = prompt_key(prompt)
            except ValueError as exc:
                raise TraceFormatError(f"{where}: bad 'prompt': {exc}") from exc
            if key != obj["prompt_key"]:
                raise TraceFormatError(
                    f"{where}: 'prompt_key' does not match prompt_key(prompt) ({key[:12]}...)"
                )
        return cls(
            prompt_key=obj["prompt_key"],
            teacher=obj["teacher"],
            completion=obj["completion"],
            reward=reward,
            metadata=dict(metadata),
            prompt=prompt,
        )


def _rank(record: TraceRecord) -> tuple[int, float]:
    # Traces with a verifier reward outrank unscored ones; among scored ones the higher reward wins.
    return (0, 0.0) if record.reward is None else (1, record.reward)


class TraceStore:
    """Teacher traces indexed by prompt key: load, validate, deduplicate, look up.

    Duplicates (same prompt key, teacher and completion text) are merged, keeping the record with
    the best reward. `best` picks the trace channel 3 uses as "chosen": the highest verifier reward;
    unscored traces only when no scored one exists; ties go to the earliest added.
    """

    def __init__(self, records: Iterable[TraceRecord] = ()) -> None:
        self._by_prompt: dict[str, list[TraceRecord]] = {}
        self.duplicates = 0
        for record in records:
            self.add(record)

    # -- building ---------------------------------------------------------------------------
    def add(self, record: TraceRecord) -> bool:
        """Add one record; returns False (and counts a duplicate) if it was already present."""
        bucket = self._by_prompt.setdefault(record.prompt_key, [])
        for i, old in enumerate(bucket):
            if old.teacher == record.teacher and old.completion == record.completion:
                self.duplicates += 1
                if _rank(record) > _rank(old):
                    bucket[i] = record
                return False
        bucket.append(record)
        return True

    @classmethod
    def load(
        cls,
        paths: str | Path | Iterable[str | Path],
        *,
        known_prompt_keys: Iterable[str] | None = None,
    ) -> TraceStore:
        """Load one or more JSONL files.

        Every problem (bad JSON, missing fields, a prompt key not in ``known_prompt_keys`` when
        that is given) raises `TraceFormatError` naming ``file:line``. Blank lines are skipped.
        """
        if isinstance(paths, str | Path):
            paths = [paths]
        known = set(known_prompt_keys) if known_prompt_keys is not None else None
        store = cls()
        for path in paths:
            for record in iter_trace_file(path, known_prompt_keys=known):
                store.add(record)
        return store

    @classmethod
    def from_dicts(cls, records: Iterable[object], *, source: str = "<records>") -> TraceStore:
        """Validate and add decoded trace dicts (e.g. ``task.oracle_traces()``).

        Errors are `TraceFormatError` naming ``source`` and the record's 1-based position.
        """
        store = cls()
        for i, obj in enumerate(records, start=1):
            store.add(TraceRecord.from_json(obj, where=f"{source}:{i}"))
        return store

    def save(self, path: str | Path) -> None:
        """Write every record as JSONL (overwrites ``path``; writes a temp file then renames)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            for record in self:
                fh.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")
        tmp.replace(path)

    # -- lookup -----------------------------------------------------------------------------
    def traces(self, key: str) -> list[TraceRecord]:
        """All traces for a prompt key (empty list if none)."""
        return list(self._by_prompt.get(key, ()))

    def best(self, key: str) -> TraceRecord | None:
        """The trace to replay for this prompt key, or None."""
        bucket = self._by_prompt.get(key)
        if not bucket:
            return None
        best = bucket[0]
        for record in bucket[1:]:
            if _rank(record) > _rank(best):
                best = record
        return best

    def __contains__(self, key: object) -> bool:
        return key in self._by_prompt

    def __iter__(self) -> Iterator[TraceRecord]:
        for bucket in self._by_prompt.values():
            yield from bucket

    def __len__(self) -> int:
        return sum(len(b) for b in self._by_prompt.values())

    @property
    def prompt_keys(self) -> set[str]:
        return set(self._by_prompt)


def iter_trace_file(
    path: str | Path, *, known_prompt_keys: set[str] | None = None
) -> Iterator[TraceRecord]:
    """Yield validated records from one JSONL file; errors name ``path:line``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file {path} does not exist")
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from None
            record = TraceRecord.from_json(obj, where=where)
            if known_prompt_keys is not None and record.prompt_key not in known_prompt_keys:
                raise TraceFormatError(
                    f"{where}: unknown prompt_key {record.prompt_key[:16]}... (no prompt in the "
                    "dataset has this key; was the trace file made for another task or split?)"
                )
            yield record


def append_traces(path: str | Path, records: Iterable[TraceRecord]) -> int:
    """Append records to a JSONL file (created if missing); returns how many were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(record.to_json(), ensure_ascii=False) + "\n" for record in records]
    if not lines:
        return 0
    # One write of whole lines, flushed to disk: a crash leaves at most a torn last line, which
    # `drop_torn_tail` removes before the next append.
    with path.open("a", encoding="utf-8") as fh:
        fh.write("".join(lines))
        fh.flush()
        os.fsync(fh.fileno())
    return len(lines)


def drop_torn_tail(path: str | Path) -> int:
    """Cut a last line that has no newline (an append interrupted by a crash) off ``path``;
    returns how many bytes were removed (0 when the file ends cleanly or does not exist)."""
    path = Path(path)
    if not path.exists():
        return 0
    with path.open("rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return 0
        keep, pos, block = 0, size, 1 << 16
        while pos > 0:  # the last newline, scanning back in blocks
            start = max(0, pos - block)
            fh.seek(start)
            chunk = fh.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        fh.truncate(keep)
        return size - keep
