"""`task.hint_share`: training prompts also shown with channel 2's hint in context, so the policy
learns to read the hint its teacher is given; never a held-out prompt, same answers."""

from __future__ import annotations

import math

import pytest

from composer_replication.config import ConfigError, load_config
from composer_replication.data.hints import HintTemplate
from composer_replication.data.traces import prompt_key
from composer_replication.tasks import get_task
from composer_replication.tasks.task import chat_prompt


def _task():
    return get_task("arithmetic", seed=0, n_train=40, n_eval=16, num_operands=3)


def test_hinted_examples_are_training_prompts_with_the_hint_and_the_same_answer() -> None:
    task = _task()
    distinct = list({ex.prompt: ex for ex in task.train_examples()}.values())
    hinted = task.hinted_examples(0.25)
    assert len(hinted) == math.ceil(0.25 * len(distinct))
    held_out = {ex.prompt for ex in task.eval_examples()}
    template = HintTemplate()
    for i, (h, ex) in enumerate(zip(hinted, distinct, strict=False)):
        assert h.answer == ex.answer and h.id == f"{ex.id}/hinted"
        assert h.prompt.startswith(ex.prompt) and ex.prompt not in held_out
        assert f"Correct solution:\n\n{task.oracle(ex)}" in h.prompt
        feedback = "feedback from your unsuccessful earlier attempt" in h.prompt
        assert feedback == bool(i % 2)  # every other one carries a wrong attempt's feedback
        assert h.prompt.endswith(template.render_text("", None, None))
        assert task.verify(h, task.oracle(ex)).correct
    assert task.hinted_examples(0.0) == []


def test_datasets_and_oracle_traces_carry_the_hinted_rows() -> None:
    pytest.importorskip("datasets")
    task = _task()
    hinted = task.hinted_examples(0.5)
    plain = task.to_dataset("train")
    data = task.to_dataset("train", hint_share=0.5)
    assert len(data) == len(plain) + len(hinted)
    rows = [data[i] for i in range(len(plain), len(data))]
    assert [r["prompt"] for r in rows] == [chat_prompt(h.prompt) for h in hinted]
    reward = task.reward_func()
    scores = reward(
        prompts=[r["prompt"] for r in rows],
        completions=[r["answer"] for r in rows],
        example_id=[r["example_id"] for r in rows],
        answer=[r["answer"] for r in rows],
        task_meta=[r["task_meta"] for r in rows],
    )
    assert all(score == 1.0 for score, _ in scores)
    keys = {t["prompt_key"] for t in task.oracle_traces("train", hint_share=0.5)}
    assert {prompt_key(chat_prompt(h.prompt)) for h in hinted} <= keys
    with pytest.raises(ValueError, match="train split only"):
        task.to_dataset("eval", hint_share=0.5)
    with pytest.raises(ValueError, match=r"hint_share must be in \[0, 1\]"):
        task.hinted_examples(1.5)


def test_the_config_key_is_checked() -> None:
    assert load_config(overrides=["task.hint_share=0.5"]).task.hint_share == 0.5
    with pytest.raises(ConfigError, match="task.hint_share"):
        load_config(overrides=["task.hint_share=1.5"])
