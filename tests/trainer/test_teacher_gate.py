"""Channel 2's teacher-advantage gate: the hinted teacher is sampled and scored on the batch's
hinted prompts, its advantage over the student logged, and a batch whose teacher is not better
distils nothing (`ComposerSettings.sdpo_gate`, `sdpo_teacher_probe`)."""

from __future__ import annotations

import math

import pytest
from _trainer_helpers import G, generation_batch, make_trainer, text_of

from composer_replication.trainer.batch import select_probe_rows


def _prompt_text(prompt) -> str:
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


def _reward(teacher_score: float):
    """Rollouts: the first of each group succeeds, the others fail with feedback (group mean
    1/G). A hinted prompt (the teacher's context, "Correct solution" in it) scores
    `teacher_score` whatever is completed."""

    def reward(prompts, completions, **kwargs):
        out = []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            if "Correct solution" in _prompt_text(p) or "feedback" in _prompt_text(p):
                out.append((teacher_score, None if teacher_score >= 0.5 else "still wrong"))
            elif i % G == 0:
                out.append((1.0, None))
            else:
                out.append((0.0, f"wrong: you wrote {text_of(c)[:3]!r}"))
        return out

    return reward


def _metric(trainer, key: str) -> list[float]:
    return list(trainer._metrics["train"][key])


def test_a_better_teacher_keeps_channel_2_open(tmp_path):
    trainer = make_trainer(tmp_path, reward=_reward(1.0), alpha_sdpo=1.0, beta_replay=0)
    inputs = generation_batch(trainer)
    assert inputs["sdpo_sample_mask"].sum() == 2 * (G - 1)  # every failed rollout is hinted
    (advantage,) = _metric(trainer, "sdpo/teacher_advantage")
    assert advantage == pytest.approx(1.0 - 1.0 / G)
    assert _metric(trainer, "sdpo/teacher_reward") == [1.0]
    assert _metric(trainer, "sdpo/student_reward") == [pytest.approx(1.0 / G)]
    assert _metric(trainer, "sdpo/gate_open") == [1.0]


def test_a_teacher_no_better_than_its_student_closes_channel_2(tmp_path):
    trainer = make_trainer(tmp_path, reward=_reward(0.0), alpha_sdpo=1.0, beta_replay=0)
    inputs = generation_batch(trainer)
    assert _metric(trainer, "sdpo/teacher_advantage") == [pytest.approx(-1.0 / G)]
    assert _metric(trainer, "sdpo/gate_open") == [0.0]
    assert inputs["sdpo_sample_mask"].sum() == 0 and float(inputs["sdpo_num_tokens"]) == 0.0
    loss = trainer.compute_loss(trainer.model, inputs)  # channel 2 inactive, no error
    assert math.isfinite(float(loss.detach()))
    assert _metric(trainer, "sdpo/active")[-1] == 0.0


def test_the_gate_can_be_turned_off_and_the_probe_skipped(tmp_path):
    trainer = make_trainer(
        tmp_path, reward=_reward(0.0), alpha_sdpo=1.0, beta_replay=0, sdpo_gate=False
    )
    inputs = generation_batch(trainer)
    assert _metric(trainer, "sdpo/teacher_advantage") == [pytest.approx(-1.0 / G)]
    assert inputs["sdpo_sample_mask"].sum() == 2 * (G - 1)  # measured, not acted on
    trainer = make_trainer(
        tmp_path, reward=_reward(0.0), alpha_sdpo=1.0, beta_replay=0, sdpo_teacher_probe=0
    )
    inputs = generation_batch(trainer)
    assert _metric(trainer, "sdpo/teacher_advantage") == []
    assert _metric(trainer, "sdpo/gate_open") == [1.0]
    assert inputs["sdpo_sample_mask"].sum() == 2 * (G - 1)


def test_probe_rows_take_one_row_per_group_first() -> None:
    mask = [False, True, True, True, False, False, True, True]
    assert select_probe_rows(mask, 0, 4, 2) == [1, 6]
    assert select_probe_rows(mask, 0, 4, 3) == [1, 2, 6]
    assert select_probe_rows(mask, 0, 4, 0) == []
    assert select_probe_rows(mask, 4, 4, 8) == [1, 2, 3, 6, 7]


def test_probe_setting_is_checked(tmp_path):
    with pytest.raises(ValueError, match="sdpo_teacher_probe must be an int >= 0"):
        make_trainer(tmp_path, alpha_sdpo=1.0, sdpo_teacher_probe=-1)
