"""Write a tiny Python function: `Write a Python function f(x) that returns x plus 3.`

The completion is Python source (a ```` ```python ```` fence and a leading "Answer:" are tolerated);
it is run in the sandbox of `sandbox.py` (a subprocess with time, memory, file-size and process
limits, no network, a fresh temp dir as cwd, writes outside it blocked) and `f` is called on fixed
test inputs. Return values are compared in *this* process with expected values the sandbox never
sees (numbers by value, with floats to 1e-9 relative; bools are not numbers here).

Levels (each adds families to the previous one):

======  ==========================================================================  ==========
level   function families                                                           prompts
======  ==========================================================================  ==========
easy    x plus k, x minus k, x times k, x squared, negative of x                    219
medium  + larger/smaller of a and b, absolute value, is-even, remainder mod k,      261
        reverse/uppercase/length of a string, sum of a list, count of a letter
hard    + factorial, n-th Fibonacci number, is-prime, vowel count, gcd              266
======  ==========================================================================  ==========

Reward shaping (exact > partial > runs > parses > malformed > empty):

* all tests pass: 1.0 (the only `correct` case);
* defines `f`: `0.3 + 0.6 * passed / total` (0.3 .. < 0.9);
* runs but defines no callable `f`: 0.2;
* raises (or is killed) while defining: 0.15;
* syntax error: 0.1 if it contains a `def f(` header, else 0.05;
* empty: 0.

Feedback is what a test runner prints: the syntax error, the traceback tail of the module or of the
first failing test, or `f(3) returned 5, expected 6`, how many tests passed, and whether the run was
killed by a limit (time, memory, output).
"""

from __future__ import annotations

import math
import os
import random
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from composer_replication.json_types import JSONDict, JSONValue
from composer_replication.tasks.pycode_families import FAMILIES, LEVEL_ORDER
from composer_replication.tasks.sandbox import SandboxLimits, SandboxResult, run_candidate
from composer_replication.tasks.task import (
    Example,
    Task,
    Verdict,
    clean_completion,
    strip_answer_prefix,
)

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The code in a completion: the first fenced block if there is one, else the whole text."""
    text = strip_answer_prefix(clean_completion(completion))
    fenced = _FENCE.search(text)
    return (fenced.group(1) if fenced else text).strip("\n")


def same_value(expected: JSONValue, got: JSONValue) -> bool:
    """Strict equality of JSON values: bool is not a number, floats to 1e-9 relative."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(expected) is type(got) and expected == got
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        return math.isclose(expected, got, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(expected, list) and isinstance(got, list):
        return len(expected) == len(got) and all(map(same_value, expected, got))
    if isinstance(expected, dict) and isinstance(got, dict):
        return expected.keys() == got.keys() and all(same_value(expected[k], got[k]) for k in got)
    return type(expected) is type(got) and expected == got


TestCase = tuple[list[JSONValue], JSONValue]  # (the arguments of one call, the value it returns)


def _test_cases(tests: list[JSONValue]) -> list[TestCase]:
    """``meta["tests"]`` (``[[args, expected], ...]``) as test cases; ValueError for an entry of
    another shape."""
    cases: list[TestCase] = []
    for test in tests:
        if not (isinstance(test, list) and len(test) == 2 and isinstance(test[0], list)):
            raise ValueError(f"a test must be [args, expected], got {test!r:.80}")
        cases.append((test[0], test[1]))
    return cases


def _call_text(fn: str, args: Sequence[JSONValue]) -> str:
    return f"{fn}({', '.join(repr(a) for a in args)})"


class PyCodeTask(Task):
    """Write-a-Python-function problems (see the module docstring for levels and rewards).

    Args (beyond `Task`'s): `level`; `families` (family keys, overriding the level); `limits`
    (a `SandboxLimits` or a dict of its fields, e.g. `{"wall_seconds": 5}` from a TOML config);
    `workers` (verifications run in parallel threads, each waiting on its own subprocess).
    """

    name: ClassVar[str] = "pycode"
    function: ClassVar[str] = "f"

    def __init__(
        self,
        *,
        seed: int = 0,
        n_train: int = 256,
        n_eval: int = 64,
        level: str = "easy",
        families: Sequence[str] | None = None,
        limits: SandboxLimits | dict[str, Any] | None = None,
        workers: int | None = None,
    ) -> None:
        super().__init__(seed=seed, n_train=n_train, n_eval=n_eval)
        if level not in LEVEL_ORDER:
            raise ValueError(f"pycode level must be one of {list(LEVEL_ORDER)}, got {level!r}")
        self.level = level
        by_key = {f.key: f for f in FAMILIES}
        if families is None:
            allowed = LEVEL_ORDER[: LEVEL_ORDER.index(level) + 1]
            self.families = tuple(f for f in FAMILIES if f.level in allowed)
        else:
            unknown = [k for k in families if k not in by_key]
            if not families or unknown:
                raise ValueError(
                    f"families must be a non-empty subset of {sorted(by_key)}, got {families!r}"
                )
            self.families = tuple(by_key[k] for k in families)
        if isinstance(limits, dict):  # from a TOML config: [task.options.limits]
            known = set(SandboxLimits.__dataclass_fields__)
            unknown = sorted(set(limits) - known)
            if unknown:
                raise ValueError(
                    f"unknown sandbox limit(s) {unknown}; known limits are {sorted(known)}"
                )
            limits = SandboxLimits(**limits)
        self.limits = limits or SandboxLimits()
        self.workers = workers if workers is not None else min(4, os.cpu_count() or 1)
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    def _sample(self, rng: random.Random) -> tuple[str, str, JSONDict]:
        family = rng.choice(self.families)
        k = rng.choice(family.params)
        fill = (lambda t: t.format(k=k)) if k is not None else (lambda t: t)
        prompt = (
            f"Write a Python function {self.function}({family.signature}) that "
            f"{fill(family.prompt)}."
        )
        oracle = f"def {self.function}({family.signature}):\n    return {fill(family.body)}"
        tests: list[JSONValue] = [[args, family.ref(k, *args)] for args in family.inputs]
        return (
            prompt,
            oracle,
            {"family": family.key, "k": k, "function": self.function, "tests": tests},
        )

    def oracle(self, example: Example) -> str:
        return example.answer

    def _wrong_answers(self, example: Example) -> list[str]:
        return [""]  # any other answer would start a sandbox per prompt just to build a corpus

    def verify(self, example: Example, completion: str) -> Verdict:
        code = extract_code(completion)
        fn = str(example.meta.get("function", self.function))
        tests = example.meta.get("tests")
        if not isinstance(tests, list) or not tests:
            raise ValueError(f"example {example.id!r} has no tests in meta['tests']")
        if not code.strip():
            return Verdict(0.0, False, f"Empty answer: expected Python code defining {fn}(...).")
        cases = _test_cases(tests)
        result = run_candidate(code, fn, [args for args, _ in cases], self.limits)
        return self._judge(fn, cases, code, result)

    def _judge(self, fn: str, tests: list[TestCase], code: str, result: SandboxResult) -> Verdict:
        killed = result.termination()
        note = f" ({killed})" if killed else ""
        if result.stage == "syntax_error":
            has_def = re.search(rf"\bdef\s+{re.escape(fn)}\s*\(", code) is not None
            return Verdict(
                0.1 if has_def else 0.05,
                False,
                f"Your code does not parse:\n{result.error}\nExpected a function definition "
                f"such as `def {fn}(x):` followed by an indented body.",
            )
        if result.stage in ("none", "start", "exec_error"):
            detail = f":\n{result.error}" if result.error else "."
            return Verdict(0.15, False, f"Your code failed while being defined{note}{detail}")
        if result.stage == "missing":
            return Verdict(0.2, False, f"Your code runs but does not define a function `{fn}`.")
        passed, first_failure = 0, None
        for i, (args, expected) in enumerate(tests):
            call = result.calls.get(i)
            call_text = _call_text(fn, args)
            if call is None:
                failure = f"{call_text} did not finish{note}."
            elif call.error is not None:
                failure = f"{call_text} raised an error:\n{call.error}"
            elif call.too_large:
                failure = f"{call_text} returned a value too large to check: {call.repr}..."
            elif not call.plain:
                failure = (
                    f"{call_text} returned {call.repr}, which is not plain data "
                    "(return an int, float, str, bool, list or dict)."
                )
            elif same_value(expected, call.value):
                passed += 1
                continue
            else:
                failure = f"{call_text} returned {call.repr}, expected {expected!r}."
            first_failure = first_failure or failure
        if passed == len(tests):
            return Verdict(1.0, True, None)
        return Verdict(
            0.3 + 0.6 * passed / len(tests),
            False,
            f"Passed {passed}/{len(tests)} tests. First failure: {first_failure}",
        )

    def verify_many(self, examples: Sequence[Example], completions: Sequence[str]) -> list[Verdict]:
        if self.workers == 1 or len(examples) < 2:
            return super().verify_many(examples, completions)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return list(pool.map(self.verify, examples, completions))
