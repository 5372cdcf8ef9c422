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

from composer_replication.loss._config import ComposeConfig, taid_t_for
from composer_replication.loss._logprobs import selective_log_softmax
from composer_replication.loss.distill import entropy_opd_loss, generalized_jsd, taid_loss
from composer_replication.loss.policy import grpo_loss
from composer_replication.loss.preference import dpo_loss, simpo_loss

__all__ = ["ComposeConfig", "combine", "compose_loss"]

REPLAY_KEYS = tuple(
    f"replay_{side}_{part}"
    for side in ("chosen", "rejected")
    for part in ("input_ids", "attention_mask", "loss_mask")
)
REPLAY_REF_KEYS = ("replay_ref_chosen_logps", "replay_ref_rejected_logps")


def _sdpo_term(
    cfg: ComposeConfig, student: Tensor, teacher: Tensor, token_mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """Channel-2 divergence on ``(b, T, V)`` completion logits with a ``(b, T)`` token mask."""
    if cfg.sdpo_wrapper == "taid":
        t = taid_t_for(cfg)
        return taid_loss(student, teacher, t, mask=token_mask, temperature=cfg.sdpo_temperature)
    if cfg.sdpo_wrapper == "entropy_opd":
        return entropy_opd_loss(
            student,
            teacher,
            h_max=cfg.entropy_opd_h_max,
            mask=token_mask,
            temperature=cfg.sdpo_temperature,
        )
    return generalized_jsd(
        student,
        teacher,
        beta=cfg.sdpo_jsd_beta,
        temperature=cfg.sdpo_temperature,
        mask=token_mask,
        token_clip=cfg.sdpo_token_clip,
        top_k=cfg.sdpo_top_k,
        add_tail=cfg.sdpo_add_tail,
    )


def _replay_term(
    cfg: ComposeConfig,
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor | None,
    ref_rejected: Tensor | None,
    ref_names: tuple[str, str],
) -> tuple[Tensor, dict[str, float]]:
    """Channel-3 loss; ``chosen``/``rejected`` are summed (dpo) or averaged (simpo) log-probs."""
    if cfg.dpo_variant == "simpo":
        loss, m = simpo_loss(
            chosen,
            rejected,
            beta=cfg.simpo_beta,
            gamma=cfg.simpo_gamma,
            label_smoothing=cfg.label_smoothing,
        )
        prefix = "simpo"
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(
                f"dpo_variant='dpo' needs reference log-probs {ref_names[0]!r} and {ref_names[1]!r} "
                "(summed over each completion); provide them or use dpo_variant='simpo'"
            )
        loss, m = dpo_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=cfg.replay_dpo_beta,
            label_smoothing=cfg.label_smoothing,
        )
        prefix = "dpo"
    keys = ("pairs", "accuracy", "margin", "chosen_reward", "rejected_reward")
    return loss, {f"replay/{k}": m[f"{prefix}/{k}"] for k in keys}


def _assemble(
    cfg: ComposeConfig,
    grpo: tuple[Tensor, dict[str, float]],
    sdpo: tuple[Tensor, dict[str, float]] | None,
    sdpo_frac: float,
    replay: tuple[Tensor, dict[str, float]] | None,
) -> tuple[Tensor, dict[str, float]]:
    total, metrics = grpo[0], dict(grpo[1])
    metrics["loss/grpo"] = float(total.detach())
    metrics["sdpo/active"] = 0.0
    metrics["sdpo/frac_samples"] = sdpo_frac
    metrics["loss/sdpo"] = 0.0
    if sdpo is not None:
        total = total + cfg.alpha_sdpo * sdpo[0]
        metrics.update(sdpo[1])
        metrics["sdpo/active"] = 1.0
        metrics["loss/sdpo"] = float(sdpo[0].detach())
    metrics["replay/active"] = 0.0
    metrics["loss/replay"] = 0.0
    for key in ("pairs", "accuracy", "margin", "chosen_reward", "rejected_reward"):
        metrics[f"replay/{key}"] = 0.0
    if replay is not None:
        total = total + cfg.beta_replay * replay[0]
        metrics.update(replay[1])
        metrics["replay/active"] = 1.0
        metrics["loss/replay"] = float(replay[0].detach())
    if cfg.sdpo_wrapper == "taid" and cfg.alpha_sdpo != 0.0:
        metrics["taid/t"] = taid_t_for(cfg)
    metrics["loss/total"] = float(total.detach())
    return total, metrics


def _grpo(
    cfg: ComposeConfig,
    per_token_logps: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_per_token_logps: Tensor | None,
    ref_per_token_logps: Tensor | None,
    num_items_in_batch: int | Tensor | None,
    max_completion_length: int | None,
) -> tuple[Tensor, dict[str, float]]:
    return grpo_loss(
        per_token_logps,
        old_per_token_logps,
        advantages,
        completion_mask,
        loss_type=cfg.loss_type,
        epsilon_low=cfg.epsilon_low,
        epsilon_high=cfg.epsilon_high,
        delta=cfg.delta,
        ref_per_token_logps=ref_per_token_logps,
        kl_beta=cfg.kl_beta,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )


def _sample_token_mask(completion_mask: Tensor, sdpo_mask: Tensor | None) -> Tensor:
    token_mask = completion_mask.bool()
    if sdpo_mask is None:
        return token_mask
    if sdpo_mask.shape == completion_mask.shape:
        return token_mask & sdpo_mask.bool()
    if sdpo_mask.dim() == 1 and sdpo_mask.shape[0] == completion_mask.shape[0]:
        return token_mask & sdpo_mask.bool()[:, None]
    raise ValueError(
        f"sdpo_mask must be (B,) or (B, T) = {tuple(completion_mask.shape)}, got {tuple(sdpo_mask.shape)}"
    )


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
    grpo = _grpo(
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
        token_mask = _sample_token_mask(completion_mask, sdpo_mask)
        rows = token_mask.any(-1)
        sdpo_frac = float(rows.float().mean()) if rows.numel() else 0.0
        if bool(rows.any()):
            sdpo = _sdpo_term(cfg, student_logits, teacher_logits, token_mask)
    replay = None
    if cfg.beta_replay != 0.0:
        if cfg.dpo_variant == "simpo":
            chosen, rejected = chosen_avg_logps, rejected_avg_logps
        else:
            chosen, rejected = chosen_logps, rejected_logps
        if chosen is not None and rejected is not None and chosen.numel() > 0:
            replay = _replay_term(
                cfg,
                chosen,
                rejected,
                ref_chosen_logps,
                ref_rejected_logps,
                ("ref_chosen_logps", "ref_rejected_logps"),
            )
    return _assemble(cfg, grpo, sdpo, sdpo_frac, replay)


def _forward_logits(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    logits = out.logits if hasattr(out, "logits") else out
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(
            "model(input_ids=..., attention_mask=...) must return .logits of shape (B, L, V)"
        )
    return logits


def _sequence_logps(
    model: Any, ids: Tensor, attn: Tensor, loss_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Summed and mean log-probs over ``loss_mask`` (token j scored by the logits at j-1)."""
    logits = _forward_logits(model, ids, attn)
    per_token = selective_log_softmax(logits[:, :-1], ids[:, 1:])
    lm = loss_mask[:, 1:].to(per_token.dtype)
    summed = (per_token * lm).sum(-1)
    return summed, summed / lm.sum(-1).clamp(min=1.0)


def _require(inputs: Mapping[str, Any], key: str) -> Tensor:
    if key not in inputs or inputs[key] is None:
        raise ValueError(f"inputs is missing required key {key!r} (see docs/api.md, compose_loss)")
    value = inputs[key]
    if not isinstance(value, Tensor):
        raise ValueError(f"inputs[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    return value


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
    prompt_ids, prompt_mask = _require(inputs, "prompt_ids"), _require(inputs, "prompt_mask")
    completion_ids = _require(inputs, "completion_ids")
    completion_mask = _require(inputs, "completion_mask")
    advantages = _require(inputs, "advantages")
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError("prompt_ids and prompt_mask must both be (B, P)")
    if completion_ids.dim() != 2 or completion_mask.shape != completion_ids.shape:
        raise ValueError("completion_ids and completion_mask must both be (B, T)")
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError("prompt_ids and completion_ids must have the same batch size B")
    if prompt_ids.shape[1] < 1:
        raise ValueError("prompt_ids must hold at least one token per row (P >= 1)")
    P, T = prompt_ids.shape[1], completion_ids.shape[1]

    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits = _forward_logits(model, input_ids, attention_mask)
    student = logits[:, P - 1 : -1]
    per_token_logps = selective_log_softmax(student, completion_ids, cfg.temperature)
    grpo = _grpo(
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
    has_teacher = "sdpo_teacher_logits" in inputs or "sdpo_teacher_input_ids" in inputs
    if cfg.alpha_sdpo != 0.0 and has_teacher and inputs.get("sdpo_sample_mask") is not None:
        sample_mask = _require(inputs, "sdpo_sample_mask").bool()
        if sample_mask.shape != (completion_ids.shape[0],):
            raise ValueError(f"sdpo_sample_mask must be (B,), got {tuple(sample_mask.shape)}")
        sdpo_frac = float(sample_mask.float().mean())
        token_mask = completion_mask.bool() & sample_mask[:, None]
        rows = token_mask.any(-1).nonzero().squeeze(-1)
        if rows.numel() > 0:
            all_rows = rows.numel() == completion_ids.shape[0]
            if inputs.get("sdpo_teacher_logits") is not None:
                teacher = _require(inputs, "sdpo_teacher_logits")
                teacher = teacher if all_rows else teacher.index_select(0, rows)
            else:
                t_ids = _require(inputs, "sdpo_teacher_input_ids")
                t_attn = _require(inputs, "sdpo_teacher_attention_mask")
                if t_ids.dim() != 2 or t_ids.shape[1] < T + 1 or t_attn.shape != t_ids.shape:
                    raise ValueError(
                        "sdpo_teacher_input_ids/attention_mask must be (B, L) with L > T (context + "
                        "the completion in the last T positions)"
                    )
                if not all_rows:
                    t_ids, t_attn = t_ids.index_select(0, rows), t_attn.index_select(0, rows)
                L = t_ids.shape[1]
                with torch.no_grad():
                    teacher = _forward_logits(model, t_ids, t_attn)[:, L - T - 1 : -1]
            student_rows = student if all_rows else student.index_select(0, rows)
            sdpo = _sdpo_term(cfg, student_rows, teacher, token_mask.index_select(0, rows))

    replay = None
    if cfg.beta_replay != 0.0 and all(inputs.get(k) is not None for k in REPLAY_KEYS):
        c_ids = _require(inputs, "replay_chosen_input_ids")
        r_ids = _require(inputs, "replay_rejected_input_ids")
        if c_ids.shape[0] != r_ids.shape[0]:
            raise ValueError(
                "replay_chosen_* and replay_rejected_* must hold the same number of pairs N"
            )
        if c_ids.shape[0] > 0:
            if cfg.dpo_variant == "dpo" and any(inputs.get(k) is None for k in REPLAY_REF_KEYS):
                raise ValueError(
                    "dpo_variant='dpo' needs inputs 'replay_ref_chosen_logps' and "
                    "'replay_ref_rejected_logps' (N,); provide them or use dpo_variant='simpo'"
                )
            c_sum, c_avg = _sequence_logps(
                model,
                c_ids,
                _require(inputs, "replay_chosen_attention_mask"),
                _require(inputs, "replay_chosen_loss_mask"),
            )
            r_sum, r_avg = _sequence_logps(
                model,
                r_ids,
                _require(inputs, "replay_rejected_attention_mask"),
                _require(inputs, "replay_rejected_loss_mask"),
            )
            simpo = cfg.dpo_variant == "simpo"
            replay = _replay_term(
                cfg,
                c_avg if simpo else c_sum,
                r_avg if simpo else r_sum,
                inputs.get("replay_ref_chosen_logps"),
                inputs.get("replay_ref_rejected_logps"),
                REPLAY_REF_KEYS,
            )
    return _assemble(cfg, grpo, sdpo, sdpo_frac, replay)
