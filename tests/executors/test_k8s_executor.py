"""K8sExecutor against a local Kubernetes API stand-in that really runs each index's command."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

sys.path.insert(0, str(Path(__file__).parent))
from _executor_helpers import install_replica_script, run_seed_driver_snippet  # noqa: E402
from _executor_helpers import replica_args as _args  # noqa: E402
from standins.common import StandinServer  # noqa: E402
from standins.k8s_api import K8sApiStandin, compress_indexes  # noqa: E402

from composer_replication.executors.executor import ReplicaStatus  # noqa: E402
from composer_replication.executors.k8s import K8sExecutor, parse_indexes  # noqa: E402
from composer_replication.executors.redact import (  # noqa: E402
    CloudExecutorError,
    MissingCredentialsError,
)

pytestmark = pytest.mark.server

TOKEN = "k8s-sekrit-token-4f1e9a"


@pytest.fixture
def cluster(tmp_path: Path):
    from kubernetes import client

    install_replica_script(tmp_path)
    standin = K8sApiStandin(
        tmp_path, token=TOKEN, secrets={"hf-token": {"HF_TOKEN": "hf_valueFromSecret123"}}
    )
    with StandinServer(standin) as server:
        cfg = client.Configuration()
        cfg.host = server.url
        cfg.api_key = {"authorization": TOKEN}
        cfg.api_key_prefix = {"authorization": "Bearer"}

        def make(**kw):
            kw.setdefault("python", sys.executable)
            kw.setdefault("poll_interval", 0.1)
            return K8sExecutor("python:3.11-slim", api_client=client.ApiClient(cfg), **kw)

        yield standin, make, tmp_path


def test_parse_indexes_roundtrip():
    assert parse_indexes("0-2,4,7-8") == {0, 1, 2, 4, 7, 8}
    assert parse_indexes("") == set() and parse_indexes(None) == set()
    assert parse_indexes(compress_indexes({5, 0, 1, 3})) == {0, 1, 3, 5}


def test_indexed_job_runs_replicas_to_completion(cluster):
    standin, make, tmp = cluster
    ex = make(secret_env={"HF_TOKEN": ("hf-token", "HF_TOKEN")}, backoff_limit_per_index=2)
    store = tmp / "store"
    handles = ex.launch_replicas(
        3,
        "diloco_replica.py",
        _args(store, **{"show-env": ["HF_TOKEN", "MY_VAR"]}),
        env={"MY_VAR": "x"},
        resources={"gpu": 1, "memory": "2Gi"},
    )
    assert [h.replica_id for h in handles] == [0, 1, 2]
    assert all(h.status is ReplicaStatus.PENDING and h.backend == "k8s" for h in handles)

    # The one Job body the API server received.
    [body] = standin.created
    spec = body["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 3
    assert spec["backoffLimitPerIndex"] == 2
    c = spec["template"]["spec"]["containers"][0]
    assert c["image"] == "python:3.11-slim"
    assert c["command"][:4] == [
        sys.executable,
        "diloco_replica.py",
        "--rendezvous",
        f"file://{store}",
    ]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1", "memory": "2Gi"}
    env = {e["name"]: e for e in c["env"]}
    assert env["REPLICA_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert env["WORLD_SIZE"]["value"] == "3" and env["MY_VAR"]["value"] == "x"
    assert "hf_valueFromSecret123" not in json.dumps(body)  # the secret stays in the cluster

    ex.poll(handles)  # non-blocking: returns at once, whatever the replicas' state
    assert not any(h.status in (ReplicaStatus.FAILED, ReplicaStatus.CANCELLED) for h in handles)
    result = ex.collect(handles, timeout=60)
    assert {h.replica_id: h.exit_code for h in result} == {0: 0, 1: 0, 2: 0}
    assert all(h.status is ReplicaStatus.SUCCEEDED for h in result)
    for rank in range(3):
        rec = json.loads((store / f"rank-{rank}.json").read_text())
        assert rec["rank"] == rank and rec["world_size"] == 3
        assert rec["rendezvous_env"] == f"file://{store}"
        assert rec["env"] == {"HF_TOKEN": "hf_valueFromSecret123", "MY_VAR": "x"}
    assert "replica 1 of 3 starting" in ex.logs(handles[1])
    assert ex.logs(handles[2], tail=1).strip() == "replica 2 done"


def test_failing_replica_is_retried_then_reported_with_log_tail(cluster):
    standin, make, tmp = cluster
    ex = make(backoff_limit_per_index=1)
    handles = ex.launch_replicas(
        2, "diloco_replica.py", _args(tmp / "s", **{"fail-rank": 1, "exit-code": 7})
    )
    result = ex.collect(handles, timeout=60)
    ok, bad = result
    assert ok.status is ReplicaStatus.SUCCEEDED and ok.exit_code == 0 and ok.restarts == 0
    assert bad.status is ReplicaStatus.FAILED and bad.exit_code == 7
    assert bad.restarts == 1  # backoffLimitPerIndex=1: one retry, then the index failed
    assert "exited with code 7" in bad.error and "boom: replica 1 simulated failure" in bad.error
    job = standin.jobs[("default", handles[0].job_id.split("/")[0])]
    assert job["status"]["failedIndexes"] == "1" and job["status"]["completedIndexes"] == "0"


def test_cancel_mid_run_deletes_job_foreground(cluster):
    standin, make, tmp = cluster
    ex = make()
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s", sleep=60))
    deadline = time.monotonic() + 20
    while not all(h.status is ReplicaStatus.RUNNING for h in ex.poll(handles)) or not all(
        "starting" in ex.logs(h) for h in handles
    ):
        assert time.monotonic() < deadline, [h.status for h in handles]
        time.sleep(0.1)
    pods = [p for p in standin.pods.values()]
    ex.cancel(handles)
    assert all(h.status is ReplicaStatus.CANCELLED for h in handles)
    [(name, body)] = standin.deletes
    assert body["propagationPolicy"] == "Foreground"
    for pod in pods:  # the processes behind the pods are gone
        pod["_container"].wait(5)
        assert pod["_container"].exit_code == 143
    assert "replica 0 of 2 starting" in ex.logs(handles[0])  # kept from before deletion


def test_cancel_subset_keeps_the_others_running(cluster):
    standin, make, tmp = cluster
    ex = make(backoff_limit_per_index=3)
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s", sleep=3))
    deadline = time.monotonic() + 20
    while not all(h.status is ReplicaStatus.RUNNING for h in ex.poll(handles)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ex.cancel([handles[1]])
    assert standin.deletes == []  # only the pod went, not the job
    result = ex.collect(handles, timeout=30)
    assert result[0].status is ReplicaStatus.SUCCEEDED
    assert result[1].status is ReplicaStatus.CANCELLED
    job = standin.jobs[("default", handles[0].job_id.split("/")[0])]
    # exit 143 matched the FailIndex rule: the cancelled index was not retried.
    assert job["_indexes"][1]["failures"] == 1 and job["status"]["failedIndexes"] == "1"


def test_job_deleted_outside_the_executor(cluster):
    standin, make, tmp = cluster
    ex = make()
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s", sleep=60))
    with standin._lock:
        standin.jobs.clear()  # as `kubectl delete job` from elsewhere would (reads give 404)
    ex.cancel(handles[:1])  # nothing left to stop: no error, no delete request
    assert handles[0].status is ReplicaStatus.CANCELLED and not standin.deletes
    ex.poll(handles)
    assert handles[1].status is ReplicaStatus.FAILED
    assert "no longer exists (deleted outside this executor)" in handles[1].error


def test_collect_timeout_cancels_and_reports(cluster):
    standin, make, tmp = cluster
    ex = make()
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s", sleep=60))
    t0 = time.monotonic()
    result = ex.collect(handles, timeout=1.5)
    assert time.monotonic() - t0 < 15
    for h in result:
        assert h.status is ReplicaStatus.FAILED
        assert h.error.startswith("timeout after 1.5s")
    assert standin.deletes and standin.deletes[0][1]["propagationPolicy"] == "Foreground"


def test_seed_driver_snippet_unchanged(cluster, capsys):
    _, make, tmp = cluster
    executor = make()
    run_seed_driver_snippet(executor, tmp / "seed-store", capsys)


def test_rank_offset_for_mixed_placement(cluster):
    _, make, tmp = cluster
    ex = make()
    store = tmp / "s"
    handles = ex.launch_ranks([2, 3], 4, "diloco_replica.py", _args(store))
    assert [h.replica_id for h in ex.collect(handles, timeout=60)] == [2, 3]
    assert sorted(p.name for p in store.iterdir()) == ["rank-2.json", "rank-3.json"]
    assert json.loads((store / "rank-3.json").read_text())["replica_rank_env"] == "3"
    with pytest.raises(ValueError, match="consecutive"):
        ex.launch_ranks([0, 2], 4, "diloco_replica.py", _args(store))


def test_bad_input_fails_before_any_request(cluster, monkeypatch, tmp_path):
    standin, make, tmp = cluster
    with pytest.raises(ValueError, match="image"):
        K8sExecutor(None)
    ex = make()
    with pytest.raises(ValueError, match="n_replicas"):
        ex.launch_replicas(0, "diloco_replica.py")
    with pytest.raises(ValueError, match="GPU"):
        ex.launch_replicas(2, "diloco_replica.py", resources={"gpu": "half"})
    with pytest.raises(ValueError, match="unknown resource"):
        ex.launch_replicas(2, "diloco_replica.py", resources={"tpu": 1})
    assert standin.requests == []
    # No in-cluster service account and no kubeconfig: a clear error, nothing launched.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(MissingCredentialsError, match="KUBECONFIG"):
        K8sExecutor("python:3.11")


def test_failed_create_leaves_nothing_and_never_shows_the_token(cluster, caplog):
    standin, make, tmp = cluster
    caplog.set_level(logging.DEBUG)
    ex = make()
    standin.echo_auth_on_error = True
    with pytest.raises(CloudExecutorError) as info:
        ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s"))
    text = f"{info.value}\n{info.value!r}\n{caplog.text}"
    assert "creating job" in str(info.value) and "500" in str(info.value)
    assert TOKEN not in text and "***" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert standin.jobs == {}
    assert any(m == "DELETE" for m, *_ in standin.requests)  # best-effort cleanup was tried


def test_missing_sdk_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes.client", None)  # as if not installed
    with pytest.raises(ImportError, match=r"composer-replication\[k8s\]"):
        K8sExecutor("python:3.11")


def test_redact_masks_known_and_credential_looking_values():
    from composer_replication.executors.redact import redact

    text = (
        "Authorization: Bearer abc.def-123 token=xyz hf_abcdefghijkl AKIAABCDEFGHIJKLMNOP "
        'secret_key: "q1w2e3" keep-me long-secret-value'
    )
    out = redact(text, ["long-secret-value", None, ""])
    for leaked in (
        "abc.def-123",
        "xyz",
        "hf_abcdefghijkl",
        "AKIAABCDEFGHIJKLMNOP",
        "q1w2e3",
        "long-secret-value",
    ):
        assert leaked not in out
    assert "keep-me" in out and out.count("***") == 6


def test_job_spec_pod_failure_policy():
    from kubernetes import client

    from composer_replication.executors.k8s_job import build_indexed_job

    job = build_indexed_job(
        client,
        name="j",
        image="img",
        command=["python", "x.py"],
        base_env={"REPLICA_RANK": "0", "A": "1"},
        rank_keys={"REPLICA_RANK"},
        offset=0,
        count=2,
        limits={},
        secret_env={},
        env_from_secrets=[],
        backoff_limit_per_index=1,
        ttl_seconds_after_finished=None,
        active_deadline_seconds=None,
        service_account=None,
        node_selector=None,
        image_pull_secrets=[],
        labels={},
    )
    body = client.ApiClient().sanitize_for_serialization(job)
    rules = body["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert rules[1] == {"action": "FailIndex", "onExitCodes": {"operator": "In", "values": [143]}}
    env = body["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "A", "value": "1"} in env and "resources" not in body["spec"]["template"][
        "spec"
    ]["containers"][0]


def test_active_deadline_fails_the_unfinished_replicas(cluster):
    _, make, tmp = cluster
    ex = make(active_deadline_seconds=1)
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s", sleep=60))
    result = ex.collect(handles, timeout=30)
    for h in result:
        assert h.status is ReplicaStatus.FAILED
        assert "DeadlineExceeded" in h.error


def test_mixed_placement_local_plus_kubernetes(cluster):
    """One run over two executors (the seed's cross-backend placement): ranks 0 locally,
    1-2 as a Kubernetes Indexed Job (rank offset through the shell wrapper); one store."""
    from composer_replication.executors import LocalProcessExecutor, MultiExecutor

    _, make, tmp = cluster
    store = tmp / "mixed-store"
    multi = MultiExecutor(
        [(LocalProcessExecutor(cwd=tmp, log_dir=tmp / "local-logs"), 1), (make(), 2)]
    )
    handles = multi.launch_replicas(3, "diloco_replica.py", _args(store))
    assert [h.backend for h in handles] == ["local", "k8s", "k8s"]
    result = multi.collect(handles, timeout=60)
    assert {h.replica_id: h.exit_code for h in result} == {0: 0, 1: 0, 2: 0}
    for rank in range(3):
        rec = json.loads((store / f"rank-{rank}.json").read_text())
        assert rec["rank"] == rank and rec["world_size"] == 3
