"""The `[task]` section: which verifiable task a run trains on, and how its prompts are split.

The tasks' own config, beside the registry that `name` picks from (`tasks.TASKS`, `get_task`);
the run schema (`config.schema.RunConfig`) composes it and checks the one rule it shares with
`[train]` and `[backend]` (a disjoint shard holds a step's prompts). Each key's default and help
are written once, here (`fields.setting`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from composer_replication.fields import require, setting
from composer_replication.tasks.task import HINT_SOURCES, HintSource

__all__ = ["TaskConfig"]


@dataclass(frozen=True)
class TaskConfig:
    """A verifiable task (composer_replication.tasks): built in, or an OpenEnv environment."""

    name: str = setting(
        "arithmetic",
        "built-in task name (see composer_replication.tasks.TASKS), 'reasoning_gym:DATASET', or "
        "'openenv:URL_OR_IMAGE' for an OpenEnv environment (docs/recipes/openenv.md)",
    )
    n_train: int = setting(256, "training prompts")
    n_eval: int = setting(32, "held-out evaluation prompts (disjoint from training)")
    options: dict[str, Any] = setting({}, "task-specific options passed to get_task(...)")
    shard: Literal["disjoint", "shared"] = setting(
        "disjoint",
        "'disjoint': replica k trains on every n-th training prompt from k (data islands, the "
        "DiLoCo setting); 'shared': every replica samples from all of them",
    )

    hint_share: float = setting(
        0.0,
        "share of the distinct training prompts also trained on with channel 2's hint in context "
        "(in turn: the solution, the solution and the feedback on a near miss, the feedback "
        "alone), so the policy learns to read the hint its channel-2 teacher is shown; 0 = none",
    )
    hint_source: HintSource = setting(
        "train",
        "which problems task.hint_share writes hints for: 'train', copies of training prompts "
        "(redundant for a prompt the policy can already solve); 'beyond', as many problems past "
        "the training distribution and every evaluated split (arithmetic: two more operands), "
        "shown with the solution, so only reading the hint earns their reward; 'both', each",
    )
    hint_feedback_with_solution: bool = setting(
        True,
        "channel 2's hint for a failed rollout whose sibling succeeded: the solution and the "
        "feedback on the attempt (true, TRL's default) or the solution alone (false, the SDPO "
        "reference runs' environment_feedback_only_without_solution); the hinted examples of "
        "task.hint_share are written the same way",
    )

    hint_feedback_alone: bool = setting(
        True,
        "channel 2's hint for a failed rollout without a successful sibling: the feedback on it "
        "alone (true, TRL's and the SDPO reference runs') or none (false: channel 2 distils only "
        "from successful siblings, and the hinted examples of task.hint_share all show the "
        "solution)",
    )
    hint_grpo: bool = setting(
        True,
        "whether the hinted examples of task.hint_share also earn channel-1 (GRPO) advantage, "
        "like any prompt (true: the policy is rewarded for reading the hint it is shown); false "
        "zeroes it, so they train through channel 3's replay of their teacher traces (and "
        "channel 2) only",
    )

    def __post_init__(self) -> None:
        require(self.n_train >= 1, "task.n_train", "must be >= 1")
        require(self.n_eval >= 0, "task.n_eval", "must be >= 0")
        require(0.0 <= self.hint_share <= 1.0, "task.hint_share", "must be in [0, 1]")
        require(
            self.hint_source in HINT_SOURCES,
            "task.hint_source",
            f"must be one of {list(HINT_SOURCES)}",
        )
