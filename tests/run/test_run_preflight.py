"""The preflight backend checks follow the executor registry, for every backend it lists."""

from __future__ import annotations

import sys

import pytest

from composer_replication.config import ConfigError, load_config
from composer_replication.executors import registry
from composer_replication.run import preflight

SHARED = "s3://bucket/runs/x/"
LOCAL = "file:///tmp/runs/x/store/"


def _config(kind: str, *extra: str):  # noqa: ANN202 - RunConfig
    return load_config(overrides=[f"backend.kind={kind}", *extra])


@pytest.mark.parametrize("name", [b.name for b in registry.BACKENDS.values() if b.sdk])
def test_a_missing_sdk_names_the_backends_extra(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = registry.backend(name)
    monkeypatch.setitem(sys.modules, spec.sdk, None)  # as if not installed
    with pytest.raises(ConfigError) as info:
        preflight.check_backend(_config(name), SHARED)
    message = str(info.value)
    assert message.startswith("backend.kind: ")
    assert f"pip install 'composer-replication[{spec.extra}]'" in message


@pytest.mark.parametrize("name", registry.BACKEND_NAMES)
def test_file_store_only_for_backends_on_this_machine(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "missing_sdk_message", lambda kind: None)  # SDKs not needed
    spec = registry.backend(name)
    preflight.check_backend(_config(name), SHARED)  # a shared store is fine everywhere
    if spec.remote:
        with pytest.raises(ConfigError, match=rf"store.uri: backend '{name}' runs replicas on"):
            preflight.check_backend(_config(name), LOCAL)
    else:
        preflight.check_backend(_config(name), LOCAL)


@pytest.mark.parametrize("name", registry.BACKEND_NAMES)
def test_resources_only_where_the_backend_places_replicas(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "missing_sdk_message", lambda kind: None)
    config = _config(name, "backend.resources={num_cpus = 1}")
    if registry.backend(name).takes_resources:
        preflight.check_backend(config, SHARED)
    else:
        with pytest.raises(ConfigError, match=rf"backend.resources: the {name} backend takes no"):
            preflight.check_backend(config, SHARED)


def test_forwarded_variables_must_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMPOSER_TEST_UNSET_VAR", raising=False)
    config = _config("local", 'backend.forward_env=["COMPOSER_TEST_UNSET_VAR"]')
    with pytest.raises(ConfigError, match=r"\$COMPOSER_TEST_UNSET_VAR not set"):
        preflight.check_backend(config, LOCAL)
    monkeypatch.setenv("COMPOSER_TEST_UNSET_VAR", "x")
    preflight.check_backend(config, LOCAL)
