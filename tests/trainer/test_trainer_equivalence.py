"""Channels 2 and 3 off: ComposerReplicationTrainer is GRPOTrainer, bit for bit, per loss_type.

And the logits-capturing student forward (used when channels 2/3 are on) gives channel 1 the
same loss and gradients as TRL's fused log-prob head, within float tolerance.

Tolerances are derived (tests/tolerances.py): two computations of the same quantity that group
n rounded fp32 sums differently differ by at most 2 gamma_n relative to the summed terms' size;
each comparison names its n and that size. The same bounds hold on CUDA (TF32 off,
deterministic kernels: tests/conftest.py), where TRL's log-probs come from its Triton kernel.
"""

from __future__ import annotations

import math

import pytest
import torch
from _trainer_helpers import (
    chain_length,
    config,
    generation_batch,
    loss_and_grads,
    make_trainer,
    oracle_store,
    plain_reward,
)
from tolerances import assert_close, tol
from trl import GRPOTrainer

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_channels_off_equals_grpo_trainer(tmp_path, loss_type):
    args = dict(loss_type=loss_type, beta=0.04)
    composer = make_trainer(
        tmp_path,
        reward=plain_reward,
        args=config(tmp_path, **args),
        alpha_sdpo=0.0,
        beta_replay=0.0,
    )
    plain = make_trainer(
        tmp_path,
        reward=plain_reward,
        args=config(tmp_path, **args),
        cls=GRPOTrainer,
        save_to=tmp_path / "ref",
    )
    inputs = generation_batch(composer)
    assert inputs["advantages"].abs().sum() > 0  # the policy term is really exercised
    assert not any(k.startswith(("sdpo_", "replay_")) for k in inputs)
    loss_c, grads_c = loss_and_grads(composer, inputs)
    loss_p, grads_p = loss_and_grads(plain, inputs)
    assert torch.equal(loss_c, loss_p)
    assert grads_c.keys() == grads_p.keys() and grads_c
    for name in grads_c:
        assert torch.equal(grads_c[name], grads_p[name]), name

    # The capture path (one plain forward, logits kept for channels 2/3) vs TRL's fused head.
    capturing = make_trainer(
        tmp_path, reward=plain_reward, args=config(tmp_path, **args), alpha_sdpo=0.1
    )
    capturing.model.zero_grad(set_to_none=True)
    capturing._capture_logits = True
    loss_k = GRPOTrainer._compute_loss(capturing, capturing.model, inputs)
    assert capturing._captured_logits is not None and not capturing._capture_logits
    loss_k.backward()
    # The two differ only in the log-softmax: each token's V-term log-sum-exp (ours vs TRL's own;
    # on CUDA its Triton kernel), then the same sums over the batch's completion tokens. The
    # loss sums per-token terms of size |advantage| (the ratio is 1 at the first iteration).
    n = capturing.model.config.vocab_size + inputs["completion_ids"].numel()
    scale = float(inputs["advantages"].abs().max())
    assert_close(loss_k, loss_p, n=n, scale=scale, what="loss")
    for name, param in capturing.model.named_parameters():
        assert_close(param.grad, grads_p[name], n=n, what=name)


def _channel_keys_removed(inputs):
    return {k: v for k, v in inputs.items() if not k.startswith(("sdpo_", "replay_"))}


def _reference_tensors(trainer, inputs):
    """Channel tensors computed with plain torch from full, untrimmed forwards (no loss-library
    log-prob helpers, no logits_to_keep): the independent side of the comparison."""
    model = trainer.model
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    P, T = prompt_ids.shape[1], completion_ids.shape[1]

    def token_logps(logits, ids):
        return torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    logits = model(
        input_ids=torch.cat([prompt_ids, completion_ids], 1),
        attention_mask=torch.cat([prompt_mask, completion_mask], 1),
    ).logits
    student = logits[:, P - 1 : -1]
    t_ids = inputs["sdpo_teacher_input_ids"]
    with torch.no_grad():
        teacher = model(input_ids=t_ids, attention_mask=inputs["sdpo_teacher_attention_mask"])
    teacher_logits = teacher.logits[:, t_ids.shape[1] - T - 1 : -1]

    rows = inputs["replay_pair_mask"].nonzero().squeeze(-1)
    chosen_ids = inputs["replay_chosen_ids"][rows]
    chosen_mask = inputs["replay_chosen_mask"][rows]

    def chosen_sum(m):
        out = m(
            input_ids=torch.cat([prompt_ids[rows], chosen_ids], 1),
            attention_mask=torch.cat([prompt_mask[rows], chosen_mask], 1),
        ).logits[:, P - 1 : -1]
        return (token_logps(out, chosen_ids) * chosen_mask).sum(-1)

    rejected = (token_logps(student[rows], completion_ids[rows]) * completion_mask[rows]).sum(-1)
    with torch.no_grad():
        ref = trainer.replay_reference
        ref_chosen = chosen_sum(ref)
        ref_out = ref(
            input_ids=torch.cat([prompt_ids[rows], completion_ids[rows]], 1),
            attention_mask=torch.cat([prompt_mask[rows], completion_mask[rows]], 1),
        ).logits[:, P - 1 : -1]
        ref_rejected = (token_logps(ref_out, completion_ids[rows]) * completion_mask[rows]).sum(-1)
    return {
        "per_token_logps": token_logps(student / trainer.temperature, completion_ids),
        "completion_mask": completion_mask,
        "advantages": inputs["advantages"],
        "student_logits": student,
        "teacher_logits": teacher_logits,
        "sdpo_mask": inputs["sdpo_sample_mask"],
        "chosen_logps": chosen_sum(model),
        "rejected_logps": rejected,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }


@pytest.mark.parametrize("share_prefix", [False, True])
def test_channels_on_equal_combine_on_independent_tensors(tmp_path, monkeypatch, share_prefix):
    """The trainer's channel-2/3 loss and gradients = combine's on tensors built by hand (the
    teacher scored here over whole contexts), with and without the shared-prefix teacher."""
    from composer_replication.loss import _batch, combine

    shared_calls = []
    real = _batch.shared_prefix_completion_logits

    def counting(*a, **kw):
        out = real(*a, **kw)
        shared_calls.append(out is not None)
        return out

    monkeypatch.setattr(_batch, "shared_prefix_completion_logits", counting)
    knobs = dict(alpha_sdpo=0.5, beta_replay=0.7, sdpo_jsd_beta=0.3, replay_dpo_beta=0.2)
    trainer = make_trainer(
        tmp_path,
        store=oracle_store(),
        args=config(tmp_path, beta=0.0),
        sdpo_share_prefix=share_prefix,
        **knobs,
    )
    inputs = generation_batch(trainer)
    assert inputs["sdpo_sample_mask"].any() and inputs["replay_pair_mask"].sum() == 2
    # The hinted contexts are left-padded to different lengths: the trainer trims, we do not.
    assert not inputs["sdpo_teacher_attention_mask"][:, 0].all()

    trainer._metrics["train"].clear()
    loss_on, grads_on = loss_and_grads(trainer, inputs)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    loss_off, grads_off = loss_and_grads(trainer, _channel_keys_removed(inputs))

    tensors = _reference_tensors(trainer, inputs)
    # Left padding, trimming and batching change how every sum of the forward is grouped (the
    # trainer's batch vs the full forwards here): n = the whole chain (_trainer_helpers).
    n = chain_length(trainer.model, inputs)
    # The trainer's DPO reference log-probs are the frozen copy's, as computed here (sums of
    # negative per-token log-probs: no cancellation, the values are their own scale).
    rows = inputs["replay_pair_mask"].nonzero().squeeze(-1)
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        assert_close(inputs[f"replay_{key}"][rows], tensors[key], n=n, what=key)
    params = [p for _, p in trainer.model.named_parameters()]
    on, ref_metrics = combine(**tensors, **knobs)
    off, _ = combine(**tensors, **{**knobs, "alpha_sdpo": 0.0, "beta_replay": 0.0})
    extra = on - off
    ref_grads = torch.autograd.grad(extra, params, allow_unused=True)

    # The channel terms sum per-token divergences between near-uniform random-init distributions
    # (each at most ~log V) and per-pair DPO losses (log 2 at zero margin).
    scale = max(math.log(trainer.model.config.vocab_size), math.log(2.0))
    assert_close(loss_on - loss_off, extra, n=n, scale=scale, what="channels 2+3 loss")
    assert float(extra.detach()) != 0.0
    for (name, _), g in zip(trainer.model.named_parameters(), ref_grads):
        expected = torch.zeros_like(grads_on[name]) if g is None else g
        # scale: the largest gradient element of either computation (module docstring)
        assert_close(grads_on[name] - grads_off[name], expected, n=n, what=name)
    assert metrics["jsd/tokens"] == ref_metrics["jsd/tokens"]  # counts: exact
    assert metrics["sdpo/frac_samples"] == ref_metrics["sdpo/frac_samples"]
    bound = tol(n, scale)
    for key in ("loss/sdpo", "loss/replay"):
        assert metrics[key] == pytest.approx(
            ref_metrics[key], rel=bound["rtol"], abs=bound["atol"]
        ), key
    # the margin subtracts summed log-probs: its terms' size is dpo beta * |log-prob sums|
    margin_scale = knobs["replay_dpo_beta"] * float(tensors["chosen_logps"].detach().abs().max())
    margin = tol(n, margin_scale)
    assert metrics["replay/margin"] == pytest.approx(
        ref_metrics["replay/margin"], rel=margin["rtol"], abs=margin["atol"]
    )
    assert metrics["sdpo/active"] == 1.0 and metrics["replay/active"] == 1.0
    # opt-in: the shared forward ran (and shared) only when asked for
    assert any(shared_calls) if share_prefix else not shared_calls, shared_calls


@pytest.mark.parametrize("dpo_variant", ["dpo", "simpo"])
def test_trainer_loss_is_compose_loss_on_its_batch(tmp_path, dpo_variant):
    """With TRL's dapo (= loss.grpo_loss) the whole trainer loss is compose_loss on the batch the
    trainer built: the one batch format, read by the same public functions."""
    from composer_replication.loss import compose_loss

    knobs = dict(alpha_sdpo=0.5, beta_replay=0.7, dpo_variant=dpo_variant)
    trainer = make_trainer(
        tmp_path, store=oracle_store(), args=config(tmp_path, loss_type="dapo", beta=0.0), **knobs
    )
    inputs = generation_batch(trainer)
    assert inputs["sdpo_sample_mask"].any() and inputs["replay_pair_mask"].any()
    loss, grads = loss_and_grads(trainer, inputs)

    trainer.model.zero_grad(set_to_none=True)
    expected, _ = compose_loss(trainer.model, inputs, temperature=trainer.temperature, **knobs)
    expected.backward()
    # compose_loss runs its own forwards over the batch (other groupings of every sum): the
    # whole chain; the loss's terms are |advantage| (channel 1), <= ~log V (channel 2, near-
    # uniform random-init distributions) and log 2 (a pair's loss at zero margin).
    n = chain_length(trainer.model, inputs)
    scale = max(float(inputs["advantages"].abs().max()), math.log(trainer.model.config.vocab_size))
    assert_close(loss, expected, n=n, scale=scale, what="loss")
    for name, param in trainer.model.named_parameters():
        assert_close(grads[name], param.grad, n=n, what=name)
