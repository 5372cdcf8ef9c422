"""One list of loss settings (issue 21): a setting declared once in loss/loss_settings.py is on
every surface that takes it from a user, with the same default, type, check and help.

The surfaces: ``loss.ComposeConfig`` (compose_loss keywords) and ``loss.loss_section.LossConfig``
(the TOML ``[loss]`` section) inherit `LossSettings`; the trainer's ``ComposerSettings``
(``ComposerReplicationTrainer`` keywords) and ``ComposerConfig`` (a TRL ``GRPOConfig`` for
``HfArgumentParser``) inherit `Channel23Settings` (channel 1 is TRL's own loss); the sampled-token
recipes take `SampledTokenSettings`: PRIME-RL's ``PrimeRLLossConfig`` inherits it, verl's
keywords are ``recipes.sampled.SAMPLED_TOKEN_KEYS``, its names. The last test adds a setting of
each kind to the declaration in a fresh interpreter and follows it to every surface.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

from composer_replication.config import ConfigError, load_config
from composer_replication.config.reference import reference_markdown
from composer_replication.config.schema import LOSS_KEYS_SET_BY_THE_RUN
from composer_replication.loss import (
    Channel1Settings,
    Channel23Settings,
    ComposeConfig,
    LossSettings,
    SampledTokenSettings,
    setting_names,
)
from composer_replication.loss.loss_section import LossConfig
from composer_replication.recipes.prime_rl import PrimeRLLossConfig
from composer_replication.recipes.sampled import (
    SAMPLED_TOKEN_KEYS,
    sampled_token_config,
    sampled_token_kwargs,
)

pytest.importorskip("trl")

from transformers import HfArgumentParser  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from composer_replication.assembly.build import CHANNEL1_TRL_ARGS  # noqa: E402
from composer_replication.trainer import ComposerConfig, ComposerSettings  # noqa: E402
from composer_replication.trainer.config import CHANNEL1_KEYS, LOSS_KEYS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHANNEL23 = setting_names(Channel23Settings)
SAMPLED = setting_names(SampledTokenSettings)
# Each surface and the settings it takes from a user.
SURFACES: dict[type, tuple[str, ...]] = {
    ComposeConfig: setting_names(LossSettings),
    LossConfig: setting_names(LossSettings),
    ComposerSettings: CHANNEL23,
    ComposerConfig: CHANNEL23,
    PrimeRLLossConfig: SAMPLED,
}


def _doc_section(path: str, start: str, end: str) -> str:
    return (ROOT / path).read_text().split(start)[1].split(end)[0]


# Where the recipes' pages list the settings they take.
PRIME_RL_TABLE = _doc_section("docs/recipes/prime_rl.md", "## 4.", "## 5.")
(VERL_ROW,) = [
    line
    for line in _doc_section("docs/recipes/verl.md", "## 4.", "## 5.").splitlines()
    if line.startswith("| `composer_ppo_loss(...)` |")
]
TRL_KEYS = _doc_section("docs/recipes/trl.md", "## 4.", "## 5.")


def _shown(default: object) -> str:
    """A default as the docs write it: a string quoted, anything else as its repr."""
    return f'"{default}"' if isinstance(default, str) else repr(default)


def _field(cls: type, name: str) -> dataclasses.Field[object]:
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return f


def _words(text: str) -> str:
    """Without whitespace: argparse wraps help lines, at spaces and after hyphens."""
    return "".join(text.split())


@pytest.fixture(scope="module")
def argparse_help() -> str:
    return _words(HfArgumentParser(ComposerConfig).format_help())


def test_every_surface_inherits_the_declaration() -> None:
    assert issubclass(ComposeConfig, LossSettings) and issubclass(LossConfig, LossSettings)
    for cls in (ComposerSettings, ComposerConfig):
        assert issubclass(cls, Channel23Settings) and not issubclass(cls, Channel1Settings)
    assert issubclass(ComposerConfig, GRPOConfig)
    assert issubclass(Channel23Settings, SampledTokenSettings)
    assert issubclass(PrimeRLLossConfig, SampledTokenSettings)
    assert not issubclass(PrimeRLLossConfig, Channel23Settings | Channel1Settings)


@pytest.mark.parametrize("name", setting_names(LossSettings))
def test_a_declared_setting_is_on_its_surfaces_with_one_default_type_and_help(
    name: str, argparse_help: str, tmp_path: Path
) -> None:
    declared = _field(LossSettings, name)
    help_text = declared.metadata["help"]
    hint = typing.get_type_hints(LossSettings)[name]
    surfaces = [cls for cls, names in SURFACES.items() if name in names]
    assert len(surfaces) == 2 + 2 * (name in CHANNEL23) + (name in SAMPLED)
    for cls in surfaces:
        f = _field(cls, name)
        assert f.default == declared.default, cls
        assert f.metadata["help"] == help_text, cls
        assert typing.get_type_hints(cls)[name] == hint, cls
    # The values users get when they leave it out, and where they read its help.
    assert getattr(ComposeConfig(), name) == getattr(LossConfig(), name) == declared.default
    assert f"| `loss.{name}` |" in reference_markdown()
    assert f"| {help_text} |" in reference_markdown()
    if name in CHANNEL23:
        assert getattr(ComposerSettings(), name) == declared.default
        assert getattr(ComposerConfig(output_dir=str(tmp_path)), name) == declared.default
        assert f"--{name}" in argparse_help and _words(help_text) in argparse_help
        assert f"`{name}`" in TRL_KEYS  # docs/recipes/trl.md's list of the trainer's keywords
    if name in SAMPLED:
        # PRIME-RL's [trainer.loss.kwargs] key and verl's composer_ppo_loss keyword
        assert getattr(PrimeRLLossConfig(), name) == declared.default
        assert getattr(PrimeRLLossConfig.from_kwargs({}), name) == declared.default
        assert name in SAMPLED_TOKEN_KEYS
        assert sampled_token_kwargs(sampled_token_config({}))[name] == declared.default
        (row,) = [r for r in PRIME_RL_TABLE.splitlines() if r.startswith(f"| `{name}` |")]
        assert row.split("|")[2].strip().strip("`") == _shown(declared.default), row
        assert f"`{name}` ({_shown(declared.default)})" in VERL_ROW
    else:
        with pytest.raises(ValueError, match=rf"^{name}: compose_loss keyword\(s\) that do not"):
            PrimeRLLossConfig.from_kwargs({name: declared.default})
        assert name not in SAMPLED_TOKEN_KEYS and f"`{name}`" not in VERL_ROW


def test_the_surfaces_loss_keys_are_exactly_the_declarations() -> None:
    """No surface has a loss setting of its own: beyond the declarations, only the values a run
    sets (temperature and the TAID step, `LOSS_KEYS_SET_BY_THE_RUN`)."""
    run_set = tuple(LOSS_KEYS_SET_BY_THE_RUN)
    compose_keys = set(setting_names(ComposeConfig))
    assert setting_names(ComposeConfig) == (*setting_names(LossSettings), *run_set)
    assert setting_names(LossConfig) == setting_names(LossSettings)
    trainer_loss_keys = {*CHANNEL23, "taid_schedule_step"}
    assert set(setting_names(ComposerSettings)) & compose_keys == trainer_loss_keys
    composer_own = set(setting_names(ComposerConfig)) - set(setting_names(GRPOConfig))
    assert composer_own & compose_keys == trainer_loss_keys
    # The sampled-token recipes: PRIME-RL's own settings are its channel 1, none a loss setting.
    assert set(setting_names(PrimeRLLossConfig)) & compose_keys == set(SAMPLED)
    assert set(setting_names(PrimeRLLossConfig)) - set(SAMPLED) == {
        "mask",
        "dppo_mask_low",
        "dppo_mask_high",
        "log_ratio_low",
        "log_ratio_high",
        "adv_tau",
        "kl_tau",
    }
    # The key lists are derived from the declarations.
    assert SAMPLED_TOKEN_KEYS == SAMPLED and set(SAMPLED) < set(CHANNEL23)
    assert LOSS_KEYS == (*CHANNEL23, "taid_schedule_step")
    assert CHANNEL1_KEYS == (*setting_names(Channel1Settings), "temperature")
    assert set(CHANNEL1_KEYS) == set(CHANNEL1_TRL_ARGS) | {"temperature"}


def test_the_runs_values_stay_unknown_toml_keys() -> None:
    for key, hint in (("temperature", "sdpo_temperature"), ("taid_schedule_step", "taid_total")):
        with pytest.raises(ConfigError, match=rf"loss\.{key}: unknown key in section \[loss\]"):
            load_config(overrides=[f"loss.{key}=1"])
        with pytest.raises(ConfigError, match=hint):
            load_config(overrides=[f"loss.{key}=1"])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("sdpo_jsd_beta", 1.5, "sdpo_jsd_beta must be in"),
        ("label_smoothing", 0.5, "label_smoothing must be in"),
        ("sdpo_top_k", 0, "sdpo_top_k must be a positive int or None"),
        ("dpo_variant", "ipo", "unknown dpo_variant='ipo'"),
        ("replay_dpo_beta", 0.0, "replay_dpo_beta must be in"),
    ],
)
def test_a_declared_check_holds_on_every_surface(
    key: str, value: object, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=message):
        ComposeConfig(**{key: value})
    with pytest.raises(ValueError, match=rf"^loss(\.{key}: |: .*{key})"):  # the TOML key
        LossConfig(**{key: value})
    with pytest.raises(ValueError, match=message):
        ComposerSettings.resolve(object(), {key: value})
    with pytest.raises(ValueError, match=message):  # when the arguments are parsed
        ComposerConfig(output_dir=str(tmp_path), **{key: value})
    if key in SAMPLED:
        with pytest.raises(ValueError, match=message):  # PRIME-RL's [trainer.loss.kwargs]
            PrimeRLLossConfig.from_kwargs({key: value})
        with pytest.raises(ValueError, match=message):  # verl's composer_ppo_loss keywords
            sampled_token_config({key: value})


def test_the_value_configs_are_immutable() -> None:
    for value in (LossConfig(), ComposerSettings(), PrimeRLLossConfig()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.alpha_sdpo = 0.5
    args = ComposerConfig(output_dir="unused")
    args.alpha_sdpo = 0.5  # TRL's arguments are mutable, as GRPOConfig's
    assert args.alpha_sdpo == 0.5


# Two new settings, each written once in loss/loss_settings.py (a field and its check): a channel-2
# one that acts on logits (Channel23Settings) and a sampled-token one (SampledTokenSettings).
# (name, default, help, the line its class's __post_init__ starts with)
_KNOBS = [
    (
        "sdpo_new_knob",
        0.25,
        "a knob declared in one place",
        "        SampledTokenSettings.__post_init__(self)\n",
    ),
    (
        "replay_new_knob",
        0.75,
        "a sampled-token knob declared in one place",
        '        check_scalar("alpha_sdpo", self.alpha_sdpo)\n',
    ),
]
_POST_INIT = "    def __post_init__(self) -> None:\n"
# anchor -> the same with the knob's field before it and the knob's check after it
_PATCHES = [
    (
        _POST_INIT + first,
        f'    {name}: float = _setting({default}, "{help_text}")\n\n'
        + _POST_INIT
        + f'        check_scalar("{name}", self.{name}, low=0.0)\n'
        + first,
    )
    for name, default, help_text, first in _KNOBS
]
_CHILD = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, json, pathlib, sys

    TARGET = "composer_replication.loss.loss_settings"
    PATCHES, KNOBS, OUTPUT_DIR = json.loads(sys.argv[1])


    class Patched(importlib.machinery.SourceFileLoader):
        def get_code(self, fullname):
            text = pathlib.Path(self.path).read_text()
            for anchor, new in PATCHES:
                assert text.count(anchor) == 1, "update the anchors of this test"
                text = text.replace(anchor, new)
            return compile(text, self.path, "exec")


    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != TARGET:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            spec.loader = Patched(name, spec.origin)
            return spec


    sys.meta_path.insert(0, Finder())

    import torch
    from transformers import HfArgumentParser

    from composer_replication.assembly.build import composer_kwargs
    from composer_replication.config import ConfigError, load_config
    from composer_replication.config.reference import reference_markdown
    from composer_replication.loss import ComposeConfig, combine
    from composer_replication.recipes.prime_rl import PrimeRLLossConfig
    from composer_replication.recipes.sampled import (
        SAMPLED_TOKEN_KEYS,
        reject_logit_keywords,
        sampled_token_config,
        sampled_token_kwargs,
    )
    from composer_replication.trainer import ComposerConfig, ComposerSettings
    from composer_replication.trainer.config import LOSS_KEYS


    def error(fn):
        try:
            fn()
        except (ValueError, ConfigError) as exc:
            return str(exc)
        return None


    def verl_forwards(settings, name):
        # verl's policy loss: its keywords checked by sampled_token_config, forwarded to combine
        kwargs = sampled_token_kwargs(sampled_token_config(settings))
        ones = torch.ones(1, 2)
        combine(per_token_logps=-ones, completion_mask=ones, advantages=ones, **kwargs)
        return kwargs[name]


    out = {}
    for name, default, help_text in KNOBS:
        out[name] = o = {}
        o["compose_loss"] = [
            getattr(ComposeConfig(), name),
            getattr(ComposeConfig.from_kwargs({name: 0.5}), name),
            error(lambda: ComposeConfig(**{name: -1.0})),
        ]
        config = load_config(overrides=[f"loss.{name}=0.5"])
        o["toml"] = [
            getattr(load_config().loss, name),
            getattr(config.loss, name),
            composer_kwargs(config)[name],
            error(lambda: load_config(overrides=[f"loss.{name}=-1.0"])),
            f"| `loss.{name}` | float | `{default}` | {help_text} |" in reference_markdown(),
        ]
        o["trainer"] = [
            name in LOSS_KEYS,
            getattr(ComposerSettings(), name),
            ComposerSettings.resolve(object(), {name: 0.5}).loss_kwargs()[name],
            error(lambda: ComposerSettings.resolve(object(), {name: -1.0})),
        ]
        parser = HfArgumentParser(ComposerConfig)
        (args,) = parser.parse_args_into_dataclasses(
            args=["--output_dir", OUTPUT_DIR, f"--{name}", "0.5"]
        )
        o["argparse"] = [
            getattr(args, name),
            getattr(ComposerSettings.resolve(args, {}), name),
            "".join(help_text.split()) in "".join(parser.format_help().split()),
        ]
        # the sampled-token recipes: PRIME-RL's [trainer.loss.kwargs], verl's keywords
        o["prime_rl"] = [
            error(lambda: PrimeRLLossConfig.from_kwargs({name: -1.0})),
        ]
        o["verl"] = [
            name in SAMPLED_TOKEN_KEYS,
            error(lambda: reject_logit_keywords({name: 0.5}, "verl", "verl's")),
        ]
        if name in SAMPLED_TOKEN_KEYS:
            o["prime_rl"] += [
                getattr(PrimeRLLossConfig(), name),
                getattr(PrimeRLLossConfig.from_kwargs({name: 0.5}), name),
            ]
            o["verl"] += [
                error(lambda: sampled_token_config({name: -1.0})),
                verl_forwards({}, name),
                verl_forwards({name: 0.5}, name),
            ]
    print(json.dumps(out))
    """
)


def test_a_setting_added_to_the_declaration_reaches_every_surface(tmp_path: Path) -> None:
    """The point of the one list: add a setting (one field and its check in
    loss/loss_settings.py, here patched into the source as the child imports it) and compose_loss,
    the TOML section (and its reference), the trainer's keywords and TRL's argument parser all
    take it, with its default, its check and its help; a sampled-token one (SampledTokenSettings)
    reaches PRIME-RL's [trainer.loss.kwargs] and verl's keywords (forwarded to combine) too, and
    a channel-2 one that needs logits is refused there, by name. Nothing else is edited."""
    source = (ROOT / "composer_replication" / "loss" / "loss_settings.py").read_text()
    for anchor, _ in _PATCHES:
        assert source.count(anchor) == 1, "update _KNOBS' anchors to loss_settings.py"
    knobs = [(name, default, help_text) for name, default, help_text, _ in _KNOBS]
    # A fresh interpreter imports torch, transformers and TRL: slow under load, so a generous
    # safety net rather than a time limit.
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([_PATCHES, knobs, str(tmp_path)])],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, default, _ in knobs:
        o = out[name]
        bad = f"{name} must be in [0.0, None], got -1.0"
        assert o["compose_loss"] == [default, 0.5, bad], name
        assert o["toml"] == [default, 0.5, 0.5, f"loss.{bad}".replace(" must", ": must", 1), True]
        assert o["trainer"] == [True, default, 0.5, bad], name
        assert o["argparse"] == [0.5, 0.5, True], name
    sampled, logits = out["replay_new_knob"], out["sdpo_new_knob"]
    bad = "replay_new_knob must be in [0.0, None], got -1.0"
    assert sampled["prime_rl"] == [bad, 0.75, 0.5]
    assert sampled["verl"] == [True, None, bad, 0.75, 0.5]
    refused = "sdpo_new_knob: compose_loss keyword(s) that do not apply to the "
    (prime_rl_error,) = logits["prime_rl"]
    assert prime_rl_error.startswith(refused + "PRIME-RL recipe")
    assert logits["verl"][0] is False and logits["verl"][1].startswith(refused + "verl recipe")
