"""Integer arithmetic: the prompt is an expression such as `3+4=`, the answer its value.

Levels (each option can also be set on its own and overrides the level):

=======  ==========  =====  ==========  ================  =================================
level    operands    ops    n operands  negative results  problem space
=======  ==========  =====  ==========  ================  =================================
easy     0..9        ``+``  2           no                100 prompts, answers 0..18
medium   0..99       ``+-`` 2           no                ~15k prompts
hard     0..999      ``+-*``3           yes               ~10^9 prompts
=======  ==========  =====  ==========  ================  =================================

**Held-out split**: two prompts are one problem when one is a reordering of the other (terms
with their signs, factors within a product: `3+4+5=` and `5+3+4=`, `2*3-1=` and `3*2-1=`); the
class key is the operand multiset of a sum (`canonical_form`), and the split holds out whole
classes (tasks/task.py), so no held-out prompt is a training prompt in another order. The
out-of-distribution split (`ood_examples`) has one more operand than training.

The answer is the bare integer. Tolerated around it: a leading "Answer:" / "The answer is", and an
echo of the expression (`3+4=7`).

Reward shaping (exact > close > well-formed > malformed > empty), with `d = |pred - answer|`,
`closeness = 1 / (1 + d / s)`, `s = max(1, |answer| / 10)` (so being off by 1 on a small answer and
off by 10% on a large one score alike), and `brevity = 1 / (1 + extra / 8)` where `extra` is how many
characters longer than the reference the text is:

* exact integer: 1.0 (the only `correct` case);
* a bare integer, wrong: `0.1 + 0.3 * closeness` (0.1 .. < 0.4);
* an integer inside other text ("7 apples"): `(0.04 + 0.04 * closeness) * brevity` (< 0.08);
* text without any integer: `0.02 * brevity`; empty: 0.

Partial credit depends on the prompt's answer, not on the form alone, so that no constant answer
pays: a constant is far from most answers. Over the easy level's 100 sums the best constant ("9")
earns 0.27 on average, below the 0.37 that a policy right on 30% of the prompts earns even when
its other answers are far off (0.3 * 1.0 + 0.7 * 0.1); with a form bonus of 0.3-0.4 for any bare
integer (the shaping before) a constant "9" earned 0.52, more than a partly-right policy, and
policies collapsed to it. Every wrong answer stays below 0.5, the channel-2 success threshold, so
only exact answers are shown to the teacher as a "correct solution". Exact-match accuracy is the
headline metric; the shaped reward is the learning signal.

Feedback never states the answer: it says what form was expected and whether a number was too
small or too large, as a checker would.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from typing import ClassVar, TypedDict

from composer_replication.tasks.task import (
    Example,
    Problem,
    Task,
    Verdict,
    brevity,
    clean_completion,
    shorten,
    strip_answer_prefix,
)


class ArithmeticLevel(TypedDict):
    """A level's preset: every option of `ArithmeticTask` that a level sets."""

    min_operand: int
    max_operand: int
    ops: str
    num_operands: int
    allow_negative: bool


LEVELS: dict[str, ArithmeticLevel] = {
    "easy": {
        "min_operand": 0,
        "max_operand": 9,
        "ops": "+",
        "num_operands": 2,
        "allow_negative": False,
    },
    "medium": {
        "min_operand": 0,
        "max_operand": 99,
        "ops": "+-",
        "num_operands": 2,
        "allow_negative": False,
    },
    "hard": {
        "min_operand": 0,
        "max_operand": 999,
        "ops": "+-*",
        "num_operands": 3,
        "allow_negative": True,
    },
}

_INT = re.compile(r"[+-]?\d+")

# Reward shaping weights (module docstring); tests/tasks/test_tasks_reward_shaping.py derives the
# best constant answer's reward from them.
WRONG_BASE = 0.1
WRONG_CLOSE = 0.3
MALFORMED_BASE = 0.04
MALFORMED_CLOSE = 0.04
NO_NUMBER = 0.02


def evaluate(tokens: list[int | str]) -> int:
    """Value of `[a, op, b, op, c, ...]` with `*` binding tighter than `+`/`-` (no eval())."""
    terms: list[int] = [int(tokens[0])]
    signs: list[int] = [1]
    for op, value in zip(tokens[1::2], tokens[2::2], strict=True):
        if op == "*":
            terms[-1] *= int(value)
        else:
            terms.append(int(value))
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def signed_terms(tokens: list[int | str]) -> list[tuple[str, tuple[int, ...]]]:
    """`[a, op, b, ...]` as its signed product terms: `3*4+5-2` -> `[("+", (3, 4)), ("+", (5,)),
    ("-", (2,))]`. Reordering the terms (keeping each sign) or the factors of a term gives the
    same value: the expression's equivalence class."""
    terms: list[tuple[str, list[int]]] = [("+", [int(tokens[0])])]
    for op, value in zip(tokens[1::2], tokens[2::2], strict=True):
        if op == "*":
            terms[-1][1].append(int(value))
        else:
            terms.append((str(op), [int(value)]))
    return [(sign, tuple(factors)) for sign, factors in terms]


def tokenize(expression: str) -> list[int | str]:
    """`"3*4+5"` -> `[3, "*", 4, "+", 5]` (the prompt's expression, operands non-negative)."""
    return [int(t) if t.isdigit() else t for t in re.findall(r"\d+|[-+*]", expression)]


def canonical_form(expression: str) -> str:
    """The expression's class key: its signed terms with sorted factors, sorted (`5+4*3-2` and
    `3*4+5-2` -> `+3*4 +5 -2`). For a sum it is the operand multiset."""
    terms = sorted(
        sign + "*".join(str(f) for f in sorted(factors))
        for sign, factors in signed_terms(tokenize(expression))
    )
    return " ".join(terms)


def reorderings(expression: str) -> list[str]:
    """Every distinct expression of the same class (terms reordered with their signs, a
    subtracted term never first; factors reordered within a term), `expression` first."""
    terms = signed_terms(tokenize(expression))
    out: dict[str, None] = {expression: None}
    for order in itertools.permutations(terms):
        if order[0][0] != "+":
            continue
        factor_orders = [sorted(set(itertools.permutations(f))) for _, f in order]
        for factors in itertools.product(*factor_orders):
            text = "".join(
                ("" if i == 0 else sign) + "*".join(str(x) for x in fs)
                for i, ((sign, _), fs) in enumerate(zip(order, factors, strict=True))
            )
            out.setdefault(text, None)
    return list(out)


def _closeness(pred: int, answer: int) -> float:
    scale = max(1.0, abs(answer) / 10)
    return 1.0 / (1.0 + abs(pred - answer) / scale)


class ArithmeticTask(Task):
    """Integer arithmetic expressions (see the module docstring for levels and reward shaping)."""

    name: ClassVar[str] = "arithmetic"

    def __init__(
        self,
        *,
        seed: int = 0,
        n_train: int = 256,
        n_eval: int = 64,
        level: str = "easy",
        min_operand: int | None = None,
        max_operand: int | None = None,
        ops: str | None = None,
        num_operands: int | None = None,
        allow_negative: bool | None = None,
    ) -> None:
        super().__init__(seed=seed, n_train=n_train, n_eval=n_eval)
        if level not in LEVELS:
            raise ValueError(f"arithmetic level must be one of {sorted(LEVELS)}, got {level!r}")
        preset = LEVELS[level]
        self.level = level
        self.min_operand = preset["min_operand"] if min_operand is None else min_operand
        self.max_operand = preset["max_operand"] if max_operand is None else max_operand
        self.ops = preset["ops"] if ops is None else ops
        self.num_operands = preset["num_operands"] if num_operands is None else num_operands
        self.allow_negative = preset["allow_negative"] if allow_negative is None else allow_negative
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"need 0 <= min_operand <= max_operand, got {self.min_operand}..{self.max_operand}"
            )
        if (
            not self.ops
            or any(op not in "+-*" for op in self.ops)
            or len(set(self.ops)) != len(self.ops)
        ):
            raise ValueError(f"ops must be distinct characters from '+-*', got {self.ops!r}")
        if not 2 <= self.num_operands <= 6:
            raise ValueError(f"num_operands must be in 2..6, got {self.num_operands}")

    def _sample(self, rng: random.Random) -> Problem:
        return self._draw(rng, self.num_operands)

    def _draw(self, rng: random.Random, num_operands: int) -> Problem:
        for _ in range(1000):
            tokens: list[int | str] = [rng.randint(self.min_operand, self.max_operand)]
            for _ in range(num_operands - 1):
                tokens.append(rng.choice(self.ops))
                tokens.append(rng.randint(self.min_operand, self.max_operand))
            value = evaluate(tokens)
            if self.allow_negative or value >= 0:
                expr = "".join(str(t) for t in tokens)
                return f"{expr}=", str(value), {"expression": expr}
        raise ValueError(
            "cannot draw a non-negative problem with these options; set allow_negative=True"
        )

    def _canonical(self, problem: Problem) -> str:
        return canonical_form(str(problem[2]["expression"]))

    def _equivalents(self, problem: Problem) -> list[Problem]:
        prompt, answer, meta = problem
        return [
            (f"{expr}=", answer, {**meta, "expression": expr})
            for expr in reorderings(str(meta["expression"]))
        ]

    def _sample_ood(self, rng: random.Random) -> Problem:
        """One more operand than training, from the same range and operators."""
        return self._draw(rng, self.num_operands + 1)

    def _sample_beyond(self, rng: random.Random) -> Problem:
        """Two more operands than training (one more than the out-of-distribution split), same
        range and operators: sums a policy trained on the split cannot compute."""
        return self._draw(rng, self.num_operands + 2)

    def failed_attempt(self, example: Example, k: int = 0) -> str:
        """A near miss (the answer off by 1, 2, 3, 5 or 10, either way, picked by the example and
        `k`), the kind of wrong sum a learning policy gives; its feedback says only "too small"
        or "too large"."""
        offsets = (1, -1, 2, -2, 3, -3, 5, -5, 10, -10)
        digest = hashlib.sha256(f"{example.id}/{k}".encode()).digest()
        return str(int(example.answer) + offsets[digest[0] % len(offsets)])

    def verify(self, example: Example, completion: str) -> Verdict:
        answer = int(example.answer)
        text = strip_answer_prefix(clean_completion(completion))
        expr = str(example.meta.get("expression", example.prompt.rstrip("=")))
        # Tolerate an echo of the expression: "3+4=7" or "3 + 4 = 7".
        echo = re.match(r"^" + r"\s*".join(map(re.escape, expr)) + r"\s*=\s*", text)
        if echo:
            text = text[echo.end() :]
        if not text:
            return Verdict(0.0, False, "Empty answer: expected a single integer such as 12.")
        if _INT.fullmatch(text):
            pred = int(text)
            if pred == answer:
                return Verdict(1.0, True, None)
            direction = "too small" if pred < answer else "too large"
            return Verdict(
                WRONG_BASE + WRONG_CLOSE * _closeness(pred, answer),
                False,
                f"Wrong answer: {pred} is {direction}.",
            )
        found = _INT.search(text)
        if found is None:
            return Verdict(
                NO_NUMBER * brevity(text, example.answer),
                False,
                f"Expected a single integer (digits, optional leading '-'), got {shorten(text)}, "
                "which has no number in it.",
            )
        pred = int(found.group())
        reward = (MALFORMED_BASE + MALFORMED_CLOSE * _closeness(pred, answer)) * brevity(
            text, example.answer
        )
        verdict = "right" if pred == answer else ("too small" if pred < answer else "too large")
        return Verdict(
            reward,
            False,
            f"Expected only an integer with no other text, got {shorten(text)}; "
            f"its number {pred} is {verdict}.",
        )
