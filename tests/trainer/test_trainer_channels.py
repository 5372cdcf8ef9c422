"""Channels 2 and 3 inside the trainer, on a fixed generation batch."""

from __future__ import annotations

import logging

import torch
from _trainer_helpers import (
    G,
    chain_length,
    config,
    generation_batch,
    loss_and_grads,
    make_trainer,
    oracle_store,
    text_of,
)
from tolerances import assert_close
from trl.trainer.utils import split_tensor_dict


def _train_fixed_batch(trainer, inputs, steps, key, lr=1e-2):
    """Repeated optimizer steps on one batch with channel 1 neutralised (zero advantages)."""
    inputs = {**inputs, "advantages": torch.zeros_like(inputs["advantages"])}
    opt = torch.optim.Adam(trainer.model.parameters(), lr=lr)
    values = []
    for _ in range(steps):
        trainer._metrics["train"].clear()
        opt.zero_grad()
        trainer.compute_loss(trainer.model, inputs).backward()
        opt.step()
        values.append(trainer._metrics["train"][key][-1])
    return values


def test_channel2_teacher_context_holds_sibling_and_feedback(tmp_path):
    trainer = make_trainer(tmp_path, args=config(tmp_path, beta=0.0), alpha_sdpo=1.0, beta_replay=0)
    inputs = generation_batch(trainer)
    tok = trainer.processing_class
    T = inputs["completion_ids"].shape[1]
    # positional_reward: rollout 0 of each group succeeds, the others fail with feedback.
    assert inputs["sdpo_sample_mask"].tolist() == [i % G != 0 for i in range(2 * G)]
    completions = [
        tok.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(inputs["completion_ids"], inputs["completion_mask"])
    ]
    for i in range(2 * G):
        ids = inputs["sdpo_teacher_input_ids"][i]
        attn = inputs["sdpo_teacher_attention_mask"][i]
        assert torch.equal(ids[-T:], inputs["completion_ids"][i])  # the student's own tokens
        context = tok.decode(ids[:-T][attn[:-T].bool()])
        if i % G == 0:
            assert "Correct solution" not in context
            continue
        sibling = completions[(i // G) * G]
        question = "1+2=" if i < G else "3+4="
        assert context.startswith(f"<|im_start|>user\n{question}")
        assert f"\nCorrect solution:\n\n{sibling}\n\n" in context
        feedback = f"wrong: you wrote {completions[i][:3]!r}"
        assert (
            f"The following is feedback from your unsuccessful earlier attempt:\n\n{feedback}"
            in context
        )
        assert context.endswith(
            "Correctly solve the original question.\n<|im_end|>\n<|im_start|>assistant\n"
        )


def test_channel2_steps_reduce_divergence(tmp_path):
    trainer = make_trainer(tmp_path, args=config(tmp_path, beta=0.0), alpha_sdpo=1.0, beta_replay=0)
    inputs = generation_batch(trainer)
    divergences = _train_fixed_batch(trainer, inputs, 8, "loss/sdpo", lr=1e-3)
    assert divergences[0] > 0
    assert divergences[-1] < 0.3 * divergences[0], divergences
    assert trainer._metrics["train"]["sdpo/active"][-1] == 1.0


def test_channel2_off_for_a_batch_without_hints(tmp_path, caplog):
    trainer = make_trainer(
        tmp_path, reward=lambda completions, **kw: [0.0] * len(completions), alpha_sdpo=1.0
    )
    with caplog.at_level(logging.INFO, logger="composer_replication.trainer.trainer"):
        inputs = generation_batch(trainer)
    assert not inputs["sdpo_sample_mask"].any()
    assert "channel 2 off for this batch" in caplog.text
    trainer._metrics["train"].clear()
    trainer.compute_loss(trainer.model, inputs)
    assert trainer._metrics["train"]["sdpo/active"] == [0.0]


def test_feedback_funcs_feed_channel2(tmp_path):
    def hint(prompts, completions, answer, **kw):
        return [f"the answer is {a}" for a in answer]

    trainer = make_trainer(
        tmp_path,
        reward=lambda completions, **kw: [0.0] * len(completions),
        alpha_sdpo=1.0,
        feedback_funcs=[hint],
    )
    inputs = generation_batch(trainer)
    assert inputs["sdpo_sample_mask"].all()
    text = trainer.processing_class.decode(inputs["sdpo_teacher_input_ids"][G])
    assert "the answer is 7" in text and "Correct solution" not in text


def test_channel3_dpo_steps_increase_margin(tmp_path):
    trainer = make_trainer(
        tmp_path, store=oracle_store(), args=config(tmp_path, beta=0.0), alpha_sdpo=0, beta_replay=1
    )
    inputs = generation_batch(trainer)
    rows = inputs["replay_pair_mask"].nonzero().squeeze(-1).tolist()
    # One pair per prompt, on a failed rollout (rewards 0), chosen = the oracle trace + the chat
    # template's end of turn (as SFT and the template end an answer).
    assert len(rows) == 2 and all(r % G != 0 for r in rows)
    chosen = trainer.processing_class.decode(
        inputs["replay_chosen_ids"][rows[1]][inputs["replay_chosen_mask"][rows[1]].bool()]
    )
    assert chosen == "7 done<|im_end|>"
    # Reference log-probs come from a frozen copy of the initial policy (beta=0: no TRL ref).
    assert trainer.ref_model is None and trainer.replay_reference is not None
    assert (inputs["replay_ref_chosen_logps"][rows] < 0).all()
    margins = _train_fixed_batch(trainer, inputs, 6, "replay/margin")
    assert margins[-1] > margins[0] + 0.5, margins
    assert trainer._metrics["train"]["replay/accuracy"][-1] == 1.0
    # The reference really is frozen (its own forward, not the trained policy's).
    from composer_replication.loss import completion_logps

    idx = torch.tensor(rows)
    c_ids, c_mask = inputs["replay_chosen_ids"][idx], inputs["replay_chosen_mask"][idx]
    args = (inputs["prompt_ids"][idx], inputs["prompt_mask"][idx], c_ids, c_mask)
    with torch.no_grad():
        ref_now = completion_logps(trainer.replay_reference, *args)
        policy_now = completion_logps(trainer.model, *args)
    # the same forward on a 2-row sub-batch (other groupings of the sums): the whole chain; sums
    # of negative log-probs are their own scale
    n = chain_length(trainer.model, inputs)
    assert_close(ref_now[0], inputs["replay_ref_chosen_logps"][idx], n=n, what="reference")
    assert (policy_now[0] > ref_now[0] + 0.1).all()


def test_channel3_simpo_needs_no_reference(tmp_path):
    trainer = make_trainer(
        tmp_path,
        store=oracle_store(),
        args=config(tmp_path, beta=0.0),
        alpha_sdpo=0,
        beta_replay=1,
        dpo_variant="simpo",
    )
    assert trainer.ref_model is None and trainer.replay_reference is None
    inputs = generation_batch(trainer)
    assert "replay_ref_chosen_logps" not in inputs and inputs["replay_pair_mask"].sum() == 2
    loss, grads = loss_and_grads(trainer, {**inputs, "advantages": 0 * inputs["advantages"]})
    assert torch.isfinite(loss) and loss > 0
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0
    margins = _train_fixed_batch(trainer, inputs, 4, "replay/margin")
    assert margins[-1] > margins[0]


def test_grad_accumulation_1x8_equals_8x1(tmp_path):
    trainer = make_trainer(
        tmp_path,
        store=oracle_store(),
        args=config(tmp_path, loss_type="dapo", beta=0.0),
        alpha_sdpo=0.5,
        beta_replay=0.5,
    )
    inputs = generation_batch(trainer)
    assert inputs["sdpo_sample_mask"].any() and inputs["replay_pair_mask"].any()
    assert inputs["advantages"].abs().sum() > 0
    n = inputs["completion_ids"].shape[0]
    trainer.current_gradient_accumulation_steps = 1
    trainer.args.steps_per_generation = 1
    _, whole = loss_and_grads(trainer, inputs)

    trainer.current_gradient_accumulation_steps = n
    trainer.args.steps_per_generation = n
    trainer.model.zero_grad(set_to_none=True)
    for micro in split_tensor_dict(inputs, n):
        trainer.compute_loss(trainer.model, micro).backward()
    # one-row forwards and eight accumulated backwards group every sum differently from the
    # 8-row batch: the whole chain (_trainer_helpers.chain_length)
    chain = chain_length(trainer.model, inputs)
    for name, param in trainer.model.named_parameters():
        assert_close(param.grad, whole[name], n=chain, what=name)


def test_reward_tuples_feed_feedback_and_plain_scores_to_trl(tmp_path):
    trainer = make_trainer(tmp_path, alpha_sdpo=1.0)
    inputs = generation_batch(trainer)
    feedback = trainer._batch["feedback"]
    assert feedback[0] is None and feedback[1].startswith("wrong: you wrote")
    rewards = trainer._global_rewards().tolist()
    assert rewards == [1.0 if i % G == 0 else 0.0 for i in range(2 * G)]
    assert inputs["advantages"][0] > 0 > inputs["advantages"][1]
    assert text_of is not None


def test_teacher_pool_fills_the_store_lazily(tmp_path):
    from composer_replication.data.teachers import OracleTeacher, TeacherPool

    asked = []

    def solve(prompt):
        asked.append(prompt[0]["content"])
        return {"1+2=": "3", "3+4=": "7"}[prompt[0]["content"]]

    pool = TeacherPool([OracleTeacher(solve)], verifier=lambda p, c: 1.0)
    trainer = make_trainer(tmp_path, teacher_pool=pool, alpha_sdpo=0, beta_replay=1)
    assert trainer.trace_store is pool.store and len(pool.store) == 0
    inputs = generation_batch(trainer)
    assert sorted(asked) == ["1+2=", "3+4="] and len(pool.store) == 2
    assert inputs["replay_pair_mask"].sum() == 2
    generation_batch(trainer)  # second batch: the store already has both prompts
    assert len(asked) == 2


def test_builtin_task_reward_and_oracle_traces(tmp_path):
    """What the CLI wires: a task's (score, feedback) reward and its oracle traces."""
    from composer_replication.data import TraceStore
    from composer_replication.models import build_tiny_model, build_tokenizer
    from composer_replication.tasks import get_task
    from composer_replication.trainer import ComposerReplicationTrainer

    task = get_task("arithmetic", seed=0, n_train=4, n_eval=2)
    store = TraceStore.from_dicts(task.oracle_traces(), source="arithmetic oracle")
    tok = build_tokenizer()
    trainer = ComposerReplicationTrainer(
        model=build_tiny_model(tok, hidden_size=32, num_layers=2, seed=0),
        processing_class=tok,
        reward_funcs=[task.reward_func()],
        args=config(tmp_path),
        train_dataset=task.to_dataset("train"),
        trace_store=store,
        alpha_sdpo=0.1,
        beta_replay=0.05,
        sdpo_gate=False,  # a random model's teacher is no better: this checks the plumbing
    )
    trainer.current_gradient_accumulation_steps = 1
    dataset = task.to_dataset("train")
    rows = [dataset[i] for i in (0, 1) for _ in range(G)]
    torch.manual_seed(0)
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(rows)
    # A random model fails: every rollout gets the task's feedback, every prompt an oracle pair.
    assert inputs["sdpo_sample_mask"].all() and inputs["replay_pair_mask"].sum() == 2
    assert all(fb for fb in trainer._batch["feedback"])
    loss, _ = loss_and_grads(trainer, inputs)
    assert torch.isfinite(loss)
    assert trainer._metrics["train"]["replay/active"][-1] == 1.0


def test_callbacks_drive_the_trainer_through_its_public_state(tmp_path):
    import types

    import pytest

    from composer_replication.loss import TAID_T_START
    from composer_replication.trainer import EMATeacherCallback, TAIDCallback

    trainer = make_trainer(
        tmp_path,
        args=config(tmp_path, beta=0.0),
        alpha_sdpo=1.0,
        beta_replay=0,
        sdpo_wrapper="taid",
        sdpo_teacher="ema",
    )
    callbacks = trainer.callback_handler.callbacks
    taid = next(c for c in callbacks if isinstance(c, TAIDCallback))
    ema = next(c for c in callbacks if isinstance(c, EMATeacherCallback))
    assert trainer.taid_t == TAID_T_START  # bound by the callback
    assert trainer.ema_teacher is not None and trainer.replay_reference is None

    inputs = generation_batch(trainer)
    trainer._metrics["train"].clear()
    for _ in range(2):
        loss_and_grads(trainer, inputs)
    logged = trainer._metrics["train"]["loss/sdpo"]
    assert trainer._metrics["train"]["taid/t"] == [TAID_T_START] * 2
    ema_params = dict(trainer.ema_teacher.model.named_parameters())
    assert all(not p.requires_grad for p in ema_params.values())

    state = types.SimpleNamespace(global_step=1, max_steps=2)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.5)
    name = "model.layers.0.mlp.up_proj.weight"
    before = ema_params[name].detach().clone()
    ema.on_step_end(None, state, None)  # the EMA teacher moves toward the policy
    student = dict(trainer.model.named_parameters())[name].detach()
    rate = trainer.composer.sdpo_ema_rate
    # two products and a sum, grouped as the EMA's lerp or as written here: n = 3 roundings
    assert_close(ema_params[name], (1 - rate) * before + rate * student, n=3, what=name)

    taid.on_step_end(None, state, None)  # first step: records the mean loss, t unchanged
    assert trainer.pop_taid_losses() == []  # the callback consumed both losses
    # the callback averages the same two logged floats in the same order: exact
    assert taid.scheduler.prev_loss == sum(logged) / 2
    state.global_step = 2
    loss_and_grads(trainer, inputs)
    taid.on_step_end(None, state, None)
    assert trainer.taid_t == taid.t == 1.0  # linear floor at the last step
    with pytest.raises(ValueError, match="TAID t"):
        trainer.set_taid_t(1.5)
