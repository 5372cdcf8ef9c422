"""The typed config: defaults, TOML round trip, overrides, and the errors users see."""

from __future__ import annotations

import tomllib

import pytest

from composer_replication.config import (
    ConfigError,
    RunConfig,
    config_from_json,
    default_toml_text,
    dump_toml,
    from_dict,
    load_config,
    parse_override,
    to_dict,
)


def test_embedded_default_is_the_cpu_demo() -> None:
    config = load_config()
    assert config.model.name == "tiny"
    assert config.backend.kind == "local" and config.backend.n_replicas == 2
    assert config.store.uri == ""  # file:// under the run folder
    assert config.loss.alpha_sdpo > 0 and config.loss.beta_replay > 0  # all three channels
    assert config.teachers.oracle
    assert config.n_rounds * config.diloco.sync_every_h == config.train.max_steps
    # the packaged file parses on its own, and every key in it is known to the schema
    from_dict(RunConfig, tomllib.loads(default_toml_text()))


def test_dump_toml_round_trips_including_unset_optionals_and_endpoints() -> None:
    config = load_config(
        overrides=[
            "loss.sdpo_token_clip=0.5",
            "task.options={digits = 2}",
            'teachers.endpoints=[{base_url = "http://127.0.0.1:1/v1", model = "m"}]',
        ]
    )
    text = dump_toml(config)
    assert "# taid_t = (unset)" in text
    assert "[[teachers.endpoints]]" in text
    again = from_dict(RunConfig, tomllib.loads(text))
    assert again == config
    assert config_from_json(__import__("json").dumps(to_dict(config))) == config


def test_overrides_parse_toml_values_with_string_fallback() -> None:
    assert parse_override("train.max_steps=20") == (["train", "max_steps"], 20)
    assert parse_override("model.name=Qwen/Qwen2.5-0.5B-Instruct") == (
        ["model", "name"],
        "Qwen/Qwen2.5-0.5B-Instruct",
    )
    assert parse_override('store.uri="s3://b/p/"') == (["store", "uri"], "s3://b/p/")
    assert load_config(overrides=["loss.taid_t=0.3", "loss.taid_t=none"]).loss.taid_t is None
    assert load_config(overrides=["logging.progress=none"]).logging.progress == "none"
    config = load_config(overrides=["train.learning_rate=1", "logging.tensorboard=false"])
    assert config.train.learning_rate == 1.0 and isinstance(config.train.learning_rate, float)
    assert config.logging.tensorboard is False


def test_config_file_then_overrides(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[train]\nmax_steps = 80\n[backend]\nkind = "local"\nn_replicas = 3\n')
    config = load_config(path, ["train.max_steps=100"])
    assert config.train.max_steps == 100 and config.backend.n_replicas == 3
    assert config.model.name == "tiny"  # schema defaults fill the rest


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "train.max_step=3",
            "train.max_step: unknown key in section [train] (did you mean 'max_steps'?)",
        ),
        ("trian.max_steps=3", "trian: unknown section (did you mean 'train'?)"),
        ("train.max_steps=abc", "train.max_steps: expected an integer, got string 'abc'"),
        ("train.max_steps=2.5", "train.max_steps: expected an integer, got number 2.5"),
        ("train.max_steps=true", "train.max_steps: expected an integer, got boolean True"),
        ("logging.tensorboard=1", "logging.tensorboard: expected true or false"),
        ("model.name=3", "model.name: expected a string"),
        ("loss.dpo_variant=simp", "(did you mean 'simpo'?)"),
        ("backend.kind=modall", "(did you mean 'modal'?)"),
        ("backend.n_replicas=0", "backend.n_replicas: 0 must be >= 1"),
        ("train.batch_size=13", "train.batch_size: 13 must be a positive multiple"),
        ("task.options=3", "task.options: expected a table"),
        ('teachers.endpoints=[{model = "m"}]', "teachers.endpoints[0].base_url: must be set"),
        ("train=3", "the key must be section.key"),
        ("novalue", "expected section.key=value"),
        ("train.max_steps=none", "train.max_steps: cannot be unset"),
    ],
)
def test_errors_name_the_key_and_give_a_hint(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert needle in str(info.value)


def test_bad_toml_and_missing_file(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nmax_steps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_cross_section_rules() -> None:
    with pytest.raises(ConfigError, match="train.max_steps: 25 is not a multiple of"):
        load_config(overrides=["train.max_steps=25", "diloco.sync_every_h=10"])
    with pytest.raises(ConfigError, match="diloco.min_replicas: 3 exceeds backend.n_replicas"):
        load_config(overrides=["diloco.min_replicas=3"])
    with pytest.raises(ConfigError, match="loss.sdpo_wrapper: 'taid' needs"):
        load_config(overrides=["loss.sdpo_wrapper=taid"])
    ok = load_config(overrides=["loss.sdpo_wrapper=taid", "loss.taid_t=0.4"])
    assert ok.loss.compose_kwargs()["taid_t"] == 0.4
    assert "sdpo_token_clip" not in ok.loss.compose_kwargs()  # unset optionals are omitted


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["diloco.outer_momentum=0"], "diloco.outer_momentum: 0 with outer_optimizer = 'nesterov'"),
        (["diloco.outer_optimizer=lamb"], "is not one of 'nesterov', 'sgd', 'adam'"),
        (["diloco.outer_betas=[0.9]"], "diloco.outer_betas: [0.9] must be two numbers"),
        (
            ["diloco.mode=decoupled", "diloco.outer_optimizer=adam"],
            "diloco.outer_optimizer: 'adam' runs in sync mode only",
        ),
        (["train.max_grad_norm=-1"], "train.max_grad_norm: must be >= 0"),
        (["train.warmup_steps=-1"], "train.warmup_steps: must be >= 0"),
        (["train.lr_scheduler=cosin"], "(did you mean 'cosine'?)"),
    ],
)
def test_optimizer_keys_are_checked(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert needle in str(info.value)
    ok = load_config(overrides=["diloco.outer_optimizer=sgd", "diloco.outer_momentum=0"])
    assert ok.diloco.outer.nesterov is False


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["diloco.fragments=4", "model.num_layers=2"],
            "diloco.fragments: 4 exceeds model.num_layers (2)",
        ),
        (["diloco.screen=loss"], "diloco.screen: the loss screen runs in the synchronous"),
        (["diloco.merge=rda", "diloco.aggregate=median"], "diloco.merge: 'rda' averages"),
    ],
)
def test_decoupled_rules_fail_before_any_replica_starts(overrides: list[str], needle: str) -> None:
    """What decoupled mode cannot do is a config error, not a replica traceback a minute in."""
    base = ["diloco.mode=decoupled", "diloco.sync_every_h=8", "train.max_steps=16"]
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[*base, *overrides])
    assert needle in str(info.value)


def test_switching_the_task_drops_the_previous_tasks_options() -> None:
    """The default's arithmetic options do not follow an override to another task; options given
    with the switch (or without switching) are kept."""
    from composer_replication.config import load_config

    assert load_config().task.options == {"num_operands": 3}
    assert load_config(overrides=["task.name=strings"]).task.options == {}
    assert load_config(
        overrides=["task.name=strings", "task.options={level='medium'}"]
    ).task.options == {"level": "medium"}
    assert load_config(overrides=["task.n_eval=300"]).task.options == {"num_operands": 3}
