"""One list of loss settings (issue 21): a setting declared once in loss/loss_settings.py is on
every surface that takes it from a user, with the same default, type, check and help.

The surfaces: ``loss.ComposeConfig`` (compose_loss keywords) and ``config.schema.LossConfig``
(the TOML ``[loss]`` section) inherit `LossSettings`; the trainer's ``ComposerSettings``
(``ComposerReplicationTrainer`` keywords) and ``ComposerConfig`` (a TRL ``GRPOConfig`` for
``HfArgumentParser``) inherit `Channel23Settings` (channel 1 is TRL's own loss). The last test
adds a setting to the declaration in a fresh interpreter and follows it to every surface.
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
from composer_replication.config.schema import LOSS_KEYS_SET_BY_THE_RUN, LossConfig
from composer_replication.loss import (
    Channel1Settings,
    Channel23Settings,
    ComposeConfig,
    LossSettings,
    setting_names,
)

pytest.importorskip("trl")

from transformers import HfArgumentParser  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from composer_replication.assembly.build import CHANNEL1_TRL_ARGS  # noqa: E402
from composer_replication.trainer import ComposerConfig, ComposerSettings  # noqa: E402
from composer_replication.trainer.config import CHANNEL1_KEYS, LOSS_KEYS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHANNEL23 = setting_names(Channel23Settings)
# Each surface and the settings it takes from a user.
SURFACES: dict[type, tuple[str, ...]] = {
    ComposeConfig: setting_names(LossSettings),
    LossConfig: setting_names(LossSettings),
    ComposerSettings: CHANNEL23,
    ComposerConfig: CHANNEL23,
}


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


@pytest.mark.parametrize("name", setting_names(LossSettings))
def test_a_declared_setting_is_on_its_surfaces_with_one_default_type_and_help(
    name: str, argparse_help: str, tmp_path: Path
) -> None:
    declared = _field(LossSettings, name)
    help_text = declared.metadata["help"]
    hint = typing.get_type_hints(LossSettings)[name]
    surfaces = [cls for cls, names in SURFACES.items() if name in names]
    assert len(surfaces) == (4 if name in CHANNEL23 else 2)
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
    # The trainer's key lists are derived from the declarations.
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


def test_the_value_configs_are_immutable() -> None:
    for value in (LossConfig(), ComposerSettings()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.alpha_sdpo = 0.5
    args = ComposerConfig(output_dir="unused")
    args.alpha_sdpo = 0.5  # TRL's arguments are mutable, as GRPOConfig's
    assert args.alpha_sdpo == 0.5


# A new channel-2 setting, written once in loss/loss_settings.py: a field and its check.
_ANCHOR = (
    '    def __post_init__(self) -> None:\n        check_scalar("alpha_sdpo", self.alpha_sdpo)\n'
)
_NEW = (
    '    sdpo_new_knob: float = _setting(0.25, "a knob declared in one place")\n\n'
    "    def __post_init__(self) -> None:\n"
    '        check_scalar("sdpo_new_knob", self.sdpo_new_knob, low=0.0)\n'
    '        check_scalar("alpha_sdpo", self.alpha_sdpo)\n'
)
_CHILD = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, json, pathlib, sys

    TARGET = "composer_replication.loss.loss_settings"
    ANCHOR, NEW, OUTPUT_DIR = json.loads(sys.argv[1])


    class Patched(importlib.machinery.SourceFileLoader):
        def get_code(self, fullname):
            text = pathlib.Path(self.path).read_text()
            assert text.count(ANCHOR) == 1, "update the anchor of this test"
            return compile(text.replace(ANCHOR, NEW), self.path, "exec")


    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != TARGET:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            spec.loader = Patched(name, spec.origin)
            return spec


    sys.meta_path.insert(0, Finder())

    from transformers import HfArgumentParser

    from composer_replication.assembly.build import composer_kwargs
    from composer_replication.config import ConfigError, load_config
    from composer_replication.config.reference import reference_markdown
    from composer_replication.loss import ComposeConfig
    from composer_replication.trainer import ComposerConfig, ComposerSettings
    from composer_replication.trainer.config import LOSS_KEYS


    def error(fn):
        try:
            fn()
        except (ValueError, ConfigError) as exc:
            return str(exc)
        return None


    out = {}
    out["compose_loss"] = [
        ComposeConfig().sdpo_new_knob,
        ComposeConfig.from_kwargs({"sdpo_new_knob": 0.5}).sdpo_new_knob,
        error(lambda: ComposeConfig(sdpo_new_knob=-1.0)),
    ]
    config = load_config(overrides=["loss.sdpo_new_knob=0.5"])
    out["toml"] = [
        load_config().loss.sdpo_new_knob,
        config.loss.sdpo_new_knob,
        composer_kwargs(config)["sdpo_new_knob"],
        error(lambda: load_config(overrides=["loss.sdpo_new_knob=-1.0"])),
        "| `loss.sdpo_new_knob` | float | `0.25` | a knob declared in one place |"
        in reference_markdown(),
    ]
    out["trainer"] = [
        "sdpo_new_knob" in LOSS_KEYS,
        ComposerSettings().sdpo_new_knob,
        ComposerSettings.resolve(object(), {"sdpo_new_knob": 0.5}).loss_kwargs()["sdpo_new_knob"],
        error(lambda: ComposerSettings.resolve(object(), {"sdpo_new_knob": -1.0})),
    ]
    parser = HfArgumentParser(ComposerConfig)
    (args,) = parser.parse_args_into_dataclasses(
        args=["--output_dir", OUTPUT_DIR, "--sdpo_new_knob", "0.5"]
    )
    out["argparse"] = [
        args.sdpo_new_knob,
        ComposerSettings.resolve(args, {}).sdpo_new_knob,
        "aknobdeclaredinoneplace" in "".join(parser.format_help().split()),
    ]
    print(json.dumps(out))
    """
)


def test_a_setting_added_to_the_declaration_reaches_every_surface(tmp_path: Path) -> None:
    """The point of the one list: add a channel-2 setting (one field and its check in
    loss/loss_settings.py, here patched into the source as the child imports it) and compose_loss,
    the TOML section (and its reference), the trainer's keywords and TRL's argument parser all
    take it, with its default, its check and its help. Nothing else is edited."""
    source = (ROOT / "composer_replication" / "loss" / "loss_settings.py").read_text()
    assert source.count(_ANCHOR) == 1, "update _ANCHOR to loss_settings.py"
    # A fresh interpreter imports torch, transformers and TRL: slow under load, so a generous
    # safety net rather than a time limit.
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([_ANCHOR, _NEW, str(tmp_path)])],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = "sdpo_new_knob must be in [0.0, None], got -1.0"
    assert out["compose_loss"] == [0.25, 0.5, bad]
    assert out["toml"] == [0.25, 0.5, 0.5, f"loss.{bad}".replace(" must", ": must", 1), True]
    assert out["trainer"] == [True, 0.25, 0.5, bad]
    assert out["argparse"] == [0.5, 0.5, True]
