"""String transformations: `Reverse: abc` -> `cba`, `Uppercase: abc` -> `ABC`, `Sort: cab` -> `abc`,
`Swapcase: aBc` -> `AbC`.

Levels (each option can also be set on its own and overrides the level):

======  ================================  ======  =============================================
level   operations                        length  input letters
======  ================================  ======  =============================================
easy    reverse                           1..3    a-z (18k prompts)
medium  reverse, upper, sort              2..5    a-z
hard    reverse, upper, sort, swapcase    4..8    a-z (swapcase: a-z and A-Z)
======  ================================  ======  =============================================

The answer is the transformed string. Tolerated around it: a leading "Answer:" and one pair of
matching quotes.

Reward shaping (exact > close > well-formed > malformed > empty). A *well-formed* answer is one word
(no whitespace) at most `2 * len(reference) + 2` characters long. With `overlap` = size of the
multiset intersection of its characters with the reference's / the longer length, `position` =
characters equal at the same index / the longer length:

* exact: 1.0 (the only `correct` case);
* well-formed, wrong: `0.2 + 0.1 * same_length + 0.2 * overlap + 0.3 * position` (0.2 .. < 0.8);
* malformed: `(0.05 + 0.1 * overlap_of_first_word) * brevity` (<= 0.15), where
  `brevity = 1 / (1 + extra / 8)` shrinks with the characters beyond the reference length;
* empty: 0.

Held-out split: `Sort` inputs with the same letters are one problem (same answer) and are held
out together; every other prompt is its own class. The out-of-distribution split
(`ood_examples`) has inputs 1-2 characters longer than any training input.

Feedback says what a checker would: expected length vs actual, whether the letters (as a multiset)
are right, and which 1-based positions are wrong, but never the expected string.
"""

from __future__ import annotations

import random
import string
from collections import Counter
from collections.abc import Callable
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

# op name -> (prompt label, transformation)
OPERATIONS: dict[str, tuple[str, Callable[[str], str]]] = {
    "reverse": ("Reverse", lambda s: s[::-1]),
    "upper": ("Uppercase", str.upper),
    "sort": ("Sort", lambda s: "".join(sorted(s))),
    "swapcase": ("Swapcase", str.swapcase),
}


class StringsLevel(TypedDict):
    """A level's preset: every option of `StringsTask` that a level sets."""

    operations: tuple[str, ...]
    min_length: int
    max_length: int


LEVELS: dict[str, StringsLevel] = {
    "easy": {"operations": ("reverse",), "min_length": 1, "max_length": 3},
    "medium": {"operations": ("reverse", "upper", "sort"), "min_length": 2, "max_length": 5},
    "hard": {
        "operations": ("reverse", "upper", "sort", "swapcase"),
        "min_length": 4,
        "max_length": 8,
    },
}


def _chars(n: int) -> str:
    return f"{n} character" + ("" if n == 1 else "s")


def _overlap(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    return sum((Counter(a) & Counter(b)).values()) / max(len(a), len(b))


def _position(a: str, b: str) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(len(a), len(b), 1)


class StringsTask(Task):
    """String transformations (see the module docstring for levels and reward shaping)."""

    name: ClassVar[str] = "strings"

    def __init__(
        self,
        *,
        seed: int = 0,
        n_train: int = 256,
        n_eval: int = 64,
        level: str = "easy",
        operations: tuple[str, ...] | list[str] | None = None,
        min_length: int | None = None,
        max_length: int | None = None,
        alphabet: str = string.ascii_lowercase,
    ) -> None:
        super().__init__(seed=seed, n_train=n_train, n_eval=n_eval)
        if level not in LEVELS:
            raise ValueError(f"strings level must be one of {sorted(LEVELS)}, got {level!r}")
        preset = LEVELS[level]
        self.level = level
        self.operations = tuple(preset["operations"] if operations is None else operations)
        self.min_length = preset["min_length"] if min_length is None else min_length
        self.max_length = preset["max_length"] if max_length is None else max_length
        self.alphabet = alphabet
        unknown = [op for op in self.operations if op not in OPERATIONS]
        if not self.operations or unknown:
            raise ValueError(
                f"operations must be a non-empty subset of {sorted(OPERATIONS)}, "
                f"got {list(self.operations)!r}"
            )
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(
                f"need 1 <= min_length <= max_length, got {self.min_length}..{self.max_length}"
            )
        if not alphabet or not all(c.isalpha() and c.isascii() for c in alphabet):
            raise ValueError(f"alphabet must be non-empty ASCII letters, got {alphabet!r}")

    def _sample(self, rng: random.Random) -> Problem:
        return self._draw(rng, self.min_length, self.max_length)

    def _canonical(self, problem: Problem) -> str:
        """`Sort` inputs with the same letters are one problem (same answer); every other
        prompt is its own class."""
        op, text = str(problem[2]["operation"]), str(problem[2]["input"])
        return f"sort:{''.join(sorted(text))}" if op == "sort" else problem[0]

    def _sample_ood(self, rng: random.Random) -> Problem:
        """Inputs 1-2 characters longer than any training input, same operations."""
        return self._draw(rng, self.max_length + 1, self.max_length + 2)

    def _sample_beyond(self, rng: random.Random) -> Problem:
        """Inputs 3-4 characters longer than any training input (longer than the
        out-of-distribution split's), same operations."""
        return self._draw(rng, self.max_length + 3, self.max_length + 4)

    def _draw(self, rng: random.Random, min_length: int, max_length: int) -> Problem:
        op = rng.choice(self.operations)
        letters = self.alphabet
        if op == "upper":
            letters = "".join(dict.fromkeys(self.alphabet.lower()))
        elif op == "swapcase":
            letters = "".join(dict.fromkeys(self.alphabet.lower() + self.alphabet.upper()))
        length = rng.randint(min_length, max_length)
        text = "".join(rng.choice(letters) for _ in range(length))
        label, fn = OPERATIONS[op]
        return f"{label}: {text}", fn(text), {"operation": op, "input": text}

    def verify(self, example: Example, completion: str) -> Verdict:
        ref = example.answer
        text = strip_answer_prefix(clean_completion(completion))
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"`":
            text = text[1:-1]
        if not text:
            return Verdict(
                0.0,
                False,
                f"Empty answer: expected the transformed string ({_chars(len(ref))}).",
            )
        if text == ref:
            return Verdict(1.0, True, None)
        if any(c.isspace() for c in text) or len(text) > 2 * len(ref) + 2:
            first = text.split()[0] if text.split() else ""
            return Verdict(
                (0.05 + 0.1 * _overlap(first, ref)) * brevity(text, ref),
                False,
                f"Expected only the transformed string ({_chars(len(ref))}, one word, no "
                f"spaces or explanation), got {shorten(text)}.",
            )
        overlap, position = _overlap(text, ref), _position(text, ref)
        reward = 0.2 + 0.1 * (len(text) == len(ref)) + 0.2 * overlap + 0.3 * position
        problems = []
        if len(text) != len(ref):
            problems.append(f"wrong length: expected {_chars(len(ref))}, got {len(text)}")
        if Counter(text) != Counter(ref):
            problems.append("the letters are not the right ones (as a multiset)")
        if len(text) == len(ref):
            wrong = [str(i + 1) for i, (x, y) in enumerate(zip(text, ref)) if x != y]
            problems.append(f"wrong character at position(s) {', '.join(wrong)}")
        return Verdict(reward, False, f"Wrong answer {shorten(text)}: " + "; ".join(problems) + ".")
