"""Channel 2's teacher-advantage gate: the hinted teacher is sampled and scored on the batch's
hinted prompts, its advantage over the student logged, and channel 2 distils nothing while the
teacher is not better over the last probed rows (`ComposerSettings.sdpo_gate`,
`sdpo_teacher_probe`, `sdpo_gate_window`; `trainer.gate.TeacherGate`)."""

from __future__ import annotations

import math

import pytest
from _trainer_helpers import G, generation_batch, make_trainer, text_of

from composer_replication.trainer.batch import select_probe_rows
from composer_replication.trainer.gate import TeacherGate


def _prompt_text(prompt) -> str:
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


def _reward(teacher_score: float | list[float]):
    """Rollouts: the first of each group succeeds, the others fail with feedback (group mean
    1/G). A hinted prompt (the teacher's context, "Correct solution" in it) scores
    `teacher_score` whatever is completed (a one-element list: changed between batches)."""
    score = teacher_score if isinstance(teacher_score, list) else [teacher_score]

    def reward(prompts, completions, **kwargs):
        out = []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            if "Correct solution" in _prompt_text(p) or "feedback" in _prompt_text(p):
                out.append((score[0], None if score[0] >= 0.5 else "still wrong"))
            elif i % G == 0:
                out.append((1.0, None))
            else:
                out.append((0.0, f"wrong: you wrote {text_of(c)[:3]!r}"))
        return out

    return reward


def _metric(trainer, key: str) -> list[float]:
    return list(trainer._metrics["train"][key])


def test_a_better_teacher_keeps_channel_2_open(tmp_path):
    trainer = make_trainer(
        tmp_path, reward=_reward(1.0), alpha_sdpo=1.0, beta_replay=0, sdpo_gate=True
    )
    inputs = generation_batch(trainer)
    assert inputs["sdpo_sample_mask"].sum() == 2 * (G - 1)  # every failed rollout is hinted
    (advantage,) = _metric(trainer, "sdpo/teacher_advantage")
    assert advantage == pytest.approx(1.0 - 1.0 / G)
    assert _metric(trainer, "sdpo/teacher_reward") == [1.0]
    assert _metric(trainer, "sdpo/student_reward") == [pytest.approx(1.0 / G)]
    assert _metric(trainer, "sdpo/gate_open") == [1.0]


def test_a_teacher_no_better_than_its_student_closes_channel_2(tmp_path):
    trainer = make_trainer(
        tmp_path, reward=_reward(0.0), alpha_sdpo=1.0, beta_replay=0, sdpo_gate=True
    )
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
        tmp_path,
        reward=_reward(0.0),
        alpha_sdpo=1.0,
        beta_replay=0,
        sdpo_teacher_probe=0,
        sdpo_gate=True,  # on, but with nothing measured it stays open
    )
    inputs = generation_batch(trainer)
    assert _metric(trainer, "sdpo/teacher_advantage") == []
    assert _metric(trainer, "sdpo/gate_open") == [1.0]
    assert inputs["sdpo_sample_mask"].sum() == 2 * (G - 1)


def test_the_gate_decides_on_a_window_of_probed_rows(tmp_path):
    """Two batches with a better teacher, then one with a worse one (each batch probes its
    2 (G - 1) hinted rows): over the default window the history keeps the gate open (paired
    differences 1 - 1/G twice as often as -1/G: mean 0.417 against a standard error of 0.114 at
    G = 4); over a window of the last 2 rows only the bad batch counts."""
    for window, last_open in ((64, 1.0), (2, 0.0)):
        score = [1.0]
        trainer = make_trainer(
            tmp_path,
            reward=_reward(score),
            alpha_sdpo=1.0,
            beta_replay=0,
            sdpo_gate=True,
            sdpo_gate_window=window,
        )
        generation_batch(trainer)
        generation_batch(trainer)
        score[0] = 0.0
        inputs = generation_batch(trainer)
        assert _metric(trainer, "sdpo/gate_open") == [1.0, 1.0, last_open]
        assert _metric(trainer, "sdpo/teacher_advantage")[-1] == pytest.approx(-1.0 / G)
        rows = 2 * (G - 1)
        better, worse = [1.0 - 1.0 / G] * (2 * rows), [-1.0 / G] * rows
        expected = better + worse if window == 64 else worse[-window:]
        assert trainer._gate.state() == pytest.approx(expected)
        assert _metric(trainer, "sdpo/gate_advantage")[-1] == pytest.approx(
            sum(expected) / len(expected)
        )
        assert bool(inputs["sdpo_sample_mask"].sum()) == bool(last_open)


def test_teacher_gate_is_open_only_when_ahead_by_more_than_its_standard_error() -> None:
    gate = TeacherGate(3)
    assert not gate.is_open() and math.isnan(gate.mean)  # nothing measured: closed
    gate.add([0.5])
    assert gate.is_open() and gate.standard_error == 0.0  # one positive difference
    gate.add([-0.1, float("nan"), 0.3])  # NaN (unscored) left out
    # mean 0.2333, sample sd 0.3055, standard error 0.1764: open
    assert gate.state() == [0.5, -0.1, 0.3]
    assert gate.mean == pytest.approx(0.7 / 3)
    assert gate.standard_error == pytest.approx(math.sqrt(0.28 / 3 / 3))
    assert gate.is_open()
    gate.add([-0.2])  # the oldest leaves: [-0.1, 0.3, -0.2], mean 0
    assert gate.state() == [-0.1, 0.3, -0.2] and not gate.is_open()
    # a small advantage inside its noise keeps it closed: mean 0.067, standard error 0.145
    gate.load_state([0.3, -0.2, 0.1])
    assert gate.mean == pytest.approx(0.2 / 3) and not gate.is_open()
    assert gate.standard_error == pytest.approx(0.1453, abs=1e-4)
    with pytest.raises(ValueError, match="not a finite float"):
        gate.load_state([0.1, float("inf")])
    with pytest.raises(ValueError, match="sdpo_gate_window must be an int >= 1"):
        TeacherGate(0)


def test_probe_rows_take_one_row_per_group_first() -> None:
    mask = [False, True, True, True, False, False, True, True]
    assert select_probe_rows(mask, 0, 4, 2) == [1, 6]
    assert select_probe_rows(mask, 0, 4, 3) == [1, 2, 6]
    assert select_probe_rows(mask, 0, 4, 0) == []
    assert select_probe_rows(mask, 4, 4, 8) == [1, 2, 3, 6, 7]


def test_probe_setting_is_checked(tmp_path):
    with pytest.raises(ValueError, match="sdpo_teacher_probe must be an int >= 0"):
        make_trainer(tmp_path, alpha_sdpo=1.0, sdpo_teacher_probe=-1)
    with pytest.raises(ValueError, match="sdpo_gate_window must be an int >= 1"):
        make_trainer(tmp_path, alpha_sdpo=1.0, sdpo_gate_window=0)
