"""The feedback contract: how reward functions hand channel 2 the environment's feedback.

TRL calls a reward function as ``f(prompts=..., completions=..., completion_ids=..., **columns)``
and expects ``list[float | None]``. Ours may instead return, per completion, a
``(score, feedback)`` pair (``feedback: str | None``); a plain-float reward function keeps working
unchanged. Separately, ``feedback_funcs=[g, ...]`` are called the same way and return
``list[str | None]``. All feedback strings for one completion are joined with a blank line.

`wrap_reward_func` turns a pair-returning function into the float-returning one TRL needs and
records the feedback on the side (`FeedbackRecorder`); sync and async functions are both handled.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any


class FeedbackRecorder:
    """Per-batch feedback slots, one per wrapped reward function (cleared before each batch)."""

    def __init__(self) -> None:
        self.slots: dict[int, list[str | None]] = {}

    def clear(self) -> None:
        self.slots.clear()


def split_scores(outputs: Sequence[Any], name: str) -> tuple[list[Any], list[str | None] | None]:
    """Split a reward function's output into scores and feedback (None if it gave no pairs)."""
    scores: list[Any] = []
    feedback: list[str | None] = []
    any_pair = False
    for item in outputs:
        if isinstance(item, tuple | list):
            if len(item) != 2:
                raise ValueError(
                    f"reward function {name!r} returned {item!r:.80}; each entry must be a score "
                    "(float or None) or a (score, feedback) pair"
                )
            score, fb = item
            if fb is not None and not isinstance(fb, str):
                raise ValueError(
                    f"reward function {name!r}: feedback must be a str or None, got {type(fb).__name__}"
                )
            any_pair = True
            scores.append(score)
            feedback.append(fb)
        else:
            scores.append(item)
            feedback.append(None)
    return scores, (feedback if any_pair else None)


def wrap_reward_func(func: Callable[..., Any], index: int, recorder: FeedbackRecorder) -> Any:
    """A TRL-compatible wrapper of ``func`` that records its feedback into ``recorder.slots[index]``."""
    name = getattr(func, "__name__", type(func).__name__)

    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
        getattr(func, "__call__", None)  # noqa: B004 - async callable objects
    ):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> list[Any]:
            scores, fb = split_scores(await func(*args, **kwargs), name)
            if fb is not None:
                recorder.slots[index] = fb
            return scores

        return async_wrapper

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> list[Any]:
        scores, fb = split_scores(func(*args, **kwargs), name)
        if fb is not None:
            recorder.slots[index] = fb
        return scores

    return wrapper


def merge_feedback(sources: Sequence[Sequence[str | None]], n: int) -> list[str | None]:
    """Join the non-empty feedback strings of each completion across sources (None if none)."""
    merged: list[str | None] = []
    for i in range(n):
        texts = (src[i] for src in sources)
        parts = [text.strip() for text in texts if text is not None and text.strip()]
        merged.append("\n\n".join(parts) if parts else None)
    return merged


def call_feedback_funcs(
    funcs: Sequence[Callable[..., Any]],
    prompts: list[Any],
    completions: list[Any],
    extra: dict[str, Any],
) -> list[list[str | None]]:
    """Run ``feedback_funcs``; each must return one ``str | None`` per completion."""
    out = []
    for g in funcs:
        values = list(g(prompts=prompts, completions=completions, **extra))
        gname = getattr(g, "__name__", type(g).__name__)
        if len(values) != len(prompts):
            raise ValueError(
                f"feedback function {gname!r} returned {len(values)} values for {len(prompts)} completions"
            )
        for v in values:
            if v is not None and not isinstance(v, str):
                raise ValueError(
                    f"feedback function {gname!r} must return str or None, got {v!r:.60}"
                )
        out.append(values)
    return out
