"""The function families of the pycode task: prompt and oracle templates, reference
implementations and fixed test inputs (see `pycode.py` for levels and rewards)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from composer_replication.json_types import JSONScalar, JSONValue

# Argument lists the candidate is called with (one list per call).
_INTS: list[list[JSONValue]] = [[0], [1], [2], [5], [-3], [10], [37]]
_PAIRS: list[list[JSONValue]] = [[1, 2], [5, 3], [-4, -7], [0, 0], [10, -10], [8, 8]]
_STRS: list[list[JSONValue]] = [[""], ["a"], ["abc"], ["Hello"], ["racecar"], ["banana"]]
_LISTS: list[list[JSONValue]] = [[[]], [[1]], [[1, 2, 3]], [[-5, 5, 7]], [[10, 20, 30, 40]]]
_SMALL: list[list[JSONValue]] = [[0], [1], [2], [5], [7], [10]]


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


@dataclass(frozen=True)
class Family:
    """One kind of function: prompt and oracle templates (with `{k}`), reference, test inputs."""

    key: str
    level: str
    params: tuple[JSONScalar, ...]
    signature: str
    prompt: str
    body: str
    ref: Callable[..., JSONValue]
    inputs: list[list[JSONValue]]


FAMILIES: tuple[Family, ...] = (
    Family(
        "add",
        "easy",
        tuple(range(1, 100)),
        "x",
        "returns x plus {k}",
        "x + {k}",
        lambda k, x: x + k,
        _INTS,
    ),
    Family(
        "sub",
        "easy",
        tuple(range(1, 100)),
        "x",
        "returns x minus {k}",
        "x - {k}",
        lambda k, x: x - k,
        _INTS,
    ),
    Family(
        "mul",
        "easy",
        tuple(range(2, 21)),
        "x",
        "returns x times {k}",
        "x * {k}",
        lambda k, x: x * k,
        _INTS,
    ),
    Family("square", "easy", (None,), "x", "returns x squared", "x * x", lambda k, x: x * x, _INTS),
    Family(
        "negate", "easy", (None,), "x", "returns the negative of x", "-x", lambda k, x: -x, _INTS
    ),
    Family(
        "max",
        "medium",
        (None,),
        "a, b",
        "returns the larger of a and b",
        "max(a, b)",
        lambda k, a, b: max(a, b),
        _PAIRS,
    ),
    Family(
        "min",
        "medium",
        (None,),
        "a, b",
        "returns the smaller of a and b",
        "min(a, b)",
        lambda k, a, b: min(a, b),
        _PAIRS,
    ),
    Family(
        "abs",
        "medium",
        (None,),
        "x",
        "returns the absolute value of x",
        "abs(x)",
        lambda k, x: abs(x),
        _INTS,
    ),
    Family(
        "even",
        "medium",
        (None,),
        "x",
        "returns True if x is even, else False",
        "x % 2 == 0",
        lambda k, x: x % 2 == 0,
        _INTS,
    ),
    Family(
        "mod",
        "medium",
        tuple(range(2, 10)),
        "x",
        "returns the remainder of x divided by {k}",
        "x % {k}",
        lambda k, x: x % k,
        _INTS,
    ),
    Family(
        "reverse",
        "medium",
        (None,),
        "s",
        "returns the string s reversed",
        "s[::-1]",
        lambda k, s: s[::-1],
        _STRS,
    ),
    Family(
        "upper",
        "medium",
        (None,),
        "s",
        "returns the string s in uppercase",
        "s.upper()",
        lambda k, s: s.upper(),
        _STRS,
    ),
    Family(
        "len",
        "medium",
        (None,),
        "s",
        "returns the length of the string s",
        "len(s)",
        lambda k, s: len(s),
        _STRS,
    ),
    Family(
        "sum",
        "medium",
        (None,),
        "xs",
        "returns the sum of the list xs",
        "sum(xs)",
        lambda k, xs: sum(xs),
        _LISTS,
    ),
    Family(
        "count",
        "medium",
        tuple("abcdefghijklmnopqrstuvwxyz"),
        "s",
        "returns how many times the letter '{k}' occurs in s",
        "s.count('{k}')",
        lambda k, s: s.count(k),
        _STRS,
    ),
    Family(
        "factorial",
        "hard",
        (None,),
        "n",
        "returns n factorial (n >= 0)",
        "1 if n < 2 else n * f(n - 1)",
        lambda k, n: math.factorial(n),
        _SMALL,
    ),
    Family(
        "fib",
        "hard",
        (None,),
        "n",
        "returns the n-th Fibonacci number (f(0) = 0, f(1) = 1)",
        "n if n < 2 else f(n - 1) + f(n - 2)",
        lambda k, n: _fib(n),
        _SMALL,
    ),
    Family(
        "prime",
        "hard",
        (None,),
        "n",
        "returns True if n is a prime number, else False",
        "n > 1 and all(n % d for d in range(2, n))",
        lambda k, n: _is_prime(n),
        _SMALL + [[13], [21], [97]],
    ),
    Family(
        "vowels",
        "hard",
        (None,),
        "s",
        "returns the number of vowels (aeiou) in s",
        "sum(c in 'aeiou' for c in s)",
        lambda k, s: sum(c in "aeiou" for c in s),
        _STRS,
    ),
    Family(
        "gcd",
        "hard",
        (None,),
        "a, b",
        "returns the greatest common divisor of a and b (a, b >= 0)",
        "a if b == 0 else f(b, a % b)",
        lambda k, a, b: math.gcd(a, b),
        [[12, 18], [7, 5], [0, 9], [100, 75], [21, 14]],
    ),
)
LEVEL_ORDER = ("easy", "medium", "hard")
