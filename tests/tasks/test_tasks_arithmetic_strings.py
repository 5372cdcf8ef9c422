"""Arithmetic and string tasks: right / wrong / malformed answers, reward shaping, feedback."""

from __future__ import annotations

import random
import re

import pytest

from composer_replication.tasks import Example, get_task
from composer_replication.tasks.arithmetic import ArithmeticTask, evaluate
from composer_replication.tasks.strings import StringsTask


def _arith(answer: int, expr: str = "3+4") -> Example:
    return Example(id="x", prompt=f"{expr}=", answer=str(answer), meta={"expression": expr})


def test_arithmetic_levels_have_the_promised_ranges() -> None:
    easy = get_task("arithmetic", n_train=60, n_eval=40)
    for ex in easy.train_examples() + easy.eval_examples():
        a, b = map(int, ex.meta["expression"].split("+"))
        assert 0 <= a <= 9 and 0 <= b <= 9 and int(ex.answer) == a + b <= 18
        assert ex.prompt == f"{a}+{b}="
    medium = get_task("arithmetic", level="medium", n_train=100, n_eval=10)
    assert all(int(ex.answer) >= 0 for ex in medium.train_examples())
    hard = get_task("arithmetic", level="hard", n_train=100, n_eval=10)
    for ex in hard.train_examples():
        assert int(ex.answer) == evaluate(re.findall(r"\d+|[-+*]", ex.meta["expression"]))
    assert evaluate([2, "+", 3, "*", 4, "-", 5]) == 9
    assert evaluate([7, "-", 2, "-", 1]) == 4
    for bad in (
        {"ops": "/"},
        {"ops": ""},
        {"min_operand": 5, "max_operand": 1},
        {"num_operands": 1},
        {"level": "extreme"},
    ):
        with pytest.raises(ValueError):
            ArithmeticTask(**bad)


def test_arithmetic_right_wrong_malformed() -> None:
    task = ArithmeticTask()
    ex = _arith(7)
    for ok in [
        "7",
        " 7\n",
        "Answer: 7",
        "The answer is 7",
        "3+4=7",
        "3 + 4 = 7",
        "7<|im_end|>",
        "7<|endoftext|><|pad|>",
    ]:
        assert task.verify(ex, ok).correct, ok
        assert task.verify(ex, ok).feedback is None
    small = task.verify(ex, "6")
    assert not small.correct and small.feedback == "Wrong answer: 6 is too small."
    assert "too large" in task.verify(ex, "12").feedback
    assert "no number" in task.verify(ex, "abc").feedback
    assert "Empty" in task.verify(ex, "").feedback
    messy = task.verify(ex, "7 apples")
    assert not messy.correct and "only an integer" in messy.feedback
    assert task.verify(_arith(-3, "2-5"), "-3").correct


def test_arithmetic_reward_is_shaped_and_monotone() -> None:
    task = ArithmeticTask()
    ex = _arith(7)
    r = {
        c: task.verify(ex, c).reward
        for c in [
            "7",
            "8",
            "9",
            "12",
            "70",
            "-7",
            "x7x",
            "xx",
            "a long rambling answer without digits",
            "",
        ]
    }
    assert r["7"] == 1.0
    # Closer is better; a bare wrong integer earns 0.1 + 0.3 * closeness (< 0.4, so it stays
    # below the 0.5 channel-2 success threshold and far from an exact answer).
    assert 0.4 > r["8"] > r["9"] > r["12"] > r["70"] >= 0.1
    assert r["-7"] >= 0.1  # no bonus for shape alone: only closeness to this prompt's answer
    assert 0.1 > r["x7x"] > r["xx"] > r["a long rambling answer without digits"] > r[""] == 0.0
    # Closeness scales with the answer: 10% off on 1000 is worth what 1 off on 7 is.
    big = _arith(1000, "500+500")
    assert task.verify(big, "1100").reward == pytest.approx(task.verify(ex, "8").reward)


def test_arithmetic_feedback_never_states_the_answer() -> None:
    task = ArithmeticTask(level="medium", n_train=50, n_eval=10)
    rng = random.Random(0)
    for ex in task.train_examples():
        for guess in [str(int(ex.answer) + rng.choice([-3, -1, 1, 2, 40])), "abc", "", "x 5"]:
            v = task.verify(ex, guess)
            assert not v.correct
            assert re.search(rf"(?<!\d){ex.answer}(?!\d)", v.feedback) is None, (ex, guess)


@pytest.mark.parametrize("task_cls", [ArithmeticTask, StringsTask])
def test_reward_stays_in_range_on_random_junk(task_cls: type) -> None:
    task = task_cls(level="hard", n_train=20, n_eval=5)
    rng = random.Random(1)
    alphabet = "0123456789+-= abcXYZ\n<|>'\"`:"
    for ex in task.train_examples():
        for _ in range(25):
            junk = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
            v = task.verify(ex, junk)
            assert 0.0 <= v.reward <= 1.0
            assert v.correct == (v.feedback is None)


def test_strings_levels_and_operations() -> None:
    easy = get_task("strings", n_train=50, n_eval=10)
    for ex in easy.train_examples():
        assert ex.prompt.startswith("Reverse: ") and 1 <= len(ex.meta["input"]) <= 3
        assert ex.answer == ex.meta["input"][::-1]
    hard = get_task("strings", level="hard", n_train=200, n_eval=10)
    ops = {ex.meta["operation"] for ex in hard.train_examples()}
    assert ops == {"reverse", "upper", "sort", "swapcase"}
    for ex in hard.train_examples():
        s = ex.meta["input"]
        expected = {
            "reverse": s[::-1],
            "upper": s.upper(),
            "sort": "".join(sorted(s)),
            "swapcase": s.swapcase(),
        }[ex.meta["operation"]]
        assert ex.answer == expected
    for bad in (
        {"operations": ["rot13"]},
        {"operations": []},
        {"min_length": 0},
        {"alphabet": "ab1"},
    ):
        with pytest.raises(ValueError):
            StringsTask(**bad)


def test_strings_right_wrong_malformed_and_shaping() -> None:
    task = StringsTask()
    ex = Example(
        id="s",
        prompt="Reverse: abcd",
        answer="dcba",
        meta={"operation": "reverse", "input": "abcd"},
    )
    for ok in ["dcba", "Answer: dcba", "'dcba'", '"dcba"', " dcba <|im_end|>"]:
        v = task.verify(ex, ok)
        assert v.correct and v.reward == 1.0 and v.feedback is None, ok
    r = {
        c: task.verify(ex, c).reward
        for c in [
            "dcba",
            "dcbb",
            "dcab",
            "abcd",
            "dcb",
            "zzzz",
            "zz",
            "dcba is the answer",
            "x" * 40,
            "",
        ]
    }
    assert r["dcba"] == 1.0
    assert 0.8 > r["dcbb"] > r["zzzz"] >= 0.2  # one wrong letter beats all wrong
    assert r["dcab"] > r["abcd"] > r["zzzz"]  # right letters, more in place -> more
    assert r["dcb"] > r["zz"]  # a right prefix beats junk
    assert 0.2 > r["dcba is the answer"] > r["x" * 40] and r[""] == 0.0
    fb = task.verify(ex, "dcab").feedback
    assert "position(s) 3, 4" in fb and "dcba" not in fb
    assert "expected 4 characters, got 3" in task.verify(ex, "dcb").feedback
    assert "one word" in task.verify(ex, "dc ba").feedback
    assert (
        "1 character)"
        in task.verify(Example(id="t", prompt="Reverse: a", answer="a", meta={}), "").feedback
    )
