"""The preflight backend checks follow the executor registry, for every backend it lists."""

from __future__ import annotations

import sys

import pytest

from composer_replication.config import ConfigError, load_config
from composer_replication.executors import registry
from composer_replication.run import preflight

SHARED = "s3://bucket/runs/x/"
LOCAL = "file:///tmp/runs/x/store/"


NEEDS_IMAGE = ("hf-jobs", "k8s", "sagemaker")  # their executors' one required option


def _config(kind: str, *extra: str):  # noqa: ANN202 - RunConfig
    image = ["backend.options.image=registry/repo:tag"] if kind in NEEDS_IMAGE else []
    return load_config(overrides=[f"backend.kind={kind}", *image, *extra])


@pytest.mark.parametrize("name", NEEDS_IMAGE)
def test_a_backend_without_its_image_is_refused(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "missing_sdk_message", lambda kind: None)
    config = load_config(overrides=[f"backend.kind={name}"])
    with pytest.raises(ConfigError, match=rf"^backend.options.image: the {name} backend needs it"):
        preflight.check_backend(config, SHARED)


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


def _hub_endpoint(monkeypatch: pytest.MonkeyPatch, endpoint: str, cache: str) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_an_unknown_or_unreachable_hub_model_fails_before_any_replica(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub model that is not cached must answer now: a 404 from a hub stand-in on 127.0.0.1
    and a closed port both give one line naming model.name, in well under a second."""
    import http.server
    import socket
    import threading
    import time

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _hub_endpoint(monkeypatch, f"http://127.0.0.1:{server.server_port}", str(tmp_path))
        config = load_config(overrides=["model.name=no-such-org/no-such-model"])
        with pytest.raises(ConfigError, match=r"model.name: cannot reach hub model 'no-such-org"):
            preflight.check_model(config)
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    _hub_endpoint(monkeypatch, f"http://127.0.0.1:{closed}", str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        preflight.check_model(config)
    assert "cannot reach hub model" in str(info.value) and "hf download" in str(info.value)
    assert time.monotonic() - t0 < 15


def test_a_cached_hub_model_needs_no_network(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = tmp_path / "models--some-org--some-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--some-org--some-model" / "refs").mkdir()
    (tmp_path / "models--some-org--some-model" / "refs" / "main").write_text("abc123")
    _hub_endpoint(monkeypatch, "http://127.0.0.1:9", str(tmp_path))  # unreachable: unused
    preflight.check_model(load_config(overrides=["model.name=some-org/some-model"]))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="not in the local cache and HF_HUB_OFFLINE"):
        preflight.check_model(load_config(overrides=["model.name=other-org/other-model"]))
