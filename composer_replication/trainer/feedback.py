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
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

# What a reward function returns: per completion a score (float or None) or a (score, feedback)
# pair; an async one returns it through an awaitable.
Score = float | None
RewardOutput = Score | tuple[Score, str | None]
RewardOutputs = Iterable[RewardOutput]
RewardFunc = Callable[..., RewardOutputs | Awaitable[RewardOutputs]]


class FeedbackRecorder:
    """Per-batch feedback slots, one per wrapped reward function (cleared before each batch)."""

    def __init__(self) -> None:
        self.slots: dict[int, list[str | None]] = {}

    def clear(self) -> None:
        self.slots.clear()


def split_scores(outputs: RewardOutputs, name: str) -> tuple[list[Score], list[str | None] | None]:
    """Split a reward function's output into scores and feedback (None if it gave no pairs);
    what the function returned is checked here (it is the user's code)."""
    scores: list[Score] = []
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


def wrap_reward_func(
    func: RewardFunc, index: int, recorder: FeedbackRecorder
) -> Callable[..., list[Score] | Awaitable[list[Score]]]:
    """A TRL-compatible wrapper of ``func`` that records its feedback into ``recorder.slots[index]``."""
    name = getattr(func, "__name__", type(func).__name__)

    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
        getattr(func, "__call__", None)  # noqa: B004 - async callable objects
    ):

        @functools.wraps(func)
        async def async_wrapper(*args: object, **kwargs: object) -> list[Score]:
            result = func(*args, **kwargs)
            outputs = await result if inspect.isawaitable(result) else result
            scores, fb = split_scores(outputs, name)
            if fb is not None:
                recorder.slots[index] = fb
            return scores

        return async_wrapper

    @functools.wraps(func)
    def wrapper(*args: object, **kwargs: object) -> list[Score]:
        outputs = func(*args, **kwargs)
        if inspect.isawaitable(outputs):
            raise TypeError(
                f"reward function {name!r} returned an awaitable but is not an async function; "
                "define it with `async def` (or give it an async __call__)"
            )
        scores, fb = split_scores(outputs, name)
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
    funcs: Sequence[Callable[..., Iterable[str | None]]],
    prompts: Sequence[object],
    completions: Sequence[object],
    extra: Mapping[str, object],
) -> list[list[str | None]]:
    """Run ``feedback_funcs``; each must return one ``str | None`` per completion."""
    out = []
    for g in funcs:
        raw = list(g(prompts=prompts, completions=completions, **extra))
        gname = getattr(g, "__name__", type(g).__name__)
        if len(raw) != len(prompts):
            raise ValueError(
                f"feedback function {gname!r} returned {len(raw)} values for {len(prompts)} completions"
            )
        values: list[str | None] = []
        for v in raw:
            if v is not None and not isinstance(v, str):
                raise ValueError(
                    f"feedback function {gname!r} must return str or None, got {v!r:.60}"
                )
            values.append(v)
        out.append(values)
    return out
