"""`OracleTeacher`: a function that knows the reference solution (e.g. a task's oracle)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from composer_replication.data.teachers.base import Prompt, TeacherCompletion, TeacherError


class OracleTeacher:
    """Wraps ``solve(prompt) -> str | None``; None (no reference known) becomes an empty completion.

    Costs nothing and needs no network, which makes it the default channel-3 teacher for built-in
    tasks and for tests.
    """

    def __init__(self, solve: Callable[[Prompt], str | None], name: str = "oracle") -> None:
        if not callable(solve):
            raise ValueError("OracleTeacher needs a callable solve(prompt) -> str | None")
        if not name:
            raise ValueError("OracleTeacher name must be non-empty")
        self.name = name
        self._solve = solve

    def complete(self, prompts: Sequence[Prompt]) -> list[TeacherCompletion]:
        out = []
        for prompt in prompts:
            try:
                text = self._solve(prompt)
            except Exception as exc:  # the oracle is user code; report which teacher failed
                raise TeacherError(f"oracle teacher {self.name!r} failed: {exc}") from exc
            out.append(TeacherCompletion(text=text or ""))
        return out
