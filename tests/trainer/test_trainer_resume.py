"""Exact resume of the trainer: 6 steps in one go == 3 steps, resume state through the wire
format (safetensors + JSON skeleton), a fresh trainer, 3 more steps; bit-exact on CPU.

All the state that decides the future is exercised: AdamW moments, a linear LR schedule, the
data position across epochs (2 prompts, one per step: every other step starts an epoch), the
RNG streams (sampling), channel 2's EMA teacher and TAID schedule, channel 3's lazily fetched
traces and DPO reference cache.
"""

from __future__ import annotations

import pytest
import torch
from _trainer_helpers import G, config, dataset, make_trainer, positional_reward
from transformers import TrainerCallback

from composer_replication.exchange.outer_state import decode_state, encode_state
from composer_replication.trainer.resume import ResumeStateError

STEPS, SPLIT = 6, 3

pytestmark = pytest.mark.slow


class _Capture(TrainerCallback):
    """Takes the resume state at step `at` and stops there (what a killed run leaves)."""

    def __init__(self, trainer, at: int | None) -> None:
        self.trainer, self.at, self.state = trainer, at, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            tensors, skeleton = encode_state(self.trainer.resume_state())
            # the wire: tensors copied out, the skeleton through JSON
            import json

            self.state = decode_state(
                {k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(skeleton))
            )
            control.should_training_stop = True


def _trainer(tmp_path, name: str):
    from composer_replication.data.teachers import OracleTeacher, TeacherPool

    pool = TeacherPool(
        [OracleTeacher(lambda p: {"1+2=": "3", "3+4=": "7"}[p[0]["content"]])],
        verifier=lambda p, c: 1.0,
    )
    args = config(
        tmp_path / name,
        per_device_train_batch_size=G,  # one prompt per step: an epoch is 2 steps
        max_steps=STEPS,
        lr_scheduler_type="linear",
        beta=0.0,
    )
    return make_trainer(
        tmp_path,
        reward=positional_reward,
        args=args,
        teacher_pool=pool,
        alpha_sdpo=0.5,
        beta_replay=0.5,
        sdpo_wrapper="taid",
        taid_total_steps=STEPS,
        sdpo_teacher="ema",
        dpo_variant="dpo",
        # the teacher is probed (its gate window is resumed) but not obeyed: channel 2 and its
        # TAID schedule act every step, whatever this tiny model's teacher is worth
        sdpo_gate=False,
    )


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_resume_state_continues_bit_exactly(tmp_path):
    torch.set_num_threads(1)
    straight = _trainer(tmp_path, "straight")
    straight.train()
    expected = _weights(straight)
    expected_ema = {k: v.clone() for k, v in straight.ema_teacher.model.state_dict().items()}

    first = _trainer(tmp_path, "first")
    capture = _Capture(first, SPLIT)
    first.add_callback(capture)
    first.train()
    state = capture.state
    assert state is not None and state["global_step"] == SPLIT
    assert state["optimizer"]["state"] and state["scheduler"]["last_epoch"] == SPLIT
    assert state["replay"]["traces"] and state["replay"]["reference_cache"]
    assert state["taid"]["scheduler"]["prev_loss"] is not None
    assert state["sampler_epoch_start"] is not None
    assert state["sdpo_gate"] == first._gate.state() and state["sdpo_gate"]

    second = _trainer(tmp_path, "second")
    assert any(not torch.equal(p, expected[n]) for n, p in _weights(second).items())
    second.resume_train(state)
    assert second.state.global_step == STEPS
    got = _weights(second)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    for name, tensor in second.ema_teacher.model.state_dict().items():
        assert torch.equal(tensor, expected_ema[name]), name
    assert second.taid_t == straight.taid_t
    assert second._gate.state() == straight._gate.state()  # the teacher gate's window
    assert second.lr_scheduler.get_last_lr() == straight.lr_scheduler.get_last_lr()


def test_resume_without_the_state_differs(tmp_path):
    """The check above can fail: continuing with fresh RNG/optimizer gives other weights."""
    torch.set_num_threads(1)
    straight = _trainer(tmp_path, "straight")
    straight.train()
    first = _trainer(tmp_path, "first")
    capture = _Capture(first, SPLIT)
    first.add_callback(capture)
    first.train()
    state = dict(capture.state)
    # drop AdamW's moments: the resumed run must then end elsewhere
    state["optimizer"] = {"state": {}, "param_groups": state["optimizer"]["param_groups"]}
    second = _trainer(tmp_path, "second")
    second.resume_train(state)
    assert any(
        not torch.equal(p, straight.model.state_dict()[n]) for n, p in _weights(second).items()
    )


def test_bad_resume_states_are_refused_by_name(tmp_path):
    first = _trainer(tmp_path, "first")
    capture = _Capture(first, 1)
    first.add_callback(capture)
    first.train()
    state = capture.state

    def refused(change, match):
        bad = dict(state)
        change(bad)
        with pytest.raises(ResumeStateError, match=match):
            _trainer(tmp_path, "again").resume_train(bad)

    name = next(iter(state["model"]))

    def nan_weight(s):
        s["model"] = {**s["model"], name: torch.full_like(s["model"][name], float("nan"))}

    def wrong_shape(s):
        s["model"] = {**s["model"], name: s["model"][name][:1]}

    def nan_moment(s):
        opt = s["optimizer"]
        first_id = next(iter(opt["state"]))
        entry = dict(opt["state"][first_id])
        entry["exp_avg"] = torch.full_like(entry["exp_avg"], float("inf"))
        s["optimizer"] = {**opt, "state": {**opt["state"], first_id: entry}}

    refused(nan_weight, "non-finite")
    refused(wrong_shape, "model")
    refused(nan_moment, "optimizer.state")
    refused(lambda s: s.update(format=99), "format")
    refused(lambda s: s.update(ema=None), "EMA")
    refused(
        lambda s: s.update(rng={**s["rng"], "torch": torch.zeros(3, dtype=torch.uint8)}),
        "rng.torch",
    )
    refused(lambda s: s.update(global_step=STEPS), "nothing left")
    refused(lambda s: s.update(sdpo_gate=[0.1, "x"]), "sdpo_gate")
    assert dataset  # the helpers' dataset is what both trainers train on


def test_train_from_step_continues_the_schedule_with_fresh_state(tmp_path):
    """No resume state (a replica restarted onto newer global weights): the step count and the
    LR schedule continue at the step; the optimizer starts afresh."""
    straight = _trainer(tmp_path, "straight")
    straight.train()
    late = _trainer(tmp_path, "late")
    late.train_from_step(SPLIT)
    assert late.state.global_step == STEPS
    assert late.lr_scheduler.get_last_lr() == straight.lr_scheduler.get_last_lr()
    steps = {float(s["step"]) for s in late.optimizer.state_dict()["state"].values()}
    assert steps == {float(STEPS - SPLIT)}  # AdamW only saw the steps trained here
    assert [r["step"] for r in late.state.log_history if "loss" in r] == [4, 5, 6]
    with pytest.raises(ValueError, match="outside"):
        _trainer(tmp_path, "too-late").train_from_step(STEPS)
