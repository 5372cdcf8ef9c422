"""Shared pieces of the benchmarks that train ONE replica in-process from the run configuration
(benchmarks/composer_ablation.py, benchmarks/vs_trl.py): the run config of a benchmark run, its
task and initial model, a reward log, a wall-time budget, and the held-out evaluation.

Not a benchmark itself (the leading underscore keeps it out of `python benchmarks/NAME.py`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from transformers import TrainerCallback


def run_config(seed: int, max_steps: int, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """The embedded default for one in-process replica: `run.seed`, `train.max_steps`, one
    replica (no DiLoCo: the benchmarks compare what one trainer learns), then `overrides`."""
    from composer_replication.config import load_config

    base = [
        f"run.seed={seed}",
        f"train.max_steps={max_steps}",
        f"diloco.sync_every_h={max_steps}",
        "backend.n_replicas=1",
    ]
    return load_config(overrides=[*base, *overrides])


def build_parts(config: Any) -> tuple[Any, Any, Any]:
    """(task, model, tokenizer) of `config`; the initial model depends on `run.seed` only, so
    every variant of one seed starts from bit-identical weights."""
    from transformers import set_seed

    from composer_replication.assembly.build import build_model, build_task

    set_seed(config.run.seed)
    task = build_task(config)
    model, tok = build_model(config)
    return task, model, tok


# Where TRL trainers log the mean training reward: GRPOTrainer (and ours) as "reward", TRL's
# experimental SDPOTrainer as "self_distillation/reward_mean".
REWARD_KEYS = ("reward", "self_distillation/reward_mean")


# The learning-signal metrics a run's record summarises (TRL's policy entropy and share of
# zero-advantage groups; our channel 2's measured teacher advantage and gate).
SIGNAL_KEYS = ("entropy", "frac_reward_zero_std", "sdpo/teacher_advantage", "sdpo/gate_open")


class RewardLog(TrainerCallback):
    """The mean training reward of every TRL log line, in order (`rewards`), and every logged
    value of `SIGNAL_KEYS` (`series`)."""

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.series: dict[str, list[float]] = {k: [] for k in SIGNAL_KEYS}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if not logs:
            return
        for key in SIGNAL_KEYS:
            if key in logs and logs[key] == logs[key]:  # NaN: nothing was measured
                self.series[key].append(float(logs[key]))
        for key in REWARD_KEYS:
            if key in logs:
                self.rewards.append(float(logs[key]))
                return

    def mean(self, key: str, last: int | None = None) -> float | None:
        """The mean of `key`'s logged values (the last `last` of them), None if never logged."""
        values = self.series[key][-last:] if last else self.series[key]
        return sum(values) / len(values) if values else None


CLOCKS = {"wall": time.monotonic, "cpu": time.process_time}


class WallBudget(TrainerCallback):
    """Stops training at the first optimizer step that ends after `seconds` of training time
    (from `on_train_begin`), minus the time spent inside `excluded()` (measurements that are
    not training). `steps` and `seconds` say what was spent.

    `clock="wall"` counts wall seconds; `clock="cpu"` counts this process's CPU seconds (all
    its threads), which on a machine shared with other jobs removes the time a run waits for a
    core, but not all of the load's effect: a loaded machine does less work per CPU second
    (cold caches every time slice, shared memory bandwidth; docs/benchmarks-notebook.md measured up to
    ~4x at load 12-20 on 2 cores), so runs compared with each other must run at the same time
    (with one torch thread, ~ wall seconds on a free core)."""

    def __init__(self, seconds: float, clock: str = "wall") -> None:
        if seconds <= 0:
            raise ValueError(f"a time budget must be > 0 seconds, got {seconds}")
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
        self.budget = float(seconds)
        self.clock = clock
        self._now = CLOCKS[clock]
        self._t0: float | None = None
        self._excluded = 0.0
        self.steps = 0
        self.seconds = 0.0

    @contextmanager
    def excluded(self) -> Iterator[None]:
        t0 = self._now()
        try:
            yield
        finally:
            self._excluded += self._now() - t0

    def elapsed(self) -> float:
        if self._t0 is None:
            return 0.0
        return self._now() - self._t0 - self._excluded

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._t0 = self._now()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps = int(state.global_step)
        self.seconds = self.elapsed()
        if self.seconds >= self.budget:
            control.should_training_stop = True


def held_out(
    model: Any, tokenizer: Any, task: Any, config: Any, examples: list[Any] | None = None
) -> dict[str, Any]:
    """Greedy exact match on the run's held-out prompts (the first `train.eval_max_examples`
    of the task's eval split, as the run evaluates; or `examples`), and how concentrated the
    answers are: `constant_answer_share` is the largest share of one answer text (after the
    task's own cleaning: end markers and special tokens cut, an "Answer:" prefix dropped; an
    empty answer counts as the answer ""), so 1.0 is a policy that answers the same thing to
    every prompt. `correct` is the 0/1 verdict per prompt, in order."""
    from composer_replication.run.reporter import greedy_completions
    from composer_replication.tasks.task import clean_completion, strip_answer_prefix

    if examples is None:
        n = min(config.train.eval_max_examples, config.task.n_eval)
        examples = list(task.eval_examples())[:n]
    if not examples:
        raise ValueError("the task has no held-out prompts (task.n_eval = 0)")
    completions = greedy_completions(
        model,
        tokenizer,
        [ex.prompt for ex in examples],
        max_new_tokens=config.train.max_completion_length,
    )
    verdicts = [task.verify(ex, c) for ex, c in zip(examples, completions, strict=True)]
    answers = [strip_answer_prefix(clean_completion(c)) for c in completions]
    top, count = Counter(answers).most_common(1)[0]
    return {
        "accuracy": sum(v.correct for v in verdicts) / len(examples),
        "reward": sum(float(v.reward) for v in verdicts) / len(examples),
        "constant_answer_share": count / len(examples),
        "top_answer": top,
        "n": len(examples),
        "correct": [int(v.correct) for v in verdicts],
    }
