"""One source for every default and name: the run schema against the libraries it derives from.

The `[loss]` section's checks and its way to the trainer (its keys, types, defaults and help are
the loss library's declarations: tests/cli/test_loss_settings_surfaces.py), `backend.kind` against the executor registry, `diloco.codec` against the exchange's
codecs, the config -> trainer translation against the trainer's keywords, and docs/cli.md's
reference against the generator.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path

import pytest

from composer_replication.config import ConfigError, default_toml_text, load_config
from composer_replication.config.loader import section_keys, section_values
from composer_replication.config.schema import BackendConfig, DilocoConfig
from composer_replication.exchange.codecs import CODECS
from composer_replication.executors.registry import BACKEND_NAMES
from composer_replication.loss import ComposeConfig
from composer_replication.loss.loss_section import LossConfig

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_FIELDS = {f.name: f for f in dataclasses.fields(LossConfig)}


def test_the_embedded_default_chooses_simpo_in_its_toml() -> None:
    """The demo has no reference model, so default.toml CHOOSES simpo; the default is the
    loss library's."""
    assert tomllib.loads(default_toml_text())["loss"]["dpo_variant"] == "simpo"
    assert load_config().loss.dpo_variant == "simpo"
    assert load_config(overrides=["loss.dpo_variant=dpo"]).loss.dpo_variant == "dpo"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("loss.epsilon_low=1.0", "epsilon_low"),
        ("loss.label_smoothing=0.5", "label_smoothing"),
        ("loss.sdpo_top_k=0", "sdpo_top_k"),
        ("loss.delta=1.0", "delta"),
        ("loss.simpo_beta=0", "simpo_beta"),
        ("loss.entropy_opd_h_max=-1", "entropy_opd_h_max"),
        ("loss.sdpo_temperature=0", "sdpo_temperature"),
        ("loss.taid_t=1.5", "taid_t"),
    ],
)
def test_loss_values_the_library_rejects_are_config_errors(override: str, key: str) -> None:
    value = tomllib.loads(f"v = {override.partition('=')[2]}")["v"]
    with pytest.raises(ValueError, match=key):  # the library's own verdict, independently
        ComposeConfig(**{key: value})
    with pytest.raises(ConfigError, match=rf"^loss\.{key}: "):
        load_config(overrides=[override])


def test_a_scheduled_taid_is_valid_with_a_schedule_length() -> None:
    config = load_config(overrides=["loss.sdpo_wrapper=taid", "loss.taid_total_steps=50"])
    assert config.loss.taid_t is None and config.loss.taid_total_steps == 50
    with pytest.raises(ConfigError, match="loss.sdpo_wrapper: 'taid' needs"):
        load_config(overrides=["loss.sdpo_wrapper=taid"])


def test_outer_optimizer_keys_are_the_outer_optimizers_own() -> None:
    """[diloco] outer_* are `OuterOptimizerConfig`'s fields (one default each, written there):
    the run schema, the outer loop's arguments and the decoupled synchronizer take them from
    it."""
    import inspect

    from composer_replication.diloco.outer_loop import make_diloco_outer_loop
    from composer_replication.diloco.outer_optimizer import OUTER_OPTIMIZERS, OuterOptimizerConfig
    from composer_replication.diloco.synchronizer_config import SynchronizerConfig

    # both hold the component's config, not its keys by inheritance
    assert typing.get_type_hints(DilocoConfig)["outer"] is OuterOptimizerConfig
    assert typing.get_type_hints(SynchronizerConfig)["outer"] is OuterOptimizerConfig
    own = OuterOptimizerConfig()
    d = load_config().diloco.outer
    assert d == own == SynchronizerConfig().outer
    # the outer loop takes the config itself (None: its defaults), no outer_* argument of its own
    signature = inspect.signature(make_diloco_outer_loop).parameters
    assert "OuterOptimizerConfig" in str(signature["outer"].annotation)
    assert signature["outer"].default is None and own.outer_lr == 0.7
    assert not {"outer_lr", "outer_momentum", "nesterov"} & set(signature)
    hint = typing.get_type_hints(OuterOptimizerConfig)["outer_optimizer"]
    assert typing.get_args(hint) == OUTER_OPTIMIZERS and d.outer_optimizer == "nesterov"


def test_backend_and_codec_choices_are_the_registries() -> None:
    hints = {
        "kind": typing.get_type_hints(BackendConfig, include_extras=True)["kind"],
        "codec": typing.get_type_hints(
            section_keys(DilocoConfig)["codec"].owner, include_extras=True
        )["codec"],
    }
    assert typing.get_args(hints["kind"])[1].choices() == BACKEND_NAMES
    assert typing.get_args(hints["codec"])[1].choices() == CODECS
    for name in BACKEND_NAMES:
        assert load_config(overrides=[f"backend.kind={name}"]).backend.kind == name
    for codec in CODECS:
        assert load_config(overrides=[f"diloco.codec={codec}"]).diloco.exchange.codec == codec


def test_every_loss_key_reaches_the_trainer() -> None:
    """Channel-1 keys become TRL arguments, the rest composer keywords the trainer accepts;
    non-default values arrive unchanged."""
    pytest.importorskip("trl")
    from composer_replication.assembly.build import CHANNEL1_TRL_ARGS, composer_kwargs, trainer_args
    from composer_replication.trainer.config import LOSS_KEYS

    config = load_config(
        overrides=[
            "loss.loss_type=grpo",
            "loss.epsilon_low=0.1",
            "loss.epsilon_high=0.3",
            "loss.delta=1.5",
            "loss.kl_beta=0.02",
            "loss.alpha_sdpo=0.3",
            "loss.sdpo_add_tail=false",
            "loss.entropy_opd_h_max=1.2",
            "loss.label_smoothing=0.1",
            "loss.dpo_variant=dpo",
        ]
    )
    kw = composer_kwargs(config)
    set_keys = {k for k in SCHEMA_FIELDS if getattr(config.loss, k) is not None}
    assert set(kw).isdisjoint(CHANNEL1_TRL_ARGS)
    assert set(kw) | set(CHANNEL1_TRL_ARGS) == set_keys | set(CHANNEL1_TRL_ARGS)
    assert set(kw) <= set(LOSS_KEYS)
    assert kw["alpha_sdpo"] == 0.3 and kw["sdpo_add_tail"] is False
    assert kw["entropy_opd_h_max"] == 1.2 and kw["label_smoothing"] == 0.1
    assert kw["dpo_variant"] == "dpo"
    args = trainer_args(config, output_dir="/tmp/unused", max_steps=3, seed=0)
    assert (args.loss_type, args.epsilon, args.epsilon_high, args.delta, args.beta) == (
        "grpo",
        0.1,
        0.3,
        1.5,
        0.02,
    )
    assert args.temperature == config.train.temperature  # schema.LOSS_KEYS_SET_BY_THE_RUN


def test_docs_reference_is_the_generated_one() -> None:
    """docs/cli.md's configuration reference is exactly what the schema generates."""
    from composer_replication.config.reference import reference_markdown

    doc = (ROOT / "docs" / "cli.md").read_text()
    assert reference_markdown() in doc, (
        "docs/cli.md is out of date: run "
        "`python -m composer_replication.config.reference --write docs/cli.md`"
    )


def test_reference_lists_every_key_and_the_embedded_choices() -> None:
    """The generator itself: every section and key, with help, and default.toml's choices."""
    from composer_replication.config.reference import reference_markdown
    from composer_replication.config.schema import RunConfig
    from composer_replication.data.teachers.teachers_config import EndpointConfig

    text = reference_markdown()
    hints = typing.get_type_hints(RunConfig)
    for section in dataclasses.fields(RunConfig):
        assert f"### `[{section.name}]`" in text
        for key in section_keys(hints[section.name]):  # a component's keys, flat
            assert f"| `{section.name}.{key}` |" in text, f"{section.name}.{key}"
    for f in dataclasses.fields(EndpointConfig):
        assert f"| `{f.name}` |" in text, f.name
    assert "| `loss.dpo_variant` | 'dpo' \\| 'simpo' | `\"dpo\"` |" in text
    assert '`loss.dpo_variant = "simpo"`' in text  # the embedded default's choice


def test_replace_reference_keeps_the_rest_of_the_file() -> None:
    from composer_replication.config.reference import BEGIN, END, replace_reference

    text = f"# head\n\n{BEGIN}\nstale\n{END}\n\n## after\n"
    out = replace_reference(text)
    assert out.startswith("# head\n\n" + BEGIN) and out.endswith(f"{END}\n\n## after\n")
    assert "stale" not in out and "| `loss.alpha_sdpo` |" in out
    with pytest.raises(ValueError, match="markers"):
        replace_reference("no markers")


def test_the_cli_starts_without_the_schema() -> None:
    """`--help` and usage errors do not import the schema (which imports torch)."""
    import subprocess
    import sys

    code = (
        "import sys; from composer_replication.cli import main\n"
        "try: main(['--help'])\n"
        "except SystemExit: pass\n"
        "print('torch' in sys.modules, 'composer_replication.config.schema' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "False False"


def test_inner_schedule_and_clipping_reach_trl() -> None:
    from composer_replication.assembly.build import trainer_args

    config = load_config(
        overrides=["train.lr_scheduler=cosine", "train.warmup_steps=3", "train.max_grad_norm=0.5"]
    )
    args = trainer_args(config, "/tmp/unused", max_steps=10, seed=0)
    assert (str(args.lr_scheduler_type.value), args.warmup_steps, args.max_grad_norm) == (
        "cosine",
        3,
        0.5,
    )
    default = trainer_args(load_config(), "/tmp/unused", max_steps=10, seed=0)
    assert (str(default.lr_scheduler_type.value), default.max_grad_norm) == ("constant", 1.0)


def test_the_cpu_example_is_the_embedded_default_written_out() -> None:
    """examples/cpu_default.toml says it is what `train` runs with no arguments: it must stay so
    (every key but the run's name)."""
    import dataclasses
    from pathlib import Path

    from composer_replication.config import load_config

    example = Path(__file__).resolve().parents[2] / "examples" / "cpu_default.toml"
    written, default = load_config(example), load_config()
    assert dataclasses.replace(written, run=default.run) == default


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("diloco.keep_rounds=3", "did you mean 'store.keep_rounds'? that section holds it"),
        ("train.outer_lr=0.5", "did you mean 'diloco.outer_lr'? that section holds it"),
        ("diloco.keep=3", "did you mean 'store.keep_rounds'? the key has that name in the TOML"),
        ("diloco.tau=1", "did you mean 'diloco.grace_tau'? the key has that name in the TOML"),
        ("diloco.gamma=0.5", "did you mean 'grace_gamma'?"),
        ("diloco.outlier_ratio=2", "did you mean 'aggregate_outlier_ratio'?"),
    ],
)
def test_a_moved_or_renamed_key_gets_a_did_you_mean(override: str, hint: str) -> None:
    """A key written in the wrong section, or under a component's former argument name
    (`schema.RENAMED_KEYS`), is refused with the key to write instead."""
    with pytest.raises(ConfigError, match="unknown key") as info:
        load_config(overrides=[override])
    assert hint in str(info.value)


def test_the_synchronizer_takes_the_sections_keys_under_their_names() -> None:
    """No renames between the TOML and the component: every `SynchronizerConfig` field the run
    sets is a `[diloco]` key of the same name and value; `keep_rounds` is `[store]`'s."""
    from composer_replication.diloco.decoupled.decoupled_mode import DecoupledDiLoCo
    from composer_replication.diloco.synchronizer_config import SynchronizerConfig

    config = load_config(
        overrides=[
            "diloco.mode=decoupled",
            "diloco.grace_gamma=0.3",
            "diloco.grace_tau=5",
            "diloco.aggregate=median",
            "diloco.aggregate_outlier_ratio=3",
            "diloco.outer_lr=0.4",
            "store.keep_rounds=7",
        ]
    )
    d = config.diloco
    sync = DecoupledDiLoCo(d).synchronizer_config(
        keep_rounds=config.store.keep_rounds, max_steps=config.train.max_steps, local=True
    )
    flat = section_values(d)
    for key in SynchronizerConfig.run_keys():
        assert key in section_keys(DilocoConfig), key
        assert getattr(sync, key) == flat[key], key
    assert sync.outer == d.outer
    assert (sync.grace_gamma, sync.grace_tau, sync.aggregate_outlier_ratio) == (0.3, 5.0, 3.0)
    assert (sync.outer.outer_lr, sync.keep_rounds) == (0.4, 7)
