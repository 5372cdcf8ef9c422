"""`TeacherPool`: fan prompts out to N teachers and record their answers as traces.

Used two ways: ahead of training (`bake_traces`, what ``composer-replication bake-traces`` calls)
or lazily during training (the trainer asks the pool for prompts its `TraceStore` lacks).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from composer_replication.data.teachers.base import (
    Prompt,
    TeacherClient,
    TeacherCompletion,
    TeacherError,
)
from composer_replication.data.traces import (
    TraceRecord,
    TraceStore,
    append_traces,
    drop_torn_tail,
    iter_trace_file,
    prompt_key,
)
from composer_replication.json_types import JSONDict

logger = logging.getLogger(__name__)

Verifier = Callable[[Prompt, str], float | None]


@dataclass
class PoolStats:
    """What a pool run did, per teacher name."""

    recorded: Counter[str] = field(default_factory=Counter)
    empty: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    skipped_existing: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    def as_dict(self) -> JSONDict:
        return {
            "recorded": dict(self.recorded),
            "empty": dict(self.empty),
            "errors": dict(self.errors),
            "skipped_existing": self.skipped_existing,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost_usd": self.cost_usd,
        }


class TeacherPool:
    """N teachers, one store.

    ``verifier(prompt, completion) -> reward | None`` (optional) scores each trace so channel 3
    replays the best verified one. Empty completions are skipped and counted in
    ``stats.empty``; a teacher that raises `TeacherError` is counted in ``stats.errors`` and the
    others still run (``fail_fast=True`` re-raises instead). The teachers are queried
    concurrently, one thread each. Records go to ``store`` and, when
    ``store_path`` is given, are appended to that JSONL file as they arrive.
    """

    def __init__(
        self,
        teachers: Sequence[TeacherClient],
        *,
        store: TraceStore | None = None,
        store_path: str | Path | None = None,
        verifier: Verifier | None = None,
        fail_fast: bool = False,
    ) -> None:
        if not teachers:
            raise ValueError("TeacherPool needs at least one teacher")
        names = [t.name for t in teachers]
        if len(set(names)) != len(names):
            raise ValueError(f"teacher names must be unique, got {names}")
        self.teachers = list(teachers)
        self.store = store if store is not None else TraceStore()
        self.store_path = Path(store_path) if store_path is not None else None
        self.verifier = verifier
        self.fail_fast = fail_fast
        self.stats = PoolStats()

    def generate(self, prompts: Sequence[Prompt]) -> list[TraceRecord]:
        """Ask every teacher for every prompt; returns (and stores) the new records."""
        prompts = list(prompts)
        if not prompts:
            return []
        keys = [prompt_key(p) for p in prompts]
        new: list[TraceRecord] = []
        # Teachers are independent (different endpoints / models): ask them all at once, then
        # record in teacher order so the store and the JSONL file are deterministic.
        outcomes: list[list[TeacherCompletion] | TeacherError] = []
        with ThreadPoolExecutor(max_workers=len(self.teachers)) as executor:
            futures = [executor.submit(t.complete, prompts) for t in self.teachers]
            for future in futures:
                try:
                    outcomes.append(future.result())
                except TeacherError as exc:
                    outcomes.append(exc)
        for teacher, answers in zip(self.teachers, outcomes):
            if isinstance(answers, TeacherError):
                self.stats.errors[teacher.name] += len(prompts)
                logger.warning(
                    "teacher %s failed on %d prompt(s): %s", teacher.name, len(prompts), answers
                )
                if self.fail_fast:
                    raise answers
                continue
            if len(answers) != len(prompts):
                raise TeacherError(
                    f"teacher {teacher.name!r} returned {len(answers)} answers for {len(prompts)} prompts"
                )
            for prompt, key, answer in zip(prompts, keys, answers):
                self.stats.prompt_tokens += answer.prompt_tokens
                self.stats.completion_tokens += answer.completion_tokens
                self.stats.cost_usd += answer.cost_usd
                if not answer.text.strip():
                    self.stats.empty[teacher.name] += 1
                    continue
                reward = self.verifier(prompt, answer.text) if self.verifier is not None else None
                record = TraceRecord(
                    prompt_key=key,
                    teacher=teacher.name,
                    completion=answer.text,
                    reward=None if reward is None else float(reward),
                    metadata={
                        "prompt_tokens": answer.prompt_tokens,
                        "completion_tokens": answer.completion_tokens,
                        "cost_usd": answer.cost_usd,
                        "cached": answer.cached,
                        **answer.metadata,
                    },
                    prompt=prompt,
                )
                if self.store.add(record):
                    new.append(record)
                    self.stats.recorded[teacher.name] += 1
        if self.store_path is not None and new:
            append_traces(self.store_path, new)
        return new

    def ensure(self, prompts: Iterable[Prompt]) -> list[TraceRecord]:
        """Generate only for prompts the store has no trace for (the lazy, in-training path)."""
        missing: list[Prompt] = []
        seen: set[str] = set()
        for prompt in prompts:
            key = prompt_key(prompt)
            if key in self.store or key in seen:
                self.stats.skipped_existing += 1
                continue
            seen.add(key)
            missing.append(prompt)
        return self.generate(missing)


def bake_traces(
    pool: TeacherPool, prompts: Iterable[Prompt], store_path: str | Path, *, batch_size: int = 32
) -> PoolStats:
    """Ahead-of-training trace baking, resumable.

    Loads ``store_path`` if it exists (prompts that already have traces are skipped), asks the
    pool for the rest in batches of ``batch_size`` and appends every new record to ``store_path``.
    Returns the pool's statistics (records, empties, errors, tokens, cost).
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    store_path = Path(store_path)
    torn = drop_torn_tail(store_path)
    if torn:
        logger.warning(
            "%s: removed a torn last line (%d bytes) left by an interrupted append",
            store_path,
            torn,
        )
    if store_path.exists():
        for record in iter_trace_file(store_path):
            pool.store.add(record)
    pool.store_path = store_path
    batch: list[Prompt] = []
    for prompt in prompts:
        batch.append(prompt)
        if len(batch) >= batch_size:
            pool.ensure(batch)
            batch = []
    if batch:
        pool.ensure(batch)
    return pool.stats
