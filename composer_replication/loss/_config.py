"""Validated keyword configuration of ``compose_loss`` / ``combine``.

The user settings are `loss_settings.LossSettings`' (the one list of loss settings, shared with
the TOML ``[loss]`` section and the trainer); this adds the two values a run sets rather than a
user (``temperature``: TRL samples and scores at one; ``taid_schedule_step``: the trainer's step)
and the rules across them. Validation happens once, at the edge, whatever channels are active in
a step: a misconfigured run fails on its first step, not the first step that happens to carry a
teacher. Immutable after construction (`loss_settings.WriteOnce`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypedDict

from composer_replication.loss import sdpo_wrappers
from composer_replication.loss._checks import check_scalar
from composer_replication.loss.loss_settings import (
    DpoVariant,
    LossSettings,
    SdpoWrapper,
    WriteOnce,
    _setting,
)
from composer_replication.loss.policy import LossType


@dataclasses.dataclass(kw_only=True)
class ComposeConfig(LossSettings, WriteOnce):
    """All ``compose_loss`` keywords with their defaults (see docs/api.md for each): the
    `LossSettings` and the run's ``temperature`` and ``taid_schedule_step``."""

    temperature: float = _setting(1.0, "sampling temperature of channel 1's log-probs")
    taid_schedule_step: int | None = _setting(
        None, "the trainer's step on the linear TAID schedule (with taid_total_steps)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # each setting's own check (loss_settings)
        check_scalar("temperature", self.temperature, low=0.0, low_open=True)
        if self.taid_schedule_step is not None:
            check_scalar("taid_schedule_step", self.taid_schedule_step, low=0)
        sdpo_wrappers.get(self.sdpo_wrapper).check(self)  # the wrapper's own rules

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, object]) -> ComposeConfig:
        """Build from ``**kwargs``; an unknown keyword is a ValueError naming it (the values are
        checked by ``__post_init__``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown compose_loss keyword(s): {', '.join(unknown)}")
        return cls(**kwargs)  # type: ignore[arg-type]


class ComposeKwargs(TypedDict, total=False):
    """The ``compose_loss`` keywords as ``**kwargs: Unpack[ComposeKwargs]`` (the `ComposeConfig`
    fields and their types; tests/loss/test_compose_kwargs.py holds the two equal). Each value
    is still checked at run time (`ComposeConfig.from_kwargs`)."""

    loss_type: LossType
    epsilon_low: float
    epsilon_high: float | None
    delta: float | None
    kl_beta: float
    alpha_sdpo: float
    beta_replay: float
    dpo_variant: DpoVariant
    replay_dpo_beta: float
    simpo_beta: float
    simpo_gamma: float
    label_smoothing: float
    rpo_alpha: float
    sdpo_jsd_beta: float
    sdpo_temperature: float
    sdpo_token_clip: float | None
    sdpo_top_k: int | None
    sdpo_add_tail: bool
    sdpo_wrapper: SdpoWrapper
    sdpo_max_context_length: int | None
    taid_t: float | None
    taid_total_steps: int | None
    entropy_opd_h_max: float
    temperature: float
    taid_schedule_step: int | None
