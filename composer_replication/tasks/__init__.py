"""Built-in verifiable tasks: prompts with reference answers, a shaped reward with feedback (what
channel 2 feeds on) and an oracle solution (what channel 3 replays without a teacher endpoint).

    from composer_replication.tasks import get_task, TASKS
    task = get_task("arithmetic", seed=0, n_train=256, n_eval=64, level="easy")
    dataset = task.to_dataset("train")           # columns: prompt, example_id, answer, task_meta
    reward = task.reward_func()                  # per completion: (score, feedback)

`TASKS` is the explicit registry (name -> class). `reasoning_gym` needs the `tasks` extra; its
generator can be named inline: `get_task("reasoning_gym:chain_sum")`.
"""

from __future__ import annotations

from typing import Any

from composer_replication.tasks.arithmetic import ArithmeticTask
from composer_replication.tasks.base import Example, Task, Verdict, clean_completion
from composer_replication.tasks.pycode import PyCodeTask
from composer_replication.tasks.reasoning_gym import ReasoningGymTask
from composer_replication.tasks.sandbox import SandboxLimits, run_candidate
from composer_replication.tasks.strings import StringsTask

TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "strings": StringsTask,
    "pycode": PyCodeTask,
    "reasoning_gym": ReasoningGymTask,
}


def get_task(name: str, **options: Any) -> Task:
    """Build the task registered as `name` with its options (seed, n_train, n_eval, level, ...).

    `"reasoning_gym:DATASET"` is shorthand for `get_task("reasoning_gym", dataset="DATASET")`.
    Unknown names and options raise ValueError naming what is accepted.
    """
    if name.startswith("reasoning_gym:"):
        name, dataset = "reasoning_gym", name.split(":", 1)[1]
        if "dataset" in options and options["dataset"] != dataset:
            raise ValueError(f"task {name}:{dataset} conflicts with dataset={options['dataset']!r}")
        options["dataset"] = dataset
    cls = TASKS.get(name)
    if cls is None:
        raise ValueError(f"unknown task {name!r}; built-in tasks are {sorted(TASKS)}")
    import inspect

    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"task {name!r} does not take option(s) {unknown}; it takes {accepted}")
    return cls(**options)


__all__ = [
    "TASKS",
    "ArithmeticTask",
    "Example",
    "PyCodeTask",
    "ReasoningGymTask",
    "SandboxLimits",
    "StringsTask",
    "Task",
    "Verdict",
    "clean_completion",
    "get_task",
    "run_candidate",
]
