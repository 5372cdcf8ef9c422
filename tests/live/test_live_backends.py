"""Live smoke tests of the cloud backends: 2 replicas, 2 rounds of the embedded default.

Opt-in: they run only with `-m live` (or `COMPOSER_LIVE=1`) AND when the backend's credentials
and a store the cloud replicas can reach are present; otherwise each is skipped with the reason.
Nothing here runs in CI (no credentials there). docs/backends.md ("Live smoke tests") lists the
variables.

What is checked is what a user relies on: `composer-replication train` with that backend
finishes with exit 0, both replicas succeeded, and two outer rounds were committed through the
store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from composer_replication.cli import main

pytestmark = pytest.mark.live

# 2 rounds of the embedded default, at its own H
ROUNDS = ["train.max_steps=100", "diloco.sync_every_h=50", "backend.n_replicas=2"]


def _has_file(path: str) -> bool:
    return Path(path).expanduser().is_file()


# backend.kind -> (credentials present?, what is missing, backend.options from the environment)
Probe = tuple[bool, str, dict[str, str]]


def _modal() -> Probe:
    ok = bool(os.environ.get("MODAL_TOKEN_ID")) or _has_file("~/.modal.toml")
    return ok, "Modal credentials (MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or ~/.modal.toml)", {}


def _hf_jobs() -> Probe:
    ok = bool(os.environ.get("HF_TOKEN")) or _has_file("~/.cache/huggingface/token")
    return ok, "a Hugging Face token (HF_TOKEN or `hf auth login`)", {}


def _sagemaker() -> Probe:
    aws = bool(os.environ.get("AWS_ACCESS_KEY_ID")) or _has_file("~/.aws/credentials")
    role = os.environ.get("SAGEMAKER_ROLE_ARN", "")
    return aws and bool(role), "AWS credentials and SAGEMAKER_ROLE_ARN", {}


def _k8s() -> Probe:
    ok = bool(os.environ.get("KUBECONFIG")) or _has_file("~/.kube/config")
    ns = os.environ.get("COMPOSER_LIVE_K8S_NAMESPACE")
    return ok, "a kubeconfig (KUBECONFIG or ~/.kube/config)", {"namespace": ns} if ns else {}


def _ray() -> Probe:
    address = os.environ.get("RAY_ADDRESS", "")
    return bool(address), "a Ray cluster (RAY_ADDRESS)", {"address": address}


BACKENDS = {"modal": _modal, "hf-jobs": _hf_jobs, "sagemaker": _sagemaker, "k8s": _k8s, "ray": _ray}
NEEDS_IMAGE = {"modal", "hf-jobs", "sagemaker", "k8s"}


def _opted_in(config: pytest.Config) -> bool:
    return os.environ.get("COMPOSER_LIVE") == "1" or "live" in (config.getoption("-m") or "")


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_two_rounds_of_the_default_on(
    kind: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    if not _opted_in(request.config):
        pytest.skip("live cloud test: opt in with `pytest -m live` (or COMPOSER_LIVE=1)")
    present, what, options = BACKENDS[kind]()
    if not present:
        pytest.skip(f"live {kind} test: needs {what}")
    store = os.environ.get("COMPOSER_LIVE_STORE", "")
    if not store.startswith(("s3://", "gs://")):
        pytest.skip(
            "live test: needs COMPOSER_LIVE_STORE, an s3:// or gs:// prefix the cloud replicas "
            "can reach (a file:// store is not visible from the cloud)"
        )
    image = os.environ.get("COMPOSER_LIVE_IMAGE", "")
    if kind in NEEDS_IMAGE and not image:
        pytest.skip(f"live {kind} test: needs COMPOSER_LIVE_IMAGE (an image with this package)")
    if kind in NEEDS_IMAGE:
        options["image"] = image
    table = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items()) + "}"
    monkeypatch.chdir(tmp_path)
    name = f"live-{kind}"
    uri = store.rstrip("/") + f"/{name}-{os.getpid()}/"
    code = main(
        [
            "train",
            *ROUNDS,
            f"backend.kind={kind}",
            f"store.uri={uri}",
            f"backend.options={table}",
            "--name",
            name,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    driver = json.loads((tmp_path / "runs" / name / "driver.json").read_text())
    assert driver["status"] == "finished", driver
    assert [r["status"] for r in driver["replicas"]] == ["succeeded", "succeeded"]
    assert "2 outer rounds" in out
