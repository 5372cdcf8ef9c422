"""The arithmetic reward must not pay a constant answer more than a partly-right policy.

Issue 14: with a form bonus of 0.3-0.4 for any bare integer, a constant "9" earned a mean shaped
reward of 0.519 on one-digit sums, more than the trained policy, and every trainer collapsed to a
constant. The shaping now gives a wrong bare integer `0.1 + 0.3 * closeness` (closeness to THIS
prompt's answer), so:

* a policy right on 30% of the prompts and far off on the rest earns at least
  `0.3 * 1.0 + 0.7 * 0.1 = 0.37` (0.1 is the floor of a well-formed wrong answer);
* the best constant earns its exact-match share (at most 10% of one-digit sums are 9) plus
  `0.1 + 0.3 * closeness` averaged over the other answers, which a constant cannot keep close:
  0.268 on the 100 one-digit sums, less on wider answer ranges.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter

import pytest

from composer_replication.assembly.build import build_task
from composer_replication.config import load_config
from composer_replication.tasks import Example, Task, get_task
from composer_replication.tasks.arithmetic import WRONG_BASE, ArithmeticTask


def _mean_reward(task: Task, examples: list[Example], answers: list[str]) -> float:
    return statistics.fmean(task.verify(ex, a).reward for ex, a in zip(examples, answers))


def _best_constant(task: Task, examples: list[Example]) -> tuple[float, int]:
    values = [int(ex.answer) for ex in examples]
    # Every integer from below the smallest answer to above the largest: any other constant is
    # farther from every answer, hence worse.
    candidates = range(min(values) - 2, max(values) + 3)
    return max((_mean_reward(task, examples, [str(c)] * len(examples)), c) for c in candidates)


def _partly_right(task: Task, examples: list[Example], share: float) -> float:
    """Right on the first `share` of the prompts, a far-off integer on the others."""
    n_right = math.ceil(share * len(examples))
    answers = [
        ex.answer if i < n_right else str(int(ex.answer) + 10_000) for i, ex in enumerate(examples)
    ]
    return _mean_reward(task, examples, answers)


def test_best_constant_on_one_digit_sums_is_derived() -> None:
    task = ArithmeticTask(n_train=1, n_eval=1)
    everything = [
        Example(f"x{a}{b}", f"{a}+{b}=", str(a + b), {"expression": f"{a}+{b}"})
        for a in range(10)
        for b in range(10)
    ]  # all 100 one-digit sums
    best, constant = _best_constant(task, everything)
    assert constant == 9 and best == pytest.approx(0.26799, abs=1e-4)
    partly = _partly_right(task, everything, 0.3)
    assert partly == pytest.approx(0.3 + 0.7 * WRONG_BASE, abs=1e-3)  # 0.37
    assert best < partly - 0.1


@pytest.mark.parametrize("split", ["train", "eval"])
def test_default_run_task_pays_no_constant_more_than_a_partly_right_policy(split: str) -> None:
    task = build_task(load_config())  # the embedded default's task
    examples = task.examples(split)
    assert len(examples) >= 200
    best, constant = _best_constant(task, examples)
    partly = _partly_right(task, examples, 0.3)
    assert best < 0.3 + 0.7 * WRONG_BASE <= partly, (constant, best, partly)
    # and no constant is right on more than 10 % of the training prompts (the sums 13 and 14 are
    # the most common of three digits, 75 of the 1000 triples each). The held-out split holds out
    # whole operand multisets (about 50 of the 220), so its answers are more concentrated: the
    # best constant is right on 15 / 13 / 12 % of seeds 0 / 1 / 2 (docs/benchmarks-notebook.md reports it
    # beside every held-out accuracy)
    share = max(Counter(ex.answer for ex in examples).values()) / len(examples)
    assert share <= (0.1 if split == "train" else 0.16), share


@pytest.mark.parametrize("level", ["easy", "medium", "hard"])
def test_wrong_answers_stay_below_the_channel2_success_threshold(level: str) -> None:
    """Only exact answers may reach 0.5 (the trainer's `sdpo_success_threshold`): a wrong answer
    above it would be shown to the channel-2 teacher as a "correct solution"."""
    task = get_task("arithmetic", level=level, n_train=100, n_eval=0)
    rng = random.Random(0)
    for ex in task.train_examples():
        answer = int(ex.answer)
        for delta in (1, -1, 2, rng.randint(3, 50), rng.randint(-50, -3)):
            for text in (
                str(answer + delta),
                f"{answer + delta} apples",
                f"Answer: {answer + delta}",
            ):
                verdict = task.verify(ex, text)
                assert not verdict.correct and verdict.reward < 0.4, (ex.prompt, text)
        assert task.verify(ex, ex.answer).reward == 1.0
