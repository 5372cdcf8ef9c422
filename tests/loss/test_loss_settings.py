"""The one list of loss settings (loss/loss_settings.py): each setting declared once with its
type, default, check and help, and `ComposeConfig` built on it (the surfaces outside loss/ are
tested in tests/cli/test_loss_settings_surfaces.py)."""

from __future__ import annotations

import copy
import dataclasses
import typing

import pytest

from composer_replication.loss import (
    DPO_VARIANTS,
    LOSS_TYPES,
    SDPO_WRAPPERS,
    Channel1Settings,
    Channel23Settings,
    ComposeConfig,
    LossSettings,
    SampledTokenSettings,
    setting_names,
)

HINTS = typing.get_type_hints(LossSettings, include_extras=True)


def test_loss_settings_are_channel_1_then_channels_2_and_3() -> None:
    assert setting_names(LossSettings) == (
        *setting_names(Channel1Settings),
        *setting_names(Channel23Settings),
    )
    assert set(setting_names(Channel1Settings)).isdisjoint(setting_names(Channel23Settings))
    assert setting_names(Channel1Settings) == (
        "loss_type",
        "epsilon_low",
        "epsilon_high",
        "delta",
        "kl_beta",
    )


def test_channels_2_and_3_are_the_sampled_token_settings_then_channel_2s_on_logits() -> None:
    """What works on sampled-token log-probs alone (the verl and PRIME-RL recipes take these) is
    a base of Channel23Settings; the rest of channel 2 acts on full-vocabulary logits."""
    sampled = setting_names(SampledTokenSettings)
    assert issubclass(Channel23Settings, SampledTokenSettings)
    assert sampled == (
        "alpha_sdpo",
        "beta_replay",
        "dpo_variant",
        "replay_dpo_beta",
        "simpo_beta",
        "simpo_gamma",
        "label_smoothing",
        "rpo_alpha",
    )
    logits_only = setting_names(Channel23Settings)[len(sampled) :]
    assert setting_names(Channel23Settings)[: len(sampled)] == sampled
    assert all(n.startswith(("sdpo_", "taid_", "entropy_opd_")) for n in logits_only)


@pytest.mark.parametrize("name", setting_names(LossSettings))
def test_each_setting_has_a_help_text(name: str) -> None:
    (f,) = [f for f in dataclasses.fields(LossSettings) if f.name == name]
    text = f.metadata["help"]
    assert isinstance(text, str) and len(text) >= 8
    assert "%" not in text  # argparse formats help strings (ComposerConfig's --help)


def test_the_choices_are_literal_types_of_the_choice_tuples() -> None:
    """mypy and the TOML loader see the choices: the field types are the Literals."""
    for name, choices in (("loss_type", LOSS_TYPES), ("dpo_variant", DPO_VARIANTS)):
        assert typing.get_origin(HINTS[name]) is typing.Literal
        assert typing.get_args(HINTS[name]) == choices
    # sdpo_wrapper names a registry's entry (loss.sdpo_wrappers): Annotated[str, OneOf(names)]
    assert typing.get_origin(HINTS["sdpo_wrapper"]) is typing.Annotated
    base, one_of = typing.get_args(HINTS["sdpo_wrapper"])
    assert base is str and one_of.choices() == SDPO_WRAPPERS == ("none", "taid", "entropy_opd")
    assert HINTS["sdpo_top_k"] == int | None and HINTS["alpha_sdpo"] is float


def test_compose_config_is_the_settings_and_the_runs_two_values() -> None:
    assert issubclass(ComposeConfig, LossSettings)
    assert setting_names(ComposeConfig) == (
        *setting_names(LossSettings),
        "temperature",
        "taid_schedule_step",
    )
    cfg, settings = ComposeConfig(), LossSettings()
    for name in setting_names(LossSettings):
        assert getattr(cfg, name) == getattr(settings, name), name
    assert (cfg.temperature, cfg.taid_schedule_step) == (1.0, None)


@pytest.mark.parametrize(
    ("cls", "key", "value", "message"),
    [
        (Channel1Settings, "epsilon_low", 1.0, r"epsilon_low must be in \[0.0, 1.0\)"),
        (Channel1Settings, "loss_type", "ppo", "unknown loss_type='ppo'"),
        (Channel1Settings, "delta", 1.0, "delta must be in"),
        (Channel23Settings, "label_smoothing", 0.5, "label_smoothing must be in"),
        (Channel23Settings, "sdpo_top_k", 0, "sdpo_top_k must be a positive int or None"),
        (Channel23Settings, "sdpo_max_context_length", True, r"or None \(no cap\)"),
        (Channel23Settings, "sdpo_wrapper", "kl", "unknown sdpo_wrapper='kl'"),
        (Channel23Settings, "taid_total_steps", 0, "taid_total_steps must be in"),
        (Channel23Settings, "replay_dpo_beta", 0.0, "replay_dpo_beta must be in"),
        (SampledTokenSettings, "replay_dpo_beta", 0.0, "replay_dpo_beta must be in"),
        (SampledTokenSettings, "dpo_variant", "ipo", "unknown dpo_variant='ipo'"),
        (SampledTokenSettings, "alpha_sdpo", "x", "alpha_sdpo must be a number"),
        (SampledTokenSettings, "rpo_alpha", -0.1, r"rpo_alpha must be in \[0.0, None\]"),
    ],
)
def test_a_settings_check_is_declared_with_it_and_holds_in_compose_config(
    cls: type, key: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**{key: value})
    with pytest.raises(ValueError, match=message):
        LossSettings(**{key: value})
    with pytest.raises(ValueError, match=message):
        ComposeConfig(**{key: value})


def test_compose_config_keeps_its_rules_across_settings() -> None:
    with pytest.raises(ValueError, match="sdpo_wrapper='taid' needs taid_t"):
        ComposeConfig(sdpo_wrapper="taid")
    with pytest.raises(ValueError, match="without taid_total_steps"):
        ComposeConfig(sdpo_wrapper="taid", taid_schedule_step=3)
    with pytest.raises(ValueError, match="temperature must be in"):
        ComposeConfig(temperature=0.0)
    assert ComposeConfig(sdpo_wrapper="taid", taid_schedule_step=3, taid_total_steps=9)


def test_compose_config_is_immutable() -> None:
    """`WriteOnce`: each field is set by __init__ only, as on a frozen dataclass."""
    cfg = ComposeConfig(alpha_sdpo=0.3)
    with pytest.raises(dataclasses.FrozenInstanceError, match="alpha_sdpo"):
        cfg.alpha_sdpo = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError, match="taid_t"):
        del cfg.taid_t
    assert cfg.alpha_sdpo == 0.3
    changed = dataclasses.replace(cfg, beta_replay=0.2)  # a new value, checked again
    assert (changed.alpha_sdpo, changed.beta_replay) == (0.3, 0.2)
    with pytest.raises(ValueError, match="label_smoothing"):
        dataclasses.replace(cfg, label_smoothing=0.7)
    assert copy.deepcopy(cfg) == cfg and copy.copy(cfg) == cfg
    assert ComposeConfig.from_kwargs({"alpha_sdpo": 0.3}) == cfg
