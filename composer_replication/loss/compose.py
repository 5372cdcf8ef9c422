"""The three-channel composer loss: ``grpo + alpha_sdpo * sdpo + beta_replay * replay``.

``compose_loss(model, inputs, **kw)`` runs the forward passes of a causal LM on the composer batch
described in ``docs/api.md`` (the one batch format) and adds up the channels. It is built from
two public per-channel terms, for trainers that compute channel 1 themselves (the TRL adapter
keeps TRL's own GRPO loss and adds these): ``sdpo_term(teacher, inputs, student_logits, **kw)``
and ``replay_term(model, inputs, student_logits, **kw)`` read the same batch and return the
channel's loss before its weight. ``combine(**tensors, **kw)`` is the tensor-level form for
adapters that hold log-probs/logits already. ``fused_sdpo_term(teacher_body, inputs,
student_hidden, weight, ...)`` is channel 2 from last hidden states through the output layer
(``fused.fused_linear_jsd``: no ``(B, T, V)`` logits), and ``fused_replay_term(body, inputs,
student_hidden, weight, ...)`` channel 3 alike (``fused.fused_linear_logps``). ``assemble(grpo, sdpo, replay, **kw)`` sums
channel results an adapter computed itself; it (and ``combine``, ``compose_loss``, which call it)
is the only place the total is formed.

Channels 2 (SDPO hint self-distillation) and 3 (trace replay DPO/SimPO) switch off for a step when
their inputs are absent, select nothing, or their weight is 0; their metrics then say so
(``sdpo/active = 0.0``, ``replay/active = 0.0``) and they contribute nothing. With
``alpha_sdpo = 0`` (or ``beta_replay = 0``) the total is bit-exactly the loss without that channel:
the channel is not computed at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Unpack

import torch
from torch import Tensor

from composer_replication.loss import _batch, sdpo_wrappers
from composer_replication.loss._channels import (
    Result,
    grpo_term,
    replay_preference,
    sample_token_mask,
    scaled,
    sdpo_divergence,
    weighted_total,
)
from composer_replication.loss._channels import assemble as _assemble
from composer_replication.loss._config import ComposeConfig, ComposeKwargs
from composer_replication.loss._logprobs import (
    CausalLM,
    HiddenStateLM,
    HiddenStatesAsLogits,
    forward_logits,
    selective_log_softmax,
    sequence_sums,
)
from composer_replication.loss.fused import fused_linear_jsd, fused_linear_logps

__all__ = [
    "ComposeConfig",
    "assemble",
    "combine",
    "compose_loss",
    "fused_replay_term",
    "fused_sdpo_term",
    "replay_term",
    "sdpo_term",
]


def assemble(
    grpo: Result,
    sdpo: Result | None = None,
    replay: Result | None = None,
    *,
    metrics: bool = True,
    **kwargs: Unpack[ComposeKwargs],
) -> tuple[Tensor, dict[str, float]]:
    """The composer total from channel results: ``grpo + alpha_sdpo * sdpo + beta_replay * replay``.

    Each channel is a ``(loss, metrics)`` pair before its weight (``grpo`` always; ``sdpo`` /
    ``replay`` None when the channel is off for this step: it is then not added at all, so a
    channel that is off changes nothing bit for bit). ``kwargs``: the ``compose_loss`` keywords
    (``alpha_sdpo``, ``beta_replay``, ...; ``ComposeConfig``). Returns ``(total, metrics)``: the
    channels' metrics merged, ``loss/grpo``, ``loss/total``, ``sdpo/active``, ``replay/active``
    and 0.0 for the metrics of a channel that is off, as ``compose_loss``. ``metrics=False``:
    the total and an empty dict, with no float conversion (no device synchronisation; for
    adapters that report tensor metrics themselves). This is where every trainer and recipe
    forms the total (``combine`` and ``compose_loss`` call it too).
    """
    cfg = ComposeConfig.from_kwargs(kwargs)
    if not metrics:
        total = weighted_total(
            cfg,
            grpo[0],
            None if sdpo is None else sdpo[0],
            None if replay is None else replay[0],
        )
        return total, {}
    return _assemble(cfg, grpo, sdpo, replay)


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
    chosen_lengths: Tensor | None = None,
    num_items_in_batch: int | Tensor | None = None,
    max_completion_length: int | None = None,
    sdpo_result: Result | None = None,
    **kwargs: Unpack[ComposeKwargs],
) -> tuple[Tensor, dict[str, float]]:
    """Tensor-level composer loss for adapters that already hold log-probs / logits.

    Channel 1 (always): ``per_token_logps``, ``completion_mask``, ``advantages`` (and optional
    ``old_per_token_logps``, ``ref_per_token_logps``, ``num_items_in_batch``,
    ``max_completion_length``), see ``policy.grpo_loss``.
    Channel 2: ``student_logits`` and ``teacher_logits`` ``(B, T, V)`` completion logits (raw, not
    divided by ``temperature``; ``sdpo_temperature`` applies), ``sdpo_mask`` ``(B,)`` sample mask or
    ``(B, T)`` token mask (None = all), combined with ``completion_mask``. Off when either logits
    tensor is None, nothing is selected, or ``alpha_sdpo == 0``. ``sdpo_result``: channel 2
    already computed by the caller, ``(loss, metrics)`` before ``alpha_sdpo`` (e.g. a sampled-token
    form, recipes/verl), used instead of the logits (not with them); off when ``alpha_sdpo == 0``.
    Channel 3: ``dpo_variant="dpo"`` reads ``chosen_logps``/``rejected_logps`` ``(N,)`` summed
    log-probs and needs ``ref_chosen_logps``/``ref_rejected_logps``; ``"simpo"`` reads
    ``chosen_avg_logps``/``rejected_avg_logps``. Off when they are None, N == 0, or
    ``beta_replay == 0``. ``rpo_alpha > 0`` also needs ``chosen_lengths`` ``(N,)``, the token
    count of each chosen completion (the NLL term is a token mean).
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
    if sdpo_result is not None and (student_logits is not None or teacher_logits is not None):
        raise ValueError(
            "pass channel 2 either as student_logits/teacher_logits or as sdpo_result, not both"
        )
    if cfg.alpha_sdpo != 0.0 and sdpo_result is not None:
        sdpo = (sdpo_result[0], dict(sdpo_result[1]))
    elif cfg.alpha_sdpo != 0.0 and student_logits is not None and teacher_logits is not None:
        token_mask = sample_token_mask(completion_mask, sdpo_mask)
        rows = token_mask.any(-1)
        if bool(rows.any()):
            sdpo = sdpo_divergence(cfg, student_logits, teacher_logits, token_mask)
            sdpo[1]["sdpo/frac_samples"] = float(rows.float().mean())
    replay = None
    if cfg.beta_replay != 0.0:
        if cfg.dpo_variant == "simpo":
            chosen, rejected = chosen_avg_logps, rejected_avg_logps
        else:
            chosen, rejected = chosen_logps, rejected_logps
        if chosen is not None and rejected is not None and chosen.numel() > 0:
            replay = replay_preference(
                cfg,
                chosen,
                rejected,
                ref_chosen_logps,
                ref_rejected_logps,
                ("ref_chosen_logps", "ref_rejected_logps"),
                chosen_lengths,
            )
    return _assemble(cfg, grpo, sdpo, replay)


def _sdpo(
    cfg: ComposeConfig,
    teacher: CausalLM,
    inputs: _batch.Batch,
    student_logits: Tensor,
    logits_to_keep: bool,
    share_prefix: bool = False,
) -> Result | None:
    if cfg.alpha_sdpo == 0.0:  # alpha 0: not even the teacher forward runs (bit-exact channel 1)
        return None
    rows = _batch.sdpo_rows(
        teacher,
        inputs,
        student_logits,
        logits_to_keep=logits_to_keep,
        share_prefix=share_prefix,
        max_context_length=cfg.sdpo_max_context_length,
    )
    if rows is None:
        return None
    loss, metrics = sdpo_divergence(cfg, rows.student, rows.teacher, rows.token_mask)
    metrics["sdpo/frac_samples"] = rows.frac
    return scaled((loss, metrics), rows.token_mask.sum(), rows.normaliser)


def _replay(
    cfg: ComposeConfig,
    model: CausalLM,
    inputs: _batch.Batch,
    student_logits: Tensor | None,
    logits_to_keep: bool,
    score: _batch.Scorer = _batch.score_each,
) -> Result | None:
    if cfg.beta_replay == 0.0:
        return None
    pairs = _batch.replay_pairs(
        model,
        inputs,
        student_logits,
        cfg.dpo_variant,
        logits_to_keep=logits_to_keep,
        score=score,
    )
    if pairs is None:
        return None
    result = replay_preference(
        cfg,
        pairs.chosen,
        pairs.rejected,
        pairs.ref_chosen,
        pairs.ref_rejected,
        _batch.REPLAY_REF_KEYS,
        pairs.chosen_tokens,
    )
    return scaled(result, torch.tensor(float(pairs.chosen.shape[0])), pairs.normaliser)


def _max_length(inputs: _batch.Batch) -> int | None:
    value = _batch.optional_count(inputs, "max_completion_length")
    return int(value) if isinstance(value, Tensor) else value


def _check_inputs(inputs: object) -> _batch.Batch:
    if not isinstance(inputs, Mapping):
        raise ValueError(f"inputs must be a mapping of tensors, got {type(inputs).__name__}")
    return inputs


def sdpo_term(
    teacher: CausalLM,
    inputs: _batch.Batch,
    student_logits: Tensor,
    *,
    logits_to_keep: bool = False,
    share_prefix: bool = False,
    **kwargs: Unpack[ComposeKwargs],
) -> tuple[Tensor, dict[str, float]] | None:
    """Channel 2 of the composer batch (docs/api.md), before its weight ``alpha_sdpo``.

    ``student_logits``: ``(B, T, V)`` raw completion logits of the channel-1 forward (with
    gradient; ``compose_loss`` passes ``logits[:, P-1:-1]``). ``teacher`` scores the hinted
    contexts ``sdpo_teacher_input_ids`` under ``torch.no_grad()``, on the selected rows only
    (``compose_loss`` passes its own model; a trainer may pass an EMA copy); unused when
    ``sdpo_teacher_logits`` is given. ``logits_to_keep=True``: the teacher accepts Hugging Face's
    ``logits_to_keep`` and computes the completion positions' logits only. ``share_prefix=True``:
    the teacher is a Hugging Face causal LM (``position_ids``, ``past_key_values``,
    ``use_cache``); context prefixes that several rows share (a group's prompt, hint template
    and sibling solution) run once and their key/value cache is reused for the rest of each row;
    the logits equal the unshared forward's up to float rounding, and it falls back to that
    forward when sharing would not save tokens or the teacher fills no cache.

    Returns None when the channel is off (``alpha_sdpo == 0``, keys absent, nothing selected),
    else ``(loss, metrics)``: the divergence's token mean over the selected tokens, or, when
    ``sdpo_num_tokens`` is in ``inputs``, their sum divided by it; metrics ``loss/sdpo`` (the
    token mean), ``sdpo/frac_samples`` and the divergence's own (``jsd/*``, ``taid/*``,
    ``eopd/*``). ``kwargs``: the ``compose_loss`` keywords.
    """
    cfg = ComposeConfig.from_kwargs(kwargs)
    return _sdpo(cfg, teacher, _check_inputs(inputs), student_logits, logits_to_keep, share_prefix)


def fused_sdpo_term(
    teacher: HiddenStateLM,
    inputs: _batch.Batch,
    student_hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    teacher_weight: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    share_prefix: bool = False,
    backend: str = "auto",
    **kwargs: Unpack[ComposeKwargs],
) -> tuple[Tensor, dict[str, float]] | None:
    """``sdpo_term`` fused with the output layer: the same channel 2 from last hidden states.

    ``student_hidden``: ``(B, T, H)`` the student's last hidden states at the completion
    positions (the output layer's input for ``logits[:, P-1:-1]``), with gradient; ``weight`` /
    ``bias``: its output layer (``lm_head``; tied or not), which gets a gradient. ``teacher``:
    the teacher's body (`HiddenStateLM`, e.g. ``model.base_model`` of a Hugging Face causal LM),
    run under ``torch.no_grad()`` on the hinted contexts of the selected rows exactly as
    ``sdpo_term`` runs the teacher (``share_prefix`` too); its output layer is ``teacher_weight``
    / ``teacher_bias`` (default: the student's, without gradient: the same model). The divergence
    is ``fused.fused_linear_jsd`` (``backend``: its backend), so neither side's ``(B, T, V)``
    logits are built. Equal to ``sdpo_term`` on the logits ``student_hidden @ weight.T + bias``
    up to float rounding, with the same result and metrics.

    Only the full-vocabulary generalized JSD is fused: ``sdpo_wrapper`` other than "none", or
    ``sdpo_top_k``, is a ValueError (use ``sdpo_term``), and so is a batch carrying
    ``sdpo_teacher_logits`` (precomputed logits: use ``sdpo_term``).
    """
    cfg = ComposeConfig.from_kwargs(kwargs)
    inputs = _check_inputs(inputs)
    if not sdpo_wrappers.get(cfg.sdpo_wrapper).fused_ok or cfg.sdpo_top_k is not None:
        raise ValueError(
            "fused_sdpo_term computes the full-vocabulary generalized JSD only; with "
            f"sdpo_wrapper={cfg.sdpo_wrapper!r} or sdpo_top_k={cfg.sdpo_top_k!r} use sdpo_term on "
            "the logits"
        )
    if cfg.alpha_sdpo == 0.0:
        return None
    if inputs.get("sdpo_teacher_logits") is not None:
        raise ValueError(
            "inputs carry sdpo_teacher_logits (precomputed teacher logits); fused_sdpo_term needs "
            "the teacher's hidden states: use sdpo_term for this batch"
        )
    rows = _batch.sdpo_rows(
        HiddenStatesAsLogits(teacher),
        inputs,
        student_hidden,
        logits_to_keep=False,
        share_prefix=share_prefix,
        max_context_length=cfg.sdpo_max_context_length,
    )
    if rows is None:
        return None
    loss, metrics = fused_linear_jsd(
        rows.student,
        rows.teacher,
        weight,
        bias,
        teacher_weight=teacher_weight,
        teacher_bias=teacher_bias,
        beta=cfg.sdpo_jsd_beta,
        temperature=cfg.sdpo_temperature,
        mask=rows.token_mask,
        token_clip=cfg.sdpo_token_clip,
        backend=backend,
    )
    metrics["loss/sdpo"] = float(loss.detach())
    metrics["sdpo/frac_samples"] = rows.frac
    return scaled((loss, metrics), rows.token_mask.sum(), rows.normaliser)


def replay_term(
    model: CausalLM,
    inputs: _batch.Batch,
    student_logits: Tensor | None = None,
    *,
    logits_to_keep: bool = False,
    **kwargs: Unpack[ComposeKwargs],
) -> tuple[Tensor, dict[str, float]] | None:
    """Channel 3 of the composer batch (docs/api.md), before its weight ``beta_replay``.

    ``model``: the policy; the chosen side runs through it with gradient. Rollout pairs
    (``replay_pair_mask``, ...) score their rejected side from ``student_logits`` (``(B, T, V)``
    raw completion logits of the channel-1 forward, required for that form; no extra forward);
    explicit pairs (``replay_chosen_input_ids``, ...) run one forward per side.
    ``logits_to_keep=True``: ``model`` accepts Hugging Face's ``logits_to_keep``.

    Returns None when the channel is off (``beta_replay == 0``, keys absent, no pair), else
    ``(loss, metrics)``: the DPO/SimPO mean over the pairs, or, when ``replay_num_pairs`` is in
    ``inputs``, their sum divided by it; metrics ``loss/replay`` (the mean) and ``replay/*``.
    """
    cfg = ComposeConfig.from_kwargs(kwargs)
    return _replay(cfg, model, _check_inputs(inputs), student_logits, logits_to_keep)


def fused_replay_term(
    model: HiddenStateLM,
    inputs: _batch.Batch,
    student_hidden: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    **kwargs: Unpack[ComposeKwargs],
) -> tuple[Tensor, dict[str, float]] | None:
    """``replay_term`` fused with the output layer: the same channel 3 from last hidden states.

    ``model``: the policy's body (`HiddenStateLM`, e.g. ``model.base_model`` of a Hugging Face
    causal LM); the chosen side (and both sides of explicit pairs) runs through it with gradient.
    ``student_hidden``: ``(B, T, H)`` the channel-1 forward's last hidden states at the
    completion positions (the output layer's input for ``logits[:, P-1:-1]``), with gradient;
    the rejected side of rollout pairs is scored from them (required for that form).
    ``weight`` / ``bias``: the policy's output layer (``lm_head``; tied or not), which gets a
    gradient. Every log-prob is ``fused.fused_linear_logps``, so no side's ``(N, T, V)`` logits
    are built. Equal to ``replay_term`` on the logits ``hidden @ weight.T + bias`` up to float
    rounding, with the same result and metrics (``dpo`` / ``simpo``, ``rpo_alpha``).
    """
    cfg = ComposeConfig.from_kwargs(kwargs)
    inputs = _check_inputs(inputs)
    if weight is None:
        raise ValueError("fused_replay_term needs weight, the output layer's (V, H) weight")
    if student_hidden is not None and student_hidden.dim() != 3:
        raise ValueError(
            "student_hidden must be the (B, T, H) last hidden states of the channel-1 forward at "
            f"the completion positions, got shape {tuple(student_hidden.shape)}"
        )
    head_weight = weight

    def score(sides: Sequence[_batch.ScoredSide]) -> list[tuple[Tensor, Tensor]]:
        # Both sides' selected positions in one output-layer pass: one weight gradient, not two.
        masks = [mask.bool() for _, _, mask in sides]
        rows = [hidden[m] for (hidden, _, _), m in zip(sides, masks, strict=True)]
        ids = [tokens[m] for (_, tokens, _), m in zip(sides, masks, strict=True)]
        packed = fused_linear_logps(torch.cat(rows)[None], head_weight, bias, torch.cat(ids)[None])
        parts = torch.split(packed[0], [r.shape[0] for r in rows])
        out = []
        for m, part, (_, _, mask) in zip(masks, parts, sides, strict=True):
            per_token = part.new_zeros(m.shape).masked_scatter(m, part)
            out.append(sequence_sums(per_token, mask))
        return out

    return _replay(cfg, HiddenStatesAsLogits(model), inputs, student_hidden, False, score)


def compose_loss(
    model: CausalLM, inputs: _batch.Batch, **kwargs: Unpack[ComposeKwargs]
) -> tuple[Tensor, dict[str, float]]:
    """Three-channel composer loss on one micro-batch; see ``docs/api.md`` for ``inputs``.

    ``model`` is a causal LM called as ``model(input_ids=..., attention_mask=...)`` returning
    ``.logits``. Channel 1's student forward is ONE call on ``cat(prompt_ids, completion_ids)``;
    completion logits are ``logits[:, P-1:-1]``, divided by ``temperature`` for the channel-1
    log-probs; the same (undivided) logits are the channel-2 student, where
    ``sdpo_temperature`` applies to student and teacher alike. The channel-2 teacher forward runs
    under ``torch.no_grad()`` on the selected rows only (or uses ``sdpo_teacher_logits``).
    Channel 3: explicit pairs run one forward per side with gradient; rollout pairs run one
    forward on the chosen side and score the rejected side from the channel-1 logits.
    Channels 2 and 3 are ``sdpo_term`` and ``replay_term`` on the same batch.

    Keywords: the ``ComposeConfig`` fields, with its defaults (docs/api.md lists them).

    Returns ``(loss, metrics)``: 0-dim ``grpo + alpha_sdpo * sdpo + beta_replay * replay`` and a
    dict of python floats (``loss/*``, ``grpo/*``, ``sdpo/*``, ``replay/*``, ``taid/t``, ...).
    """
    inputs = _check_inputs(inputs)
    cfg = ComposeConfig.from_kwargs(kwargs)
    prompt_ids, prompt_mask, completion_ids, completion_mask, advantages = _batch.channel1(inputs)
    P = prompt_ids.shape[1]
    logits = forward_logits(
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
        _batch.optional_tensor(inputs, "old_per_token_logps"),
        _batch.optional_tensor(inputs, "ref_per_token_logps"),
        _batch.optional_count(inputs, "num_items_in_batch"),
        _max_length(inputs),
    )

    sdpo = _sdpo(cfg, model, inputs, student, False)
    replay = _replay(cfg, model, inputs, student, False)
    return _assemble(cfg, grpo, sdpo, replay)
