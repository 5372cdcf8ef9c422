"""The one list of loss settings: each declared once, with its type, default, check and help.

Three bases: `Channel1Settings` (channel 1), `SampledTokenSettings` (the weights of channels 2
and 3 and channel 3's preference loss: what works on sampled-token log-probs alone) and
`Channel23Settings` (those and channel 2's full-vocabulary settings); `LossSettings` is channel 1's
and channels 2-3's. Five surfaces take a loss setting from a user, and each gets these fields by
inheritance (so mypy and an IDE see every field with its type):

- ``ComposeConfig`` (``compose_loss`` / ``combine`` keywords): `LossSettings`, plus the values
  a run sets rather than a user (``temperature``, ``taid_schedule_step``);
- ``loss_section.LossConfig`` (the TOML ``[loss]`` section): `LossSettings`, its keys exactly;
- ``trainer.ComposerSettings`` (``ComposerReplicationTrainer`` keywords) and
  ``trainer.ComposerConfig`` (a TRL ``GRPOConfig``, for ``HfArgumentParser``): `Channel23Settings`
  (channel 1 is TRL's own loss, configured by ``GRPOConfig``'s fields);
- ``recipes.prime_rl.PrimeRLLossConfig`` (PRIME-RL's ``[trainer.loss.kwargs]``):
  `SampledTokenSettings` (channel 1 is PRIME-RL's DPPO loss, and only sampled-token log-probs
  reach a custom loss); the verl recipe's settings are ``recipes.sampled.SAMPLED_TOKEN_KEYS``,
  these fields' names.

Adding a setting is one field here, ``_setting(default, help)`` with a precise type, and its
check in the class's ``__post_init__`` (a ``ValueError`` whose message starts with the name:
``LossConfig`` rewords it as ``loss.<name>: ...``). The surfaces pick it up: ``LossConfig`` as a
TOML key (docs/cli.md is generated from the help), the trainer as a keyword and a command-line
flag, ``compose_loss`` as a keyword, and, for a `SampledTokenSettings` field, the PRIME-RL and
verl recipes as a loss keyword; the docs' keyword tables (docs/api.md, docs/trainer.md, the
recipes' pages) are checked against these fields by tests, so the table row is the one other line
to write.

Mutable dataclasses, on purpose: TRL's ``GRPOConfig`` is a mutable dataclass, and a frozen
dataclass can neither inherit a mutable one nor be inherited by one, so the bases that
``ComposerConfig`` shares are mutable. The four configs that are values (``ComposeConfig``,
``LossConfig``, ``ComposerSettings``, ``PrimeRLLossConfig``) keep their immutability through
`WriteOnce` (each field is set once, by ``__init__``; assigning it again raises
``dataclasses.FrozenInstanceError`` as a frozen dataclass does), written once here instead of per
class; unlike a frozen dataclass they are not hashable (nothing hashes them; ``RunConfig`` never was, its ``task.options`` is a dict).
``ComposerConfig`` stays mutable, as TRL's arguments are (TRL assigns to them).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal, TypeVar, get_args

from composer_replication.fields import OneOf
from composer_replication.loss import sdpo_wrappers
from composer_replication.loss._checks import check_choice, check_scalar
from composer_replication.loss.distill import DEFAULT_ENTROPY_OPD_H_MAX, TAID_T_END, TAID_T_START
from composer_replication.loss.policy import LOSS_TYPES, LossType

__all__ = [
    "DPO_VARIANTS",
    "SDPO_WRAPPERS",
    "Channel1Settings",
    "Channel23Settings",
    "DpoVariant",
    "LossSettings",
    "SampledTokenSettings",
    "SdpoWrapper",
    "WriteOnce",
    "setting_names",
]

SdpoWrapper = Annotated[
    str, OneOf(sdpo_wrappers.names, 'a channel-2 wrapper (docs/channels.md, "SDPO wrappers")')
]
"""A registered channel-2 wrapper's name (`sdpo_wrappers`; the loader checks it)."""
DpoVariant = Literal["dpo", "simpo"]
SDPO_WRAPPERS: tuple[str, ...] = sdpo_wrappers.names()
"""The built-in wrappers' names (``sdpo_wrappers.names()`` is the registry's, read when asked)."""
DPO_VARIANTS: tuple[DpoVariant, ...] = get_args(DpoVariant)

_T = TypeVar("_T")


def _setting(default: _T, help: str) -> _T:
    """A dataclass field with its default and ``metadata["help"]`` (one help text per setting:
    the TOML reference, the command-line ``--help`` and the docs read it)."""
    return dataclasses.field(default=default, metadata={"help": help})


def setting_names(cls: type) -> tuple[str, ...]:
    """The field names of a settings dataclass, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _check_positive_int(name: str, value: int | None, none: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None{none}, got {value!r}")


class WriteOnce:
    """Each attribute is set once (by the dataclass ``__init__``); setting it again or deleting
    it raises ``dataclasses.FrozenInstanceError``, as on a frozen dataclass."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        if name in self.__dict__:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


@dataclasses.dataclass(kw_only=True)
class Channel1Settings:
    """Channel 1 (the GRPO-family policy loss). The trainer takes these from TRL's
    ``GRPOConfig`` (``loss_type``, ``epsilon``, ``epsilon_high``, ``delta``, ``beta``)."""

    loss_type: LossType = _setting("dapo", "channel-1 aggregation (TRL's loss_type)")
    epsilon_low: float = _setting(0.2, "lower PPO clip (TRL's epsilon)")
    epsilon_high: float | None = _setting(None, "upper PPO clip (unset = epsilon_low)")
    delta: float | None = _setting(
        None, "two-sided GRPO: cap (> 1) on the unclipped ratio (unset = off)"
    )
    kl_beta: float = _setting(0.0, "KL-to-reference weight in channel 1 (TRL's beta)")

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_scalar("epsilon_low", self.epsilon_low, low=0.0, high=1.0, high_open=True)
        if self.epsilon_high is not None:
            check_scalar("epsilon_high", self.epsilon_high, low=0.0)
        if self.delta is not None:
            check_scalar("delta", self.delta, low=1.0, low_open=True)
        check_scalar("kl_beta", self.kl_beta, low=0.0)


@dataclasses.dataclass(kw_only=True)
class SampledTokenSettings:
    """What works on the log-probs of the sampled tokens alone: the weights of channels 2 and 3
    and channel 3's preference loss. The sampled-token recipes (verl, PRIME-RL: no
    full-vocabulary logits) take exactly these; `Channel23Settings` extends them."""

    alpha_sdpo: float = _setting(0.1, "channel 2 (hint self-distillation) weight; 0 disables it")
    beta_replay: float = _setting(0.05, "channel 3 (trace replay) weight; 0 disables it")
    dpo_variant: DpoVariant = _setting(
        "dpo",
        "channel-3 preference loss ('dpo' scores a frozen reference copy of the model; "
        "'simpo' is reference-free)",
    )
    replay_dpo_beta: float = _setting(0.1, "DPO beta for channel 3")
    simpo_beta: float = _setting(2.0, "SimPO beta")
    simpo_gamma: float = _setting(1.0, "SimPO margin gamma")
    label_smoothing: float = _setting(0.0, "channel-3 label smoothing in [0, 0.5)")
    rpo_alpha: float = _setting(
        0.0,
        "channel 3: weight of the chosen (teacher) traces' NLL added to the preference loss "
        "(RPO; TRL's DPOConfig.rpo_alpha, CPOConfig.cpo_alpha): the token mean of "
        "-log p(chosen); 0 disables it",
    )

    def __post_init__(self) -> None:
        check_scalar("alpha_sdpo", self.alpha_sdpo)
        check_scalar("beta_replay", self.beta_replay)
        check_choice("dpo_variant", self.dpo_variant, DPO_VARIANTS)
        check_scalar("replay_dpo_beta", self.replay_dpo_beta, low=0.0, low_open=True)
        check_scalar("simpo_beta", self.simpo_beta, low=0.0, low_open=True)
        check_scalar("simpo_gamma", self.simpo_gamma, low=0.0)
        check_scalar("label_smoothing", self.label_smoothing, low=0.0, high=0.5, high_open=True)
        check_scalar("rpo_alpha", self.rpo_alpha, low=0.0)


@dataclasses.dataclass(kw_only=True)
class Channel23Settings(SampledTokenSettings):
    """Channels 2 (hint self-distillation) and 3 (trace replay): the `SampledTokenSettings`,
    then channel 2's full-vocabulary divergence settings (``sdpo_*``, ``taid_*``,
    ``entropy_opd_h_max``: they act on logits). Every surface shares these, the trainer's
    keywords and ``ComposerConfig``'s fields included."""

    sdpo_jsd_beta: float = _setting(0.5, "generalized JSD beta (0 forward KL, 1 reverse KL)")
    sdpo_temperature: float = _setting(1.0, "channel 2 softmax temperature (student and teacher)")
    sdpo_token_clip: float | None = _setting(
        None, "per-token clip of the channel-2 divergence (unset = none)"
    )
    sdpo_top_k: int | None = _setting(None, "top-k vocabulary for channel 2 (unset = full vocab)")
    sdpo_add_tail: bool = _setting(
        True, "top-k channel 2: add one bucket for the rest of the vocabulary"
    )
    sdpo_wrapper: SdpoWrapper = _setting(
        "none", "channel-2 divergence: 'none' (generalized JSD), 'taid' or 'entropy_opd'"
    )
    sdpo_max_context_length: int | None = _setting(
        None,
        "cap (tokens) on a channel-2 hinted teacher context: longer ones lose their middle "
        "(first half = question, last half = end of the hint); unset = no cap",
    )
    taid_t: float | None = _setting(
        None, "fixed TAID interpolation t in [0, 1] (wins over the schedule)"
    )
    taid_total_steps: int | None = _setting(
        None,
        f"TAID schedule length: t goes {TAID_T_START} -> {TAID_T_END} over this many inner "
        "steps (used when taid_t is unset)",
    )
    entropy_opd_h_max: float = _setting(
        DEFAULT_ENTROPY_OPD_H_MAX, "entropy_opd wrapper: teacher-entropy gate in nats"
    )

    def __post_init__(self) -> None:
        SampledTokenSettings.__post_init__(self)
        check_scalar("sdpo_jsd_beta", self.sdpo_jsd_beta, low=0.0, high=1.0)
        check_scalar("sdpo_temperature", self.sdpo_temperature, low=0.0, low_open=True)
        if self.sdpo_token_clip is not None:
            check_scalar("sdpo_token_clip", self.sdpo_token_clip, low=0.0, low_open=True)
        _check_positive_int("sdpo_top_k", self.sdpo_top_k, "")
        _check_positive_int("sdpo_max_context_length", self.sdpo_max_context_length, " (no cap)")
        sdpo_wrappers.check_wrapper(self.sdpo_wrapper)
        if self.taid_t is not None:
            check_scalar("taid_t", self.taid_t, low=0.0, high=1.0)
        if self.taid_total_steps is not None:
            check_scalar("taid_total_steps", self.taid_total_steps, low=0, low_open=True)
        check_scalar("entropy_opd_h_max", self.entropy_opd_h_max, low=0.0)


@dataclasses.dataclass(kw_only=True)
class LossSettings(Channel23Settings, Channel1Settings):
    """Every loss setting a user writes: channel 1's, then channels 2 and 3's (the TOML
    ``[loss]`` keys, in this order; ``ComposeConfig``'s user keywords)."""

    def __post_init__(self) -> None:
        Channel1Settings.__post_init__(self)
        Channel23Settings.__post_init__(self)
