"""Pure pieces of the trainer: hint/pair planning, the feedback contract, EMA, settings."""

from __future__ import annotations

import asyncio
import math
import types

import pytest
import torch
from tolerances import assert_close

from composer_replication.data import HintTemplate, TraceRecord, TraceStore, prompt_key
from composer_replication.trainer import ComposerConfig, ComposerSettings
from composer_replication.trainer.batch import HintPlan, pair_tensors, plan_hints, plan_pairs
from composer_replication.trainer.ema import EMATeacher, frozen_copy
from composer_replication.trainer.feedback import (
    FeedbackRecorder,
    merge_feedback,
    split_scores,
    wrap_reward_func,
)

NAN = math.nan


def test_plan_hints_selection_rules():
    prompts = ["p0"] * 4 + ["p1"] * 4
    completions = [f"c{i}" for i in range(8)]
    rewards = [0.6, 0.0, 0.9, NAN, 0.1, 0.2, 0.0, 0.3]
    feedback = [None, None, None, "fb3", None, "fb5", "  ", None]
    plan = plan_hints(
        prompts[4:],
        completions,
        rewards,
        feedback[4:],
        num_generations=4,
        process_start=4,  # second process: rows are global samples 4..7
        template=HintTemplate(reprompt="{prompt}|{solution}|{feedback}"),
        success_threshold=0.5,
    )
    # Group 1 has no successful rollout: only the rollout with (non-blank) feedback enters.
    assert plan.sample_mask == [False, True, False, False]
    assert plan.teacher_prompts[1].startswith("p1||") and "fb5" in plan.teacher_prompts[1]
    plan0 = plan_hints(
        prompts[:4],
        completions,
        rewards,
        feedback[:4],
        num_generations=4,
        process_start=0,
        template=HintTemplate(),
        success_threshold=0.5,
    )
    # Successful rollouts (0, 2) never enter; NaN (3) never enters; rollout 1 gets the best
    # successful sibling (c2, reward 0.9), not c0.
    assert plan0.sample_mask == [False, True, False, False]
    assert "Correct solution:\n\nc2" in plan0.teacher_prompts[1]
    assert plan0.failed == 1 and plan0.with_sibling == 1
    # feedback beside a solution only when the template says so (SDPO's reference runs: the
    # feedback only where no sibling succeeded)
    both = ["fb0", "fb1", None, None, "fb4", "fb5", None, None]

    def plan_all(template: HintTemplate) -> HintPlan:
        """Both groups on one process, with feedback on rollouts 0, 1, 4 and 5."""
        return plan_hints(
            prompts,
            completions,
            rewards,
            both,
            num_generations=4,
            process_start=0,
            template=template,
            success_threshold=0.5,
        )

    for with_solution in (True, False):
        plan = plan_all(HintTemplate(feedback_with_solution=with_solution))
        assert plan.sample_mask == [False, True, False, False, True, True, False, False]
        assert "Correct solution:\n\nc2" in plan.teacher_prompts[1]
        assert ("fb1" in plan.teacher_prompts[1]) == with_solution
        assert (
            "fb4" in plan.teacher_prompts[4] and "Correct solution" not in plan.teacher_prompts[4]
        )
        assert plan.with_feedback == (3 if with_solution else 2)
    with pytest.raises(ValueError, match="feedback_with_solution"):
        HintTemplate(feedback_with_solution="no")  # type: ignore[arg-type]
    # feedback_alone=False: a failed rollout without a successful sibling gets no hint at all
    # (4, 5: group 1 has no success), one with a successful sibling still gets the solution.
    plan = plan_all(HintTemplate(feedback_with_solution=False, feedback_alone=False))
    assert plan.sample_mask == [False, True, False, False, False, False, False, False]
    assert "Correct solution:\n\nc2" in plan.teacher_prompts[1]
    assert plan.teacher_prompts[4:6] == prompts[4:6] and plan.with_feedback == 0
    with pytest.raises(ValueError, match="feedback_alone"):
        HintTemplate(feedback_alone=1)  # type: ignore[arg-type]


def test_plan_pairs_and_tensors():
    key = prompt_key("q0")
    store = TraceStore([TraceRecord(key, "t", "gold", 1.0)])
    prompts = ["q0"] * 3 + ["q1"] * 3
    rewards = [0.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    pairs, covered = plan_pairs(
        prompts, rewards, [4, 0, 3, 4, 4, 4], store, num_generations=3, process_start=0
    )
    # Rollout 1 has the lowest reward but an empty completion; rollout 2 is the rejected one.
    assert covered == 1 and [(p.row, p.trace.completion) for p in pairs] == [(2, "gold")]
    none, _ = plan_pairs(prompts, [1.0] * 6, [4] * 6, store, num_generations=3, process_start=0)
    assert none == []  # the policy already matches the trace's reward
    kept, _ = plan_pairs(
        prompts,
        [1.0] * 6,
        [4] * 6,
        store,
        num_generations=3,
        process_start=0,
        skip_if_not_worse=False,
    )
    assert [p.row for p in kept] == [0]
    # a trace the verifier rejects (or never scored) is no target under a minimum reward
    wrong = TraceStore(
        [
            TraceRecord(key, "t", "near miss", 0.35),
            TraceRecord(prompt_key("q1"), "t", "unscored", None),
        ]
    )
    for minimum, expected in ((None, [2, 3]), (0.3, [2]), (0.5, [])):
        got, covered = plan_pairs(
            prompts,
            rewards,
            [4, 0, 3, 4, 4, 4],
            wrong,
            num_generations=3,
            process_start=0,
            skip_if_not_worse=False,
            min_trace_reward=minimum,
        )
        assert [p.row for p in got] == expected and covered == len(expected)
    t = pair_tensors(
        pairs,
        6,
        lambda s: [ord(c) for c in s],
        pad_id=0,
        eos_id=9,
        max_length=3,
        device=torch.device("cpu"),
    )
    assert t["replay_pair_mask"].tolist() == [False, False, True, False, False, False]
    assert t["replay_chosen_ids"][2].tolist() == [ord("g"), ord("o"), ord("l")]
    assert t["replay_chosen_mask"].sum() == 3


def test_feedback_contract():
    assert split_scores([1.0, None, 0.5], "f") == ([1.0, None, 0.5], None)
    assert split_scores([(1.0, None), 0.0, (0.0, "bad")], "f") == (
        [1.0, 0.0, 0.0],
        [None, None, "bad"],
    )
    with pytest.raises(ValueError, match="score"):
        split_scores([(1.0, "a", "b")], "f")
    with pytest.raises(ValueError, match="feedback must be a str"):
        split_scores([(1.0, 3)], "f")
    assert merge_feedback([["a", None, " "], ["b", None, "c"]], 3) == ["a\n\nb", None, "c"]

    recorder = FeedbackRecorder()

    def sync_reward(completions, **kw):
        return [(1.0, None), (0.0, "nope")]

    async def async_reward(completions, **kw):
        return [(0.5, "meh"), 1.0]

    wrapped = wrap_reward_func(sync_reward, 0, recorder)
    assert wrapped.__name__ == "sync_reward" and wrapped(completions=["a", "b"]) == [1.0, 0.0]
    awrapped = wrap_reward_func(async_reward, 1, recorder)
    assert asyncio.iscoroutinefunction(awrapped)
    assert asyncio.run(awrapped(completions=["a", "b"])) == [0.5, 1.0]
    assert recorder.slots == {0: [None, "nope"], 1: ["meh", None]}


def test_ema_teacher_and_frozen_copy():
    student = torch.nn.Linear(3, 2)
    ema = EMATeacher(student, rate=0.25)
    before = ema.model.weight.detach().clone()
    with torch.no_grad():
        student.weight.add_(1.0)
    ema.update(student)
    # two products and a sum, grouped as the EMA's lerp or as written here: n = 3 roundings
    assert_close(ema.model.weight, 0.75 * before + 0.25 * student.weight, n=3)
    assert not ema.model.weight.requires_grad
    # A patched instance-level forward (as TRL's fused head) is not carried into the copy.
    model = torch.nn.Linear(2, 2)
    model.forward = types.MethodType(lambda self, x: torch.zeros(1), model)
    clone = frozen_copy(model)
    assert clone(torch.ones(1, 2)).shape == (1, 2)
    with pytest.raises(ValueError, match="sdpo_ema_rate"):
        EMATeacher(student, rate=0.0)


def test_settings_resolution_and_validation(tmp_path):
    args = ComposerConfig(output_dir=str(tmp_path), alpha_sdpo=0.3, dpo_variant="simpo")
    # the device decides: False on CPU; TRL's GPU defaults (True) with CUDA
    cuda = torch.cuda.is_available()
    assert args.bf16 is cuda and args.gradient_checkpointing is cuda
    s = ComposerSettings.resolve(args, {"alpha_sdpo": 0.7})
    assert s.alpha_sdpo == 0.7 and s.dpo_variant == "simpo" and s.beta_replay == 0.05
    assert isinstance(s.hint_template, HintTemplate)
    assert ComposerSettings.resolve(object(), {"sdpo_wrapper": "taid"}).taid_scheduled
    with pytest.raises(ValueError, match="unknown ComposerReplicationTrainer keyword"):
        ComposerSettings.resolve(args, {"alpha_sdp": 1.0})
    with pytest.raises(ValueError, match="sdpo_teacher"):
        ComposerSettings.resolve(args, {"sdpo_teacher": "oracle"})
    with pytest.raises(ValueError, match="dpo_variant"):
        ComposerSettings.resolve(args, {"dpo_variant": "ipo"})
    with pytest.raises(ValueError, match="hint_template"):
        ComposerSettings.resolve(args, {"hint_template": 3})


def test_config_parses_from_command_line(tmp_path):
    from transformers import HfArgumentParser

    (cfg,) = HfArgumentParser(ComposerConfig).parse_args_into_dataclasses(
        args=[
            "--output_dir",
            str(tmp_path),
            "--alpha_sdpo",
            "0.2",
            "--sdpo_teacher",
            "ema",
            "--trace_files",
            "a.jsonl",
            "b.jsonl",
        ]
    )
    assert cfg.alpha_sdpo == 0.2 and cfg.sdpo_teacher == "ema"
    assert cfg.trace_files == ["a.jsonl", "b.jsonl"]
    assert cfg.gradient_checkpointing is torch.cuda.is_available()  # False on CPU, True on CUDA


def test_config_defaults_are_the_settings_defaults(tmp_path):
    """ComposerConfig (TRL argument parsing) and ComposerSettings (trainer keywords) agree on
    every composer field's default; the loss keywords' are loss.ComposeConfig's."""
    import dataclasses

    from composer_replication.loss import ComposeConfig

    config_defaults = ComposerConfig(output_dir=str(tmp_path))
    settings = ComposerSettings()
    loss = ComposeConfig()
    for f in dataclasses.fields(ComposerSettings):
        if f.name == "hint_template":  # a HintTemplate here, its text (None = SDPO's) there
            assert config_defaults.hint_template is None
            continue
        assert getattr(config_defaults, f.name) == getattr(settings, f.name), f.name
        if hasattr(loss, f.name):
            assert getattr(settings, f.name) == getattr(loss, f.name), f.name
