"""The teacher seam: a `TeacherClient` turns prompts into completions.

Three implementations ship: `OpenAICompatibleTeacher` (any chat-completions HTTP endpoint),
`HFModelTeacher` (a local Hugging Face model) and `OracleTeacher` (a function returning a reference
solution, e.g. a task's oracle). `TeacherPool` fans prompts out to several teachers and records the
results as trace records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from composer_replication.data.traces import Prompt
from composer_replication.json_types import JSONDict


class TeacherError(RuntimeError):
    """A teacher could not produce a completion (after its retries). Never contains secrets."""


@dataclass(frozen=True)
class TeacherCompletion:
    """One teacher answer. ``text`` may be empty (the pool skips and counts those)."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    cached: bool = False
    metadata: JSONDict = field(default_factory=dict)


@runtime_checkable
class TeacherClient(Protocol):
    """Anything with a ``name`` and a batched ``complete``.

    ``complete`` returns one `TeacherCompletion` per prompt, in order, or raises `TeacherError`
    when the batch cannot be answered. Implementations decide their own concurrency.
    """

    name: str

    def complete(self, prompts: Sequence[Prompt]) -> list[TeacherCompletion]: ...


def as_messages(prompt: Prompt) -> list[JSONDict]:
    """A prompt as chat messages (a plain string is one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]
