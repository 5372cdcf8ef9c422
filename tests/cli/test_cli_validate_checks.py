"""`config validate`'s checks beyond the config's own keys: the store's scheme (also refused by
`train` before it writes anything), a backend's credentials (`--check-backend`: the executor
built as `train` builds it, nothing launched) and the hub check that `--offline` or
HF_HUB_OFFLINE=1 skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_replication.cli import main
from composer_replication.config import ConfigError
from composer_replication.exchange.store import RUN_STORE_SCHEMES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("uri", ["s4://bucket/runs/x", "http://host/runs/x", "memory://x"])
def test_an_unsupported_store_scheme_is_refused_naming_the_supported_ones(
    uri: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["config", "validate", f"store.uri={uri}"]) == 2
    err = capsys.readouterr().err
    scheme = uri.partition("://")[0]
    assert f"store.uri: {uri!r}: the scheme '{scheme}://' is not supported" in err
    assert all(f"{s}://" in err for s in RUN_STORE_SCHEMES), err


@pytest.mark.parametrize("uri", ["s3://bucket/runs/x", "gs://bucket/runs/x", "runs/x/store"])
def test_a_supported_store_scheme_passes(uri: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "validate", f"store.uri={uri}"]) == 0, capsys.readouterr().err


def test_train_refuses_the_scheme_before_writing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "store.uri=s4://bucket/runs/x"]) == 2
    assert "the scheme 's4://' is not supported" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _validate(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`config validate ARGS` in a fresh interpreter whose HOME is empty (no ~/.kube/config,
    no ~/.modal.toml, no saved tokens) and without the cloud SDKs' credential variables."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MODAL_", "KUBE", "AWS_", "HF_TOKEN"))
    }
    clean.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT), **env)
    return subprocess.run(
        [sys.executable, "-m", "composer_replication", "config", "validate", *args],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_backend_names_missing_kubernetes_credentials(tmp_path: Path) -> None:
    pytest.importorskip("kubernetes")
    missing = str(tmp_path / "no-such-kubeconfig")
    proc = _validate(
        tmp_path, "examples/k8s.toml", "--check-backend", "--offline", KUBECONFIG=missing
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "backend (k8s): no Kubernetes credentials" in proc.stderr
    assert "KUBECONFIG" in proc.stderr
    # Without --check-backend the same config passes: the credentials are not looked at.
    proc = _validate(tmp_path, "examples/k8s.toml", "--offline", KUBECONFIG=missing)
    assert proc.returncode == 0, proc.stderr


KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://127.0.0.1:6443"}
users:
- name: u
  user: {token: not-a-real-token}
contexts:
- name: ctx
  context: {cluster: c, user: u}
current-context: ctx
"""


def test_check_backend_passes_with_a_kubeconfig(tmp_path: Path) -> None:
    pytest.importorskip("kubernetes")
    config = tmp_path / "kubeconfig"
    config.write_text(KUBECONFIG)
    proc = _validate(
        tmp_path, "examples/k8s.toml", "--check-backend", "--offline", KUBECONFIG=str(config)
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith(
        "(backend credentials found; hub model not checked: offline)"
    ), proc.stdout


def test_check_backend_names_a_missing_modal_token(tmp_path: Path) -> None:
    pytest.importorskip("modal")
    proc = _validate(tmp_path, "examples/modal_s3.toml", "--check-backend", "--offline")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "backend (modal): no Modal credentials: run `modal token new`" in proc.stderr


def test_check_backend_on_the_local_backend(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "validate", "--check-backend"]) == 0
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith("(executor built; the local backend needs no credentials)")
    )


@pytest.fixture
def unreachable_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    from composer_replication.run import preflight

    def unreachable(name: str, **_: object) -> None:
        raise ConfigError(f"model.name: cannot reach hub model {name!r} (test: no network)")

    monkeypatch.setattr(preflight, "check_hub_model", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.mark.usefixtures("unreachable_hub")
def test_offline_skips_the_hub_check_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["config", "validate", "examples/gpu_qwen05b.toml"]) == 2
    assert "cannot reach hub model 'Qwen/Qwen2.5-0.5B-Instruct'" in capsys.readouterr().err
    assert main(["config", "validate", "examples/gpu_qwen05b.toml", "--offline"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("(hub model not checked: offline)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["config", "validate", "examples/gpu_qwen05b.toml"]) == 0
    assert "hub model not checked: offline" in capsys.readouterr().out
