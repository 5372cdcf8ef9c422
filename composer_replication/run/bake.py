"""Channel-3 teachers of a run: build them from the config, bake their traces ahead of training.

`build_teachers(config, task)` gives the configured OpenAI-compatible endpoints, or, when there
are none and `teachers.oracle` is on, an `OracleTeacher` that answers the task's TRAIN prompts
with their reference solution (no network, no cost: what the embedded default replays; held-out
prompts get no oracle answer). `bake` runs them over the task's prompts and appends verified
traces to a JSONL file (what `bake-traces` does, resumable).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_replication.config import ConfigError, RunConfig

__all__ = ["bake", "build_task", "build_teachers", "chat_prompt", "task_index"]


def build_task(config: RunConfig) -> Any:
    from composer_replication.tasks import get_task

    return get_task(
        config.task.name,
        seed=config.run.seed,
        n_train=config.task.n_train,
        n_eval=config.task.n_eval,
        **config.task.options,
    )


def chat_prompt(example: Any) -> list[dict[str, str]]:
    """The chat prompt of a task example, as the task's dataset holds it."""
    return [{"role": "user", "content": example.prompt}]


def task_index(task: Any) -> dict[str, Any]:
    """prompt_key -> Example over both splits (teachers and verifiers see prompts, not ids)."""
    from composer_replication.data.traces import prompt_key

    examples = list(task.train_examples()) + list(task.eval_examples())
    return {prompt_key(chat_prompt(ex)): ex for ex in examples}


def build_teachers(config: RunConfig, task: Any) -> list[Any]:
    """Endpoint teachers from [[teachers.endpoints]], else the task oracle (if enabled)."""
    from composer_replication.data.teachers import OpenAICompatibleTeacher, OracleTeacher
    from composer_replication.data.traces import prompt_key

    teachers: list[Any] = []
    for i, ep in enumerate(config.teachers.endpoints):
        try:
            teachers.append(
                OpenAICompatibleTeacher(
                    base_url=ep.base_url,
                    model=ep.model,
                    name=ep.name,
                    api_key_env=ep.api_key_env or None,
                    max_tokens=ep.max_tokens,
                    temperature=ep.temperature,
                )
            )
        except ValueError as exc:
            raise ConfigError(f"teachers.endpoints[{i}]: {exc}") from None
    if not teachers and config.teachers.oracle:
        # TRAIN prompts only: the oracle never answers a held-out prompt, so no held-out answer
        # can reach training through channel 3.
        train = {prompt_key(chat_prompt(ex)): ex for ex in task.train_examples()}

        def solve(prompt: Any) -> str | None:
            example = train.get(prompt_key(prompt))
            return None if example is None else task.oracle(example)

        teachers.append(OracleTeacher(solve, name="oracle"))
    return teachers


def bake(config: RunConfig, out: Path, *, split: str = "train", limit: int | None = None) -> int:
    """Record traces for the task's prompts into `out` (JSONL); return how many were added."""
    from composer_replication.data.teachers import TeacherPool, bake_traces
    from composer_replication.data.traces import prompt_key

    task = build_task(config)
    teachers = build_teachers(config, task)
    if not teachers:
        raise ConfigError("no teachers: add [[teachers.endpoints]] or set teachers.oracle = true")
    index = task_index(task)

    def verifier(prompt: Any, completion: str) -> float | None:
        example = index.get(prompt_key(prompt))
        return None if example is None else float(task.verify(example, completion).reward)

    examples = task.train_examples() if split == "train" else task.eval_examples()
    prompts = [chat_prompt(ex) for ex in examples][:limit]
    pool = TeacherPool(teachers, verifier=verifier)
    stats = bake_traces(pool, prompts, out)
    return sum(stats.recorded.values())
