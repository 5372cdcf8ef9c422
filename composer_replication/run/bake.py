"""`bake-traces`: run a run's channel-3 teachers over its task's prompts ahead of training.

`bake(config, out)` builds the teachers the run would use (`assembly.build.build_teachers`: the
configured OpenAI-compatible endpoints, else the task oracle), asks them for every prompt of a
split, scores each trace with the task's verifier and appends the verified traces to a JSONL
file (resumable: prompts already in the file are skipped). `teachers.traces_path` then points
the run at that file, so each prompt is paid for once.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from composer_replication.assembly.build import build_task, build_teachers, task_verifier
from composer_replication.config import ConfigError

if TYPE_CHECKING:
    from composer_replication.config import RunConfig

__all__ = ["bake"]


def bake(config: RunConfig, out: Path, *, split: str = "train", limit: int | None = None) -> int:
    """Record traces for the task's prompts into `out` (JSONL); return how many were added."""
    from composer_replication.data.teachers import TeacherPool, bake_traces
    from composer_replication.tasks.task import chat_prompt

    task = build_task(config)
    teachers = build_teachers(config, task)
    if not teachers:
        raise ConfigError("no teachers: add [[teachers.endpoints]] or set teachers.oracle = true")
    examples = task.train_examples() if split == "train" else task.eval_examples()
    prompts = [chat_prompt(ex.prompt) for ex in examples][:limit]
    pool = TeacherPool(teachers, verifier=task_verifier(task))
    stats = bake_traces(pool, prompts, out)
    return sum(stats.recorded.values())
