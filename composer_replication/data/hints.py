"""Hint templates: the teacher context of channel 2 (SDPO hint self-distillation).

A failed rollout is re-scored by a teacher that sees the original question plus privileged
information: a successful sibling completion from the same group and/or the environment's feedback
on this attempt. The default wording follows the SDPO reference implementation (Hübotter et al.,
arXiv 2601.20802, as shipped in TRL's experimental SDPO trainer)::

    {prompt}{solution}{feedback}\\n\\nCorrectly solve the original question.\\n

with ``solution`` = ``"\\nCorrect solution:\\n\\n{solution}\\n\\n"`` and ``feedback`` =
``"\\nThe following is feedback from your unsuccessful earlier attempt:\\n\\n{feedback}\\n\\n"``;
an absent part renders as the empty string. With ``feedback_with_solution=False`` (the SDPO
reference runs' ``environment_feedback_only_without_solution=True``; TRL's default is False) a
rollout whose sibling succeeded is shown the solution alone, and the feedback only when there is
no solution.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, fields

from composer_replication.json_types import JSONDict

# The dataset column (`Task.to_dataset`) that marks a row as a hinted example (`task.hint_share`:
# a training prompt shown with its hint in context), read by the trainer's `hint_grpo`.
HINTED_EXAMPLE_COLUMN = "hinted_example"

DEFAULT_REPROMPT = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
DEFAULT_SOLUTION = "\nCorrect solution:\n\n{solution}\n\n"
DEFAULT_FEEDBACK = (
    "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback}\n\n"
)


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


@dataclass(frozen=True)
class HintTemplate:
    """How the hinted teacher prompt is written.

    ``reprompt`` must contain ``{prompt}`` and may also use ``{solution}`` and ``{feedback}``;
    ``solution`` must use ``{solution}`` and ``feedback`` must use ``{feedback}``.
    Literal braces are written ``{{`` and ``}}`` (``str.format`` rules).
    ``feedback_with_solution=False`` writes the feedback only where there is no solution.
    ``feedback_alone=False`` gives no hint where there is no solution: channel 2 then distils
    only failed rollouts with a successful sibling, and the hinted examples show the solution.
    """

    reprompt: str = DEFAULT_REPROMPT
    solution: str = DEFAULT_SOLUTION
    feedback: str = DEFAULT_FEEDBACK
    feedback_with_solution: bool = True
    feedback_alone: bool = True

    def __post_init__(self) -> None:
        for key in ("feedback_with_solution", "feedback_alone"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(
                    f"hint template {key!r} must be true or false, got {getattr(self, key)!r}"
                )
        allowed = {"prompt", "solution", "feedback"}
        bad = _fields(self.reprompt) - allowed
        if bad or "prompt" not in _fields(self.reprompt):
            raise ValueError(
                "hint template 'reprompt' must contain {prompt} and may use only {prompt}, "
                f"{{solution}}, {{feedback}}; got fields {sorted(_fields(self.reprompt))}"
            )
        if _fields(self.solution) != {"solution"}:
            raise ValueError("hint template 'solution' must use exactly the field {solution}")
        if _fields(self.feedback) != {"feedback"}:
            raise ValueError("hint template 'feedback' must use exactly the field {feedback}")

    def render_text(self, prompt: str, solution: str | None, feedback: str | None) -> str:
        """The hinted user text for one failed rollout."""
        sol = self.solution.format(solution=solution) if solution else ""
        if solution and not self.feedback_with_solution:
            feedback = None
        fb = self.feedback.format(feedback=feedback) if feedback else ""
        return self.reprompt.format(prompt=prompt, solution=sol, feedback=fb)

    def render(
        self, prompt: str | list[JSONDict], solution: str | None, feedback: str | None
    ) -> str | list[JSONDict]:
        """The hinted teacher prompt in the prompt's own form.

        A chat prompt keeps its earlier messages (system prompt, previous turns); the last user
        message's text is replaced by the hinted text. A plain string prompt becomes the hinted
        string.
        """
        if isinstance(prompt, str):
            return self.render_text(prompt, solution, feedback)
        if not prompt:
            raise ValueError("cannot build a hinted prompt from an empty chat prompt")
        last_user = max(
            (i for i, m in enumerate(prompt) if m.get("role") == "user"), default=len(prompt) - 1
        )
        content = prompt[last_user].get("content", "")
        if isinstance(content, list):  # typed parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        hinted = {
            **prompt[last_user],
            "content": self.render_text(str(content), solution, feedback),
        }
        return [*prompt[:last_user], hinted, *prompt[last_user + 1 :]]


def coerce_hint_template(
    value: HintTemplate | str | dict[str, str | bool] | None,
) -> HintTemplate:
    """Accept a `HintTemplate`, a reprompt string, a dict of its fields, or None (default)."""
    if value is None:
        return HintTemplate()
    if isinstance(value, HintTemplate):
        return value
    if isinstance(value, str):
        return HintTemplate(reprompt=value)
    if isinstance(value, dict):
        known = tuple(f.name for f in fields(HintTemplate))
        unknown = set(value) - set(known)
        if unknown:
            raise ValueError(
                f"hint_template dict has unknown keys {sorted(unknown)}; use "
                + ", ".join(repr(k) for k in known)
            )
        return HintTemplate(**value)  # type: ignore[arg-type]
    raise ValueError(
        f"hint_template must be a HintTemplate, str, dict or None, got {type(value).__name__}"
    )
