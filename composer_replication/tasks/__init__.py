"""Built-in verifiable tasks: prompts with reference answers, a shaped reward with feedback (what
channel 2 feeds on) and an oracle solution (what channel 3 replays without a teacher endpoint).

    from composer_replication.tasks import get_task, TASKS
    task = get_task("arithmetic", seed=0, n_train=256, n_eval=64, level="easy")
    dataset = task.to_dataset("train")           # columns: prompt, example_id, answer, task_meta, hinted_example
    reward = task.reward_func()                  # per completion: (score, feedback)

`TASKS` is the explicit registry (name -> class), the one list of task names (`TASK_NAMES`: the
built-in ones, registered here). `reasoning_gym` needs the `tasks` extra; its
generator can be named inline: `get_task("reasoning_gym:chain_sum")`. `openenv` (extra `openenv`)
wraps an OpenEnv environment server or image, named inline too:
`get_task("openenv:http://127.0.0.1:8000")` (see docs/recipes/openenv.md).
"""

from __future__ import annotations

from typing import Any, TypeGuard

from composer_replication.tasks.arithmetic import ArithmeticTask
from composer_replication.tasks.openenv import OpenEnvTask
from composer_replication.tasks.pycode import PyCodeTask
from composer_replication.tasks.reasoning_gym import ReasoningGymTask
from composer_replication.tasks.sandbox import SandboxLimits, run_candidate
from composer_replication.tasks.strings import StringsTask
from composer_replication.tasks.task import (
    Example,
    Task,
    Verdict,
    clean_completion,
    decode_completion,
)

# The registry: the built-in tasks by name; users add their own by name (docs/tasks.md, "Adding
# your own task").
TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "strings": StringsTask,
    "pycode": PyCodeTask,
    "reasoning_gym": ReasoningGymTask,
    "openenv": OpenEnvTask,
}

TaskName = str
"""A task's name: a key of `TASKS`."""
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
"""The built-in tasks (those registered above, at import)."""

# "name:VALUE" shorthands: the part after the first ":" is this option of the task.
INLINE_OPTION: dict[str, str] = {"reasoning_gym": "dataset", "openenv": "env"}


def is_task_name(name: str) -> TypeGuard[TaskName]:
    """Whether `name` is a built-in task; a task a user registered in `TASKS` is not one
    (`get_task` builds both)."""
    return name in TASK_NAMES


def get_task(name: str, **options: Any) -> Task:
    """Build the task registered as `name` with its options (seed, n_train, n_eval, level, ...).

    `"reasoning_gym:DATASET"` is shorthand for `get_task("reasoning_gym", dataset="DATASET")`,
    `"openenv:URL_OR_IMAGE"` for `get_task("openenv", env="URL_OR_IMAGE")`.
    Unknown names and options raise ValueError naming what is accepted.
    """
    prefix, colon, value = name.partition(":")
    if colon and is_task_name(prefix) and prefix in INLINE_OPTION:
        key = INLINE_OPTION[prefix]
        if key in options and options[key] != value:
            raise ValueError(f"task {name} conflicts with {key}={options[key]!r}")
        name, options = prefix, {**options, key: value}
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks are {sorted(TASKS)}")
    cls = TASKS[name]
    import inspect

    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"task {name!r} does not take option(s) {unknown}; it takes {accepted}")
    return cls(**options)


__all__ = [
    "TASKS",
    "TASK_NAMES",
    "INLINE_OPTION",
    "TaskName",
    "ArithmeticTask",
    "Example",
    "OpenEnvTask",
    "PyCodeTask",
    "ReasoningGymTask",
    "SandboxLimits",
    "StringsTask",
    "Task",
    "Verdict",
    "decode_completion",
    "clean_completion",
    "get_task",
    "is_task_name",
    "run_candidate",
]
