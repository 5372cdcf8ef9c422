"""The three-channel composer loss: ``grpo + alpha_sdpo * sdpo + beta_replay * replay``.

``compose_loss(model, inputs, **kw)`` runs the forward passes of a Hugging Face causal LM on the
batch described in ``docs/api.md`` (the fixed batch contract) and hands the tensors to
``combine(**tensors, **kw)``, which adapters with precomputed log-probs/logits call directly.

Channels 2 (SDPO hint self-distillation) and 3 (trace replay DPO/SimPO) switch off for a step when
their inputs are absent, select nothing, or their weight is 0; their metrics then say so
(``sdpo/active = 0.0``, ``replay/active = 0.0``) and they contribute nothing. With
``alpha_sdpo = 0`` (or ``beta_replay = 0``) the total is bit-exactly the loss without that channel:
the channel is not computed at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from composer_replication.loss import _batch
from composer_replication.loss._channels import (
    assemble,
    grpo_term,
    replay_term,
    sample_token_mask,
    sdpo_term,
)
from composer_replication.loss._config import ComposeConfig
from composer_replication.loss._logprobs import selective_log_softmax

__all__ = ["ComposeConfig", "combine", "compose_loss"]

REPLAY_KEYS = _batch.REPLAY_KEYS


def combine(
    *,
    per_token_logps: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_per_token_logps: Tensor | None = None,
    ref_per_token_logps: Tensor | None = None,
    student_logits: Tensor | None = None,
    teacher_logits: Tensor | None = None,
    sdpo_mask: Tensor | None = None,
    chosen_logps: Tensor | None = None,
    rejected_logps: Tensor | None = None,
    ref_chosen_logps: Tensor | None = None,
    ref_rejected_logps: Tensor | None = None,
    chosen_avg_logps: Tensor | None = None,
    rejected_avg_logps: Tensor | None = None,
    num_items_in_batch: int | Tensor | None = None,
    max_completion_length: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Tensor-level composer loss for adapters that already hold log-probs / logits.

    Channel 1 (always): ``per_token_logps``, ``completion_mask``, ``advantages`` (and optional
    ``old_per_token_logps``, ``ref_per_token_logps``, ``num_items_in_batch``,
    ``max_completion_length``), see ``policy.grpo_loss``.
    Channel 2: ``student_logits`` and ``teacher_logits`` ``(B, T, V)`` completion logits (raw, not
    divided by ``temperature``; ``sdpo_temperature`` applies), ``sdpo_mask`` ``(B,)`` sample mask or
    ``(B, T)`` token mask (None = all), combined with ``completion_mask``. Off when either logits
    tensor is None, nothing is selected, or ``alpha_sdpo == 0``.
    Channel 3: ``dpo_variant="dpo"`` reads ``chosen_logps``/``rejected_logps`` ``(N,)`` summed
    log-probs and needs ``ref_chosen_logps``/``ref_rejected_logps``; ``"simpo"`` reads
    ``chosen_avg_logps``/``rejected_avg_logps``. Off when they are None, N == 0, or
    ``beta_replay == 0``.
    ``kwargs``: the ``compose_loss`` keywords (``ComposeConfig`` fields); ``temperature`` is
    accepted for symmetry but has no effect here (the log-probs are already computed).

    Returns ``(loss, metrics)`` as ``compose_loss``.
    """
    cfg = ComposeConfig.from_kwargs(kwargs)
    grpo = grpo_term(
        cfg,
        per_token_logps,
        completion_mask,
        advantages,
        old_per_token_logps,
        ref_per_token_logps,
        num_items_in_batch,
        max_completion_length,
    )
    sdpo = None
    sdpo_frac = 0.0
    if cfg.alpha_sdpo != 0.0 and student_logits is not None and teacher_logits is not None:
        token_mask = sample_token_mask(completion_mask, sdpo_mask)
        rows = token_mask.any(-1)
        sdpo_frac = float(rows.float().mean()) if rows.numel() else 0.0
        if bool(rows.any()):
            sdpo = sdpo_term(cfg, student_logits, teacher_logits, token_mask)
    replay = None
    if cfg.beta_replay != 0.0:
        if cfg.dpo_variant == "simpo":
            chosen, rejected = chosen_avg_logps, rejected_avg_logps
        else:
            chosen, rejected = chosen_logps, rejected_logps
        if chosen is not None and rejected is not None and chosen.numel() > 0:
            replay = replay_term(
                cfg,
                chosen,
                rejected,
                ref_chosen_logps,
                ref_rejected_logps,
                ("ref_chosen_logps", "ref_rejected_logps"),
            )
    return assemble(cfg, grpo, sdpo, sdpo_frac, replay)


def compose_loss(
    model: Any, inputs: Mapping[str, Any], **kwargs: Any
) -> tuple[Tensor, dict[str, float]]:
    """Three-channel composer loss on one micro-batch; see ``docs/api.md`` for ``inputs``.

    ``model`` is a causal LM called as ``model(input_ids=..., attention_mask=...)`` returning
    ``.logits``. Channel 1's student forward is ONE call on ``cat(prompt_ids, completion_ids)``;
    completion logits are ``logits[:, P-1:-1]``, divided by ``temperature`` for the channel-1
    log-probs; the same (undivided) logits are the channel-2 student, where
    ``sdpo_temperature`` applies to student and teacher alike. The channel-2 teacher forward runs
    under ``torch.no_grad()`` on the selected rows only (or uses ``sdpo_teacher_logits``).
    Channel 3 runs one forward per side (chosen, rejected) with gradient.

    Keywords (``ComposeConfig``): loss_type="dapo", epsilon_low=0.2, epsilon_high=None,
    delta=None, kl_beta=0.0, temperature=1.0, alpha_sdpo=0.1, beta_replay=0.05,
    sdpo_jsd_beta=0.5, sdpo_temperature=1.0, sdpo_token_clip=None, sdpo_top_k=None,
    sdpo_add_tail=True, sdpo_wrapper="none"|"taid"|"entropy_opd", taid_t=None,
    taid_schedule_step=None, taid_total_steps=None, entropy_opd_h_max=0.8, replay_dpo_beta=0.1,
    dpo_variant="dpo"|"simpo", simpo_beta=2.0, simpo_gamma=1.0, label_smoothing=0.0.

    Returns ``(loss, metrics)``: 0-dim ``grpo + alpha_sdpo * sdpo + beta_replay * replay`` and a
    dict of python floats (``loss/*``, ``grpo/*``, ``sdpo/*``, ``replay/*``, ``taid/t``, ...).
    """
    if not isinstance(inputs, Mapping):
        raise ValueError(f"inputs must be a mapping of tensors, got {type(inputs).__name__}")
    cfg = ComposeConfig.from_kwargs(kwargs)
    prompt_ids, prompt_mask, completion_ids, completion_mask, advantages = _batch.channel1(inputs)
    P = prompt_ids.shape[1]
    logits = _batch.forward_logits(
        model,
        torch.cat([prompt_ids, completion_ids], dim=1),
        torch.cat([prompt_mask, completion_mask], dim=1),
    )
    student = logits[:, P - 1 : -1]  # position j predicts token j+1: the T completion tokens
    per_token_logps = selective_log_softmax(student, completion_ids, cfg.temperature)
    grpo = grpo_term(
        cfg,
        per_token_logps,
        completion_mask,
        advantages,
        inputs.get("old_per_token_logps"),
        inputs.get("ref_per_token_logps"),
        inputs.get("num_items_in_batch"),
        inputs.get("max_completion_length"),
    )

    sdpo, sdpo_frac = None, 0.0
    if cfg.alpha_sdpo != 0.0:  # alpha 0: not even the teacher forward runs (bit-exact channel 1)
        picked = _batch.sdpo_inputs(model, inputs, student, completion_mask)
        if picked is not None:
            student_rows, teacher_rows, token_mask, sdpo_frac = picked
            if student_rows.shape[0] > 0:
                sdpo = sdpo_term(cfg, student_rows, teacher_rows, token_mask)

    replay = None
    if cfg.beta_replay != 0.0:
        pairs = _batch.replay_inputs(model, inputs, cfg.dpo_variant)
        if pairs is not None:
            replay = replay_term(cfg, *pairs, _batch.REPLAY_REF_KEYS)
    return assemble(cfg, grpo, sdpo, sdpo_frac, replay)
