"""The composer loss as a PRIME-RL 0.8 custom loss: ``loss_fn(inputs, **kwargs) -> LossOutputs``.

Wire it in PRIME-RL's trainer config (the import path is DOTTED: PRIME-RL's ``import_object``
splits at the last ``.``; the ``module:function`` spelling does not resolve there)::

    [trainer.loss]
    type = "custom"
    import_path = "composer_replication.recipes.prime_rl.composer_loss.loss_fn"

    [trainer.loss.kwargs]
    mask = "prob_diff"        # or "log_ratio" (the seeds' [-4, 4]) or "both"
    alpha_sdpo = 0.1

PRIME-RL calls ``loss_fn`` once per sample with 1-D ``(seq,)`` tensors and divides the summed
result by the global count of rl tokens. Per token ``t`` of ``loss_mask`` (weights ``w_t`` =
``loss_weights`` or 1), with ``r_t = exp(lp_t - lp_inf_t)``:

- channel 1, PRIME-RL's DPPO + KL: ``-keep1_t * adv_tau * A_t * r_t + kl_tau * log(r_t)^2``, where
  ``keep1`` is ``loss.dppo_mask`` with the advantage as its sign: ``mask = "prob_diff"`` (PRIME-RL's
  default, ``dppo_mask_low``/``dppo_mask_high`` = 0.2 on ``exp(lp) - exp(lp_inf)``),
  ``"log_ratio"`` (drop tokens whose ``lp - lp_inf`` is outside
  ``[log_ratio_low, log_ratio_high]`` = [-4, 4]) or ``"both"``. With the defaults and no
  reference log-probs this is exactly PRIME-RL's default loss.
- channel 2, when ``inputs.ref_logprobs`` is present and ``alpha_sdpo != 0``: the sampled-token
  reverse KL to the reference/teacher as a policy gradient,
  ``alpha_sdpo * -keep2_t * sg(lp_ref_t - lp_t) * r_t``; ``keep2`` is the same DPPO mask with
  ``lp_ref - lp`` as the per-token advantage. On-policy (``r = 1``) its value is the sampled
  estimate of ``KL(policy || reference)`` and its gradient that of the reverse KL.
- channel 3, when pair tensors are passed and ``beta_replay != 0``: the loss library's
  ``replay_preference`` (its settings are this config's ``SampledTokenSettings``): ``loss.dpo_loss``
  (``dpo_variant = "dpo"``: ``chosen_logps``, ``rejected_logps``, ``ref_chosen_logps``,
  ``ref_rejected_logps``, each ``(N,)`` summed log-probs) or ``loss.simpo_loss`` (``"simpo"``:
  ``chosen_avg_logps``, ``rejected_avg_logps``; with ``rpo_alpha > 0`` also ``chosen_lengths``,
  each chosen completion's token count), mean over the N pairs, added as
  ``beta_replay * L_replay * n`` with ``n = sum_t w_t`` (the sample's token weight), so that after
  PRIME-RL's division by the token count it carries weight ``beta_replay`` like a token mean.
  Tensors cannot come from TOML: they are keyword arguments at call time (see docs/recipes/prime_rl.md).

The result is ``sum_t w_t * (channel-1 + channel-2 terms) + channel 3`` (0-dim; 0 with a gradient
path for an empty mask). Metrics are 0-dim tensors with the same keys on every call: PRIME-RL's
default-loss names (``is_masked``, ``is_masked_low``, ``is_masked_high``, ``masked_mismatch_kl``,
``unmasked_mismatch_kl``) plus ``loss/dppo``, ``loss/sdpo``, ``loss/replay``, ``sdpo/active``,
``sdpo/reverse_kl``, ``sdpo/is_masked``, ``replay/active``, ``replay/pairs``, ``replay/accuracy``,
``replay/margin``.

Bad kwargs (unknown names, ``compose_loss`` keywords that need logits, out-of-range values,
incomplete pairs, non-tensor pairs) and bad inputs (not 1-D, shapes differ) raise ``ValueError``
naming what is wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

from composer_replication.loss import (
    SampledTokenSettings,
    WriteOnce,
    assemble,
    dppo_mask,
    replay_preference,
)
from composer_replication.recipes.prime_rl.contract import PRIME_RL_DEFAULT_LOSS, LossOutputs
from composer_replication.recipes.sampled import reject_logit_keywords

MASKS = ("prob_diff", "log_ratio", "both")


class _LossInputs(Protocol):
    """What `loss_fn` reads of its ``inputs``: PRIME-RL's ``LossInputs`` (a pydantic model) or
    this package's mirror (`contract.LossInputs`); each value is checked (`_vector`)."""

    @property
    def trainer_logprobs(self) -> Tensor: ...
    @property
    def inference_logprobs(self) -> Tensor: ...
    @property
    def ref_logprobs(self) -> Tensor | None: ...
    @property
    def advantages(self) -> Tensor: ...
    @property
    def loss_mask(self) -> Tensor: ...
    @property
    def loss_weights(self) -> Tensor | None: ...


DPO_PAIR_KEYS = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
SIMPO_PAIR_KEYS = ("chosen_avg_logps", "rejected_avg_logps")
# (N,) token count of each chosen completion: needed by rpo_alpha's NLL (a token mean)
PAIR_KEYS = DPO_PAIR_KEYS + SIMPO_PAIR_KEYS + ("chosen_lengths",)


@dataclasses.dataclass(kw_only=True)
class PrimeRLLossConfig(SampledTokenSettings, WriteOnce):
    """The TOML-settable ``[trainer.loss.kwargs]`` of ``loss_fn``, validated and immutable.

    The composer settings are the loss library's ``SampledTokenSettings`` (inherited: default,
    type, check and help declared once, in loss/loss_settings.py); the fields below are PRIME-RL's
    channel 1 (its DPPO loss, defaults from its ``DefaultLossConfig``)."""

    mask: str = "prob_diff"
    dppo_mask_low: float = PRIME_RL_DEFAULT_LOSS["dppo_mask_low"]
    dppo_mask_high: float = PRIME_RL_DEFAULT_LOSS["dppo_mask_high"]
    log_ratio_low: float = -4.0
    log_ratio_high: float = 4.0
    adv_tau: float = PRIME_RL_DEFAULT_LOSS["adv_tau"]
    kl_tau: float = PRIME_RL_DEFAULT_LOSS["kl_tau"]

    def __post_init__(self) -> None:
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {', '.join(MASKS)}, got {self.mask!r}")
        for name in ("dppo_mask_low", "dppo_mask_high", "adv_tau", "kl_tau"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("log_ratio_low", "log_ratio_high"):
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if self.log_ratio_low >= self.log_ratio_high:
            raise ValueError(
                f"log_ratio_low ({self.log_ratio_low}) must be below log_ratio_high "
                f"({self.log_ratio_high})"
            )
        SampledTokenSettings.__post_init__(self)  # the composer settings' own checks

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> PrimeRLLossConfig:
        """Build from ``[trainer.loss.kwargs]``; unknown or inapplicable names raise ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        reject_logit_keywords(
            kwargs,
            "PRIME-RL",
            "PRIME-RL's DPPO loss (set mask, dppo_mask_low, dppo_mask_high, log_ratio_low, "
            "log_ratio_high, adv_tau, kl_tau instead)",
        )
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(
                f"unknown [trainer.loss.kwargs] key(s) for the composer PRIME-RL loss: "
                f"{', '.join(unknown)}; accepted: {', '.join(sorted(names))} (and the channel-3 "
                f"pair tensors {', '.join(PAIR_KEYS)} at call time)"
            )
        return cls(**kwargs)

    def mask_kwargs(self) -> dict[str, float | None]:
        """Keyword arguments of ``loss.dppo_mask`` for the chosen mask."""
        prob = self.mask in ("prob_diff", "both")
        ratio = self.mask in ("log_ratio", "both")
        return {
            "prob_diff_low": self.dppo_mask_low if prob else None,
            "prob_diff_high": self.dppo_mask_high if prob else None,
            "log_ratio_low": self.log_ratio_low if ratio else None,
            "log_ratio_high": self.log_ratio_high if ratio else None,
        }


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _vector(name: str, value: object, like: Tensor | None = None) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"inputs.{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 1:
        raise ValueError(
            f"inputs.{name} must be 1-D (seq,): PRIME-RL calls the loss once per sample; "
            f"got shape {tuple(value.shape)}"
        )
    if like is not None and value.shape != like.shape:
        raise ValueError(
            f"inputs.{name} has shape {tuple(value.shape)} but inputs.trainer_logprobs has "
            f"{tuple(like.shape)}; every per-token tensor of a sample must have the same length"
        )
    return value


def _split_pairs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    config = {k: v for k, v in kwargs.items() if k not in PAIR_KEYS}
    pairs: dict[str, Tensor] = {}
    for key in PAIR_KEYS:
        if key in kwargs and kwargs[key] is not None:
            if not isinstance(kwargs[key], Tensor):
                raise ValueError(
                    f"{key} must be a (N,) tensor passed to loss_fn at call time (it holds the "
                    f"current policy's log-probs of the replay pairs); it cannot be set in "
                    f"[trainer.loss.kwargs], got {type(kwargs[key]).__name__}"
                )
            pairs[key] = kwargs[key]
    return config, pairs


def _replay(cfg: PrimeRLLossConfig, pairs: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
    wanted, other = (
        (SIMPO_PAIR_KEYS, DPO_PAIR_KEYS[:2])
        if cfg.dpo_variant == "simpo"
        else (DPO_PAIR_KEYS, SIMPO_PAIR_KEYS)
    )
    stray = [k for k in other if k in pairs and k not in wanted]
    if stray:
        raise ValueError(
            f"{', '.join(stray)} given but dpo_variant={cfg.dpo_variant!r} reads "
            f"{', '.join(wanted)}; pass the pair tensors of the chosen variant"
        )
    missing = [k for k in wanted if k not in pairs]
    if missing:
        raise ValueError(
            f"channel 3 ({cfg.dpo_variant}) got {', '.join(k for k in wanted if k in pairs)} "
            f"but not {', '.join(missing)}; pass all of {', '.join(wanted)}"
        )
    # the loss library's channel 3, with this config's sampled-token settings
    loss, m = replay_preference(
        cfg,
        pairs[wanted[0]],
        pairs[wanted[1]],
        pairs.get("ref_chosen_logps"),
        pairs.get("ref_rejected_logps"),
        ("ref_chosen_logps", "ref_rejected_logps"),
        pairs.get("chosen_lengths"),
    )
    return loss, {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("replay/")}


def _mean(values: Tensor, mask: Tensor) -> Tensor:
    # PRIME-RL's metric convention: mean over a boolean mask, 0 when the mask is empty.
    return torch.where(mask, values, torch.zeros_like(values)).sum() / mask.sum().clamp(min=1)


def loss_fn(inputs: _LossInputs, **kwargs: Any) -> LossOutputs:
    """Composer loss of ONE PRIME-RL sample; see the module docstring for every term.

    Args:
        inputs: PRIME-RL's ``LossInputs`` (or this package's mirror): 1-D ``trainer_logprobs``,
            ``inference_logprobs``, ``ref_logprobs`` (or None), ``advantages``, ``loss_mask``,
            ``loss_weights`` (or None).
        kwargs: the ``[trainer.loss.kwargs]`` settings (``PrimeRLLossConfig``) and, at call time
            only, the channel-3 pair tensors (``chosen_logps`` ... ``rejected_avg_logps``).

    Returns:
        ``LossOutputs(loss, metrics)``: the 0-dim loss SUM and 0-dim tensor metrics.
    """
    config, pairs = _split_pairs(kwargs)
    cfg = PrimeRLLossConfig.from_kwargs(config)
    lp = _vector("trainer_logprobs", inputs.trainer_logprobs)
    inf = _vector("inference_logprobs", inputs.inference_logprobs, lp)
    adv = _vector("advantages", inputs.advantages, lp)
    mask = _vector("loss_mask", inputs.loss_mask, lp).bool()
    ref = None if inputs.ref_logprobs is None else _vector("ref_logprobs", inputs.ref_logprobs, lp)
    weights = (
        None if inputs.loss_weights is None else _vector("loss_weights", inputs.loss_weights, lp)
    )

    # Positions outside the mask may hold anything (padding); zero them before any arithmetic.
    zero = torch.zeros_like(lp)
    lp_m = torch.where(mask, lp, zero)
    inf_m = torch.where(mask, inf.to(lp.dtype), zero)
    adv_m = torch.where(mask, adv.to(lp.dtype), zero)
    log_ratio = lp_m - inf_m
    ratio = torch.exp(log_ratio)
    mask_kw = cfg.mask_kwargs()

    keep1 = dppo_mask(lp_m, inf_m, mask, advantages=adv_m, **mask_kw)
    per_token = -(keep1 * cfg.adv_tau * adv_m * ratio) + cfg.kl_tau * log_ratio.pow(2)
    dppo_sum = torch.where(mask, per_token if weights is None else per_token * weights, zero).sum()

    sdpo_active = ref is not None and cfg.alpha_sdpo != 0.0
    sdpo_sum = zero.sum() * 0.0
    reverse_kl = zero.sum().detach()
    sdpo_masked = zero.sum().detach()
    if sdpo_active:
        assert ref is not None
        ref_m = torch.where(mask, ref.to(lp.dtype), zero)
        signal = (ref_m - lp_m).detach()  # per-token advantage of the reverse KL
        keep2 = dppo_mask(lp_m, inf_m, mask, advantages=signal, **mask_kw)
        sdpo_tok = -(keep2 * signal * ratio)
        sdpo_sum = torch.where(
            mask, sdpo_tok if weights is None else sdpo_tok * weights, zero
        ).sum()
        reverse_kl = _mean(-signal, mask)
        sdpo_masked = _mean((mask & ~keep2).to(lp.dtype), mask)

    n_weight = (
        mask.to(lp.dtype).sum() if weights is None else torch.where(mask, weights, zero).sum()
    )

    replay_metrics = {"pairs": 0.0, "accuracy": 0.0, "margin": 0.0}
    if cfg.rpo_alpha != 0.0:  # channel 3's NLL term (its token mean), as the trainer reports it
        replay_metrics["nll"] = 0.0
    replay_value = 0.0
    replay_term: tuple[Tensor, dict[str, float]] | None = None
    replay_active = cfg.beta_replay != 0.0 and bool(pairs)
    if replay_active:
        replay_loss, m = _replay(cfg, pairs)
        replay_active = m["pairs"] > 0
        if replay_active:
            # the pair mean times n = the sample's token weight (module docstring)
            replay_term = (replay_loss * n_weight.detach(), {})
            replay_value = float(replay_loss.detach())
            replay_metrics = {k: m[k] for k in replay_metrics}
    # the total is the loss library's: dppo + alpha_sdpo * sdpo + beta_replay * replay
    total, _ = assemble(
        (dppo_sum, {}),
        (sdpo_sum, {}) if sdpo_active else None,
        replay_term,
        metrics=False,  # LossOutputs' metrics are tensors: no host synchronisation here
        alpha_sdpo=cfg.alpha_sdpo,
        beta_replay=cfg.beta_replay,
    )

    with torch.no_grad():
        mismatch_kl = ratio - log_ratio - 1
        invalid = mask & ~keep1
        n = mask.sum().clamp(min=1)
        metrics = {
            "masked_mismatch_kl": _mean(mismatch_kl, invalid),
            "unmasked_mismatch_kl": _mean(mismatch_kl, keep1),
            "is_masked": _mean(invalid.to(lp.dtype), mask),
            "is_masked_low": _mean((invalid & (adv_m < 0)).to(lp.dtype), mask),
            "is_masked_high": _mean((invalid & (adv_m > 0)).to(lp.dtype), mask),
            "loss/dppo": dppo_sum.detach() / n,
            "loss/sdpo": sdpo_sum.detach() / n,
            "loss/replay": torch.tensor(replay_value, dtype=lp.dtype, device=lp.device),
            "sdpo/active": torch.tensor(float(sdpo_active), device=lp.device),
            "sdpo/reverse_kl": reverse_kl,
            "sdpo/is_masked": sdpo_masked,
            "replay/active": torch.tensor(float(replay_active), device=lp.device),
        }
        for key, value in replay_metrics.items():
            metrics[f"replay/{key}"] = torch.tensor(value, dtype=lp.dtype, device=lp.device)
    return LossOutputs(loss=total, metrics=metrics)
