"""Validated keyword configuration of ``compose_loss`` / ``combine`` (one frozen dataclass).

Validation happens once, at the edge, whatever channels are active in a step: a misconfigured
run fails on its first step, not the first step that happens to carry a teacher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal, get_args

from composer_replication.loss._checks import check_choice, check_scalar
from composer_replication.loss.distill import DEFAULT_ENTROPY_OPD_H_MAX, TAID_T_END, TAID_T_START
from composer_replication.loss.policy import LOSS_TYPES

SdpoWrapper = Literal["none", "taid", "entropy_opd"]
DpoVariant = Literal["dpo", "simpo"]
SDPO_WRAPPERS: tuple[SdpoWrapper, ...] = get_args(SdpoWrapper)
DPO_VARIANTS: tuple[DpoVariant, ...] = get_args(DpoVariant)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComposeConfig:
    """All ``compose_loss`` keywords with their defaults (see docs/api.md for each)."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    kl_beta: float = 0.0
    temperature: float = 1.0
    alpha_sdpo: float = 0.1
    beta_replay: float = 0.05
    sdpo_jsd_beta: float = 0.5
    sdpo_temperature: float = 1.0
    sdpo_token_clip: float | None = None
    sdpo_top_k: int | None = None
    sdpo_add_tail: bool = True
    sdpo_wrapper: str = "none"
    sdpo_max_context_length: int | None = None
    taid_t: float | None = None
    taid_schedule_step: int | None = None
    taid_total_steps: int | None = None
    entropy_opd_h_max: float = DEFAULT_ENTROPY_OPD_H_MAX
    replay_dpo_beta: float = 0.1
    dpo_variant: str = "dpo"
    simpo_beta: float = 2.0
    simpo_gamma: float = 1.0
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("sdpo_wrapper", self.sdpo_wrapper, SDPO_WRAPPERS)
        check_choice("dpo_variant", self.dpo_variant, DPO_VARIANTS)
        check_scalar("epsilon_low", self.epsilon_low, low=0.0, high=1.0, high_open=True)
        if self.epsilon_high is not None:
            check_scalar("epsilon_high", self.epsilon_high, low=0.0)
        if self.delta is not None:
            check_scalar("delta", self.delta, low=1.0, low_open=True)
        check_scalar("kl_beta", self.kl_beta, low=0.0)
        check_scalar("temperature", self.temperature, low=0.0, low_open=True)
        check_scalar("alpha_sdpo", self.alpha_sdpo)
        check_scalar("beta_replay", self.beta_replay)
        check_scalar("sdpo_jsd_beta", self.sdpo_jsd_beta, low=0.0, high=1.0)
        check_scalar("sdpo_temperature", self.sdpo_temperature, low=0.0, low_open=True)
        if self.sdpo_token_clip is not None:
            check_scalar("sdpo_token_clip", self.sdpo_token_clip, low=0.0, low_open=True)
        if self.sdpo_top_k is not None and (
            isinstance(self.sdpo_top_k, bool)
            or not isinstance(self.sdpo_top_k, int)
            or self.sdpo_top_k < 1
        ):
            raise ValueError(f"sdpo_top_k must be a positive int or None, got {self.sdpo_top_k!r}")
        cap = self.sdpo_max_context_length
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(
                f"sdpo_max_context_length must be a positive int or None (no cap), got {cap!r}"
            )
        check_scalar("entropy_opd_h_max", self.entropy_opd_h_max, low=0.0)
        check_scalar("replay_dpo_beta", self.replay_dpo_beta, low=0.0, low_open=True)
        check_scalar("simpo_beta", self.simpo_beta, low=0.0, low_open=True)
        check_scalar("simpo_gamma", self.simpo_gamma, low=0.0)
        check_scalar("label_smoothing", self.label_smoothing, low=0.0, high=0.5, high_open=True)
        if self.taid_t is not None:
            check_scalar("taid_t", self.taid_t, low=0.0, high=1.0)
        if self.taid_schedule_step is not None:
            check_scalar("taid_schedule_step", self.taid_schedule_step, low=0)
        if self.taid_total_steps is not None:
            check_scalar("taid_total_steps", self.taid_total_steps, low=0, low_open=True)
        if self.sdpo_wrapper == "taid":
            if self.taid_t is None and self.taid_schedule_step is None:
                raise ValueError(
                    "sdpo_wrapper='taid' needs taid_t (the interpolation coefficient in [0, 1]) or "
                    "taid_schedule_step with taid_total_steps (linear "
                    f"{TAID_T_START} -> {TAID_T_END} schedule)"
                )
            if self.taid_t is None and self.taid_total_steps is None:
                raise ValueError("taid_schedule_step is given without taid_total_steps; pass both")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, object]) -> ComposeConfig:
        """Build from ``**kwargs``; an unknown keyword is a ValueError naming it (the values are
        checked by ``__post_init__``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown compose_loss keyword(s): {', '.join(unknown)}")
        return cls(**kwargs)  # type: ignore[arg-type]


def taid_t_for(cfg: ComposeConfig) -> float:
    """TAID t: ``taid_t`` if given, else linear ``TAID_T_START -> TAID_T_END`` over
    ``taid_schedule_step / taid_total_steps``."""
    if cfg.taid_t is not None:
        return float(cfg.taid_t)
    assert cfg.taid_schedule_step is not None and cfg.taid_total_steps is not None
    progress = min(float(cfg.taid_schedule_step) / float(cfg.taid_total_steps), 1.0)
    return TAID_T_START + (TAID_T_END - TAID_T_START) * progress
