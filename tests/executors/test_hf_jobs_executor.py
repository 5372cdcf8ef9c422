"""HFJobsExecutor through huggingface_hub's real HfApi against a local Jobs REST API stand-in."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

sys.path.insert(0, str(Path(__file__).parent))
from _executor_helpers import install_replica_script, run_seed_driver_snippet  # noqa: E402
from _executor_helpers import replica_args as _args  # noqa: E402
from standins.common import StandinServer  # noqa: E402
from standins.hf_jobs_api import USER, HFJobsStandin  # noqa: E402

from composer_replication.executors.executor import ReplicaStatus  # noqa: E402
from composer_replication.executors.hf_jobs import (  # noqa: E402
    HFJobsExecutor,
    known_flavors,
)
from composer_replication.executors.redact import (  # noqa: E402
    CloudExecutorError,
    MissingCredentialsError,
)

pytestmark = pytest.mark.server

TOKEN = "hf_StandinToken0123456789abcdef"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch):
    from huggingface_hub import HfApi

    for var in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_OIDC_RESOURCE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved token from the machine
    install_replica_script(tmp_path)
    standin = HFJobsStandin(tmp_path, token=TOKEN, flavors=known_flavors())
    with StandinServer(standin) as server:

        def make(**kw):
            kw.setdefault("python", sys.executable)
            kw.setdefault("poll_interval", 0.1)
            kw.setdefault("flavor", "a10g-small")
            api = HfApi(endpoint=server.url, token=TOKEN)
            return HFJobsExecutor("pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime", api=api, **kw)

        yield standin, make, tmp_path


def test_flavors_come_from_huggingface_hub():
    flavors = known_flavors()
    assert "a10g-small" in flavors and "cpu-basic" in flavors and "h200" in flavors


def test_launch_poll_collect_logs(hub):
    standin, make, tmp = hub
    ex = make(timeout="30m", labels={"team": "rl"}, secrets={"WANDB_API_KEY": "wandb-secret-xyz"})
    store = tmp / "store"
    handles = ex.launch_replicas(
        3,
        "diloco_replica.py",
        _args(store, **{"show-env": ["WANDB_API_KEY", "MY_VAR"]}),
        env={"MY_VAR": "v"},
        resources={"flavor": "a100-large"},
    )
    assert [h.replica_id for h in handles] == [0, 1, 2]
    assert all(h.status is ReplicaStatus.PENDING for h in handles)
    assert handles[0].log_location.endswith(f"/jobs/{USER}/{handles[0].job_id}")
    bodies = standin.created
    assert len(bodies) == 3
    for rank, body in enumerate(bodies):
        assert body["dockerImage"] == "pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime"
        assert body["flavor"] == "a100-large" and body["timeoutSeconds"] == 1800
        assert body["command"][:2] == [sys.executable, "diloco_replica.py"]
        assert body["environment"]["REPLICA_RANK"] == str(rank)
        assert body["environment"]["WORLD_SIZE"] == "3"
        assert body["environment"]["DILOCO_RENDEZVOUS"] == f"file://{store}"
        assert body["secrets"] == {"WANDB_API_KEY": "wandb-secret-xyz"}
        assert body["labels"]["diloco-rank"] == str(rank) and body["labels"]["team"] == "rl"
        assert "WANDB_API_KEY" not in body["environment"]
    result = ex.collect(handles, timeout=60)
    assert {h.replica_id: h.exit_code for h in result} == {0: 0, 1: 0, 2: 0}
    assert all(h.status is ReplicaStatus.SUCCEEDED and h.end_time for h in result)
    for rank in range(3):
        rec = json.loads((store / f"rank-{rank}.json").read_text())
        assert rec["rank"] == rank and rec["env"] == {
            "WANDB_API_KEY": "wandb-secret-xyz",
            "MY_VAR": "v",
        }
    log = ex.logs(handles[1])
    assert log == "replica 1 of 3 starting\nreplica 1 done\n"  # "Job started" banner dropped
    assert ex.logs(handles[1], tail=1) == "replica 1 done\n"


def test_failing_replica_reported_with_exit_code_and_log_tail(hub):
    _, make, tmp = hub
    ex = make()
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s", **{"fail-rank": 0}))
    ok = ex.collect(handles, timeout=60)
    assert ok[0].status is ReplicaStatus.FAILED and ok[0].exit_code == 3
    assert "exit code: 3" in ok[0].error and "boom: replica 0 simulated failure" in ok[0].error
    assert ok[1].status is ReplicaStatus.SUCCEEDED and ok[1].exit_code == 0


def test_cancel_mid_run(hub):
    standin, make, tmp = hub
    ex = make()
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s", sleep=60))
    deadline = time.monotonic() + 20
    while not all(h.status is ReplicaStatus.RUNNING for h in ex.poll(handles)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ex.cancel(handles)
    assert all(h.status is ReplicaStatus.CANCELLED for h in handles)
    assert sorted(standin.cancels) == sorted(h.job_id for h in handles)
    for h in handles:
        container = standin.jobs[h.job_id]["container"]
        container.wait(5)
        assert container.exit_code == 143
    assert ex.poll(handles)[0].status is ReplicaStatus.CANCELLED


def test_collect_timeout_and_hub_timeout(hub):
    standin, make, tmp = hub
    ex = make()
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s", sleep=60))
    result = ex.collect(handles, timeout=1.0)
    assert all(h.status is ReplicaStatus.FAILED for h in result)
    assert all(h.error.startswith("timeout after 1s") for h in result)
    assert sorted(standin.cancels) == sorted(h.job_id for h in handles)
    # The per-job timeout sent to the Hub: the service itself stops the job.
    ex2 = make(timeout=1)
    [h] = ex2.launch_replicas(1, "diloco_replica.py", _args(tmp / "s2", sleep=60))
    [h] = ex2.collect([h], timeout=30)
    assert h.status is ReplicaStatus.FAILED and "timed out" in h.error


def test_seed_driver_snippet_unchanged(hub, capsys):
    _, make, tmp = hub
    executor = make()
    run_seed_driver_snippet(executor, tmp / "seed-store", capsys)


def test_partial_launch_failure_cancels_the_started_jobs(hub, caplog):
    standin, make, tmp = hub
    caplog.set_level(logging.DEBUG)
    ex = make(secrets={"WANDB_API_KEY": "wandb-secret-xyz"})
    standin.fail_create_after = 2
    with pytest.raises(CloudExecutorError, match="starting replica 2") as info:
        ex.launch_replicas(3, "diloco_replica.py", _args(tmp / "s", sleep=60))
    assert len(standin.created) == 2
    assert sorted(standin.cancels) == sorted(standin.jobs)  # both started jobs were cancelled
    text = f"{info.value!r}{caplog.text}"
    assert TOKEN not in text and "wandb-secret-xyz" not in text
    assert info.value.__cause__ is None


def test_bad_input_and_missing_token_fail_before_launch(hub, monkeypatch):
    standin, make, tmp = hub
    with pytest.raises(ValueError, match="unknown HF Jobs flavor 'a100-huge'"):
        make(flavor="a100-huge")
    with pytest.raises(ValueError, match="image"):
        HFJobsExecutor("", token=TOKEN)
    ex = make()
    with pytest.raises(ValueError, match="n_replicas"):
        ex.launch_replicas(0, "diloco_replica.py")
    with pytest.raises(ValueError, match="unknown HF Jobs flavor"):
        ex.launch_replicas(1, "diloco_replica.py", resources={"flavor": "tpu-v5"})
    with pytest.raises(ValueError, match="GPUs come with the flavor"):
        ex.launch_replicas(1, "diloco_replica.py", resources={"gpu": 1})
    assert standin.requests == []
    with pytest.raises(MissingCredentialsError, match="HF_TOKEN"):
        HFJobsExecutor("python:3.12", endpoint="http://127.0.0.1:9")
    # A wrong token: the Hub refuses whoami before any job exists, and the token is redacted.
    from huggingface_hub import HfApi

    bad = HFJobsExecutor(
        "python:3.12", api=HfApi(endpoint=ex.api.endpoint, token="hf_WrongToken99999999")
    )
    with pytest.raises(CloudExecutorError, match="whoami") as info:
        bad.launch_replicas(1, "diloco_replica.py")
    assert "hf_WrongToken99999999" not in repr(info.value) and standin.created == []


def test_missing_sdk_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    with pytest.raises(ImportError, match=r"composer-replication\[hf-jobs\]"):
        HFJobsExecutor("python:3.12", token=TOKEN)
