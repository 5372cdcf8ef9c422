"""SageMakerExecutor through boto3: moto's server for create/describe, and a local stand-in
(which really runs each job's container command) for stop, state transitions and logs."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest

boto3 = pytest.importorskip("boto3")

sys.path.insert(0, str(Path(__file__).parent))
from _executor_helpers import install_replica_script, run_seed_driver_snippet  # noqa: E402
from _executor_helpers import replica_args as _args  # noqa: E402
from standins.common import StandinServer  # noqa: E402
from standins.sagemaker_api import SageMakerStandin  # noqa: E402

from composer_replication.executors.executor import ReplicaStatus  # noqa: E402
from composer_replication.executors.redact import (  # noqa: E402
    CloudExecutorError,
    MissingCredentialsError,
)
from composer_replication.executors.sagemaker import (  # noqa: E402
    SageMakerExecutor,
    training_instance_types,
)

pytestmark = pytest.mark.server

ACCESS_KEY = "AKIASTANDIN000000001"
SECRET_KEY = "sm/SecretAccessKey+NeverPrinted0123456789"
ROLE = "arn:aws:iam::123456789012:role/SageMakerExecution"
IMAGE = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.5-gpu-py311"


def _session():
    return boto3.Session(
        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY, region_name="us-east-1"
    )


@pytest.fixture
def aws(tmp_path: Path):
    install_replica_script(tmp_path)
    standin = SageMakerStandin(tmp_path, access_key=ACCESS_KEY, pending_seconds=0.5)
    with StandinServer(standin) as server:

        def make(**kw):
            kw.setdefault("python", sys.executable)
            kw.setdefault("poll_interval", 0.1)
            kw.setdefault("failure_file", "$STANDIN_OPT_ML/failure")
            return SageMakerExecutor(
                IMAGE,
                role_arn=ROLE,
                output_path="s3://my-bucket/diloco/out",
                session=_session(),
                endpoint_url=server.url,
                **kw,
            )

        yield standin, make, tmp_path


def test_create_and_describe_against_moto_server(tmp_path):
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        ex = SageMakerExecutor(
            IMAGE,
            role_arn=ROLE,
            output_path="s3://b/out",
            session=_session(),
            endpoint_url=f"http://{host}:{port}",
            instance_type="ml.p4d.24xlarge",
            python="python3",
            poll_interval=0.05,
        )
        handles = ex.launch_replicas(2, "composer_replication.run.replica", _args(tmp_path))
        d = ex.sm.describe_training_job(TrainingJobName=handles[1].job_id)
        assert d["AlgorithmSpecification"]["ContainerEntrypoint"] == [
            "python3",
            "-m",
            "composer_replication.executors.remote",
            "--failure-file",
            "/opt/ml/output/failure",
            "--",
            "python3",
            "-m",
            "composer_replication.run.replica",
            "--rendezvous",
            f"file://{tmp_path}",
            "--rank_env",
            "REPLICA_RANK",
        ]
        assert d["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
        assert d["RoleArn"] == ROLE and d["OutputDataConfig"]["S3OutputPath"] == "s3://b/out"
        # moto finishes jobs at once; the mapping reads its real describe response.
        result = ex.collect(handles, timeout=30)
        assert {h.replica_id: h.exit_code for h in result} == {0: 0, 1: 0}
        assert ex.logs(result[0]) == ""  # moto has no log group for training jobs
    finally:
        server.stop()


def test_launch_poll_collect_logs(aws):
    standin, make, tmp = aws
    ex = make(instance_type="ml.g5.2xlarge", max_runtime_seconds=3600, tags={"team": "rl"})
    store = tmp / "store"
    handles = ex.launch_replicas(
        3, "diloco_replica.py", _args(store, **{"show-env": ["MY_VAR"]}), env={"MY_VAR": "m"}
    )
    assert [h.status for h in handles] == [ReplicaStatus.PENDING] * 3
    for rank, body in enumerate(standin.created):
        assert body["AlgorithmSpecification"]["TrainingImage"] == IMAGE
        entry = body["AlgorithmSpecification"]["ContainerEntrypoint"]
        assert entry[entry.index("--") + 1 :][:2] == [sys.executable, "diloco_replica.py"]
        assert body["ResourceConfig"] == {
            "InstanceType": "ml.g5.2xlarge",
            "InstanceCount": 1,
            "VolumeSizeInGB": 50,
        }
        assert body["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600}
        assert body["Environment"]["REPLICA_RANK"] == str(rank)
        assert body["Environment"]["WORLD_SIZE"] == "3"
        assert {"Key": "diloco-rank", "Value": str(rank)} in body["Tags"]
        assert {"Key": "team", "Value": "rl"} in body["Tags"]
    seen = set()
    deadline = time.monotonic() + 60
    while not all(h.status.done for h in ex.poll(handles)):
        seen |= {h.status for h in handles}
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ReplicaStatus.PENDING in seen  # Starting/Downloading came first
    assert {h.replica_id: h.exit_code for h in handles} == {0: 0, 1: 0, 2: 0}
    for rank in range(3):
        rec = json.loads((store / f"rank-{rank}.json").read_text())
        assert rec["rank"] == rank and rec["env"] == {"MY_VAR": "m"}
    assert ex.logs(handles[0]) == "replica 0 of 3 starting\nreplica 0 done\n"
    assert ex.logs(handles[0], tail=1) == "replica 0 done\n"


def test_failing_replica_reported_with_exit_code_and_log_tail(aws):
    _, make, tmp = aws
    ex = make()
    handles = ex.launch_replicas(
        2, "diloco_replica.py", _args(tmp / "s", **{"fail-rank": 1, "exit-code": 9})
    )
    result = ex.collect(handles, timeout=60)
    assert result[0].status is ReplicaStatus.SUCCEEDED and result[0].exit_code == 0
    assert result[1].status is ReplicaStatus.FAILED and result[1].exit_code == 9
    assert (
        "AlgorithmError: exit code: 9" in result[1].error and "boom: replica 1" in result[1].error
    )
    # Without the in-container wrapper the service's own wording is all there is to parse.
    bare = make(failure_file=None)
    [h] = bare.collect(
        bare.launch_replicas(1, "diloco_replica.py", _args(tmp / "s2", **{"fail-rank": 0})),
        timeout=60,
    )
    assert h.status is ReplicaStatus.FAILED and h.exit_code == 3


def test_cancel_mid_run_stops_jobs(aws):
    standin, make, tmp = aws
    ex = make()
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s", sleep=60))
    deadline = time.monotonic() + 20
    while not all(h.status is ReplicaStatus.RUNNING for h in ex.poll(handles)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ex.cancel(handles)
    assert all(h.status is ReplicaStatus.CANCELLED for h in handles)
    assert sorted(standin.stops) == sorted(h.job_id for h in handles)
    for h in handles:
        standin.jobs[h.job_id]["container"].wait(5)
    time.sleep(0.2)  # the service moves Stopping -> Stopped once the container is gone
    d = ex.sm.describe_training_job(TrainingJobName=handles[0].job_id)
    assert d["TrainingJobStatus"] == "Stopped"


def test_collect_timeout_and_max_runtime(aws):
    standin, make, tmp = aws
    ex = make()
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp / "s", sleep=60))
    result = ex.collect(handles, timeout=1.0)
    assert all(
        h.status is ReplicaStatus.FAILED and h.error.startswith("timeout after 1s") for h in result
    )
    assert sorted(standin.stops) == sorted(h.job_id for h in handles)
    ex2 = make(max_runtime_seconds=2)
    [h] = ex2.collect(
        ex2.launch_replicas(1, "diloco_replica.py", _args(tmp / "s2", sleep=60)), timeout=30
    )
    assert h.status is ReplicaStatus.FAILED and "max runtime exceeded" in h.error
    assert "replica 0 of 1 starting" in h.error


def test_seed_driver_snippet_unchanged(aws, capsys):
    _, make, tmp = aws
    executor = make()
    run_seed_driver_snippet(executor, tmp / "seed-store", capsys)


def test_partial_launch_failure_stops_started_jobs_without_leaking_keys(aws, caplog):
    standin, make, tmp = aws
    caplog.set_level(logging.DEBUG)
    ex = make()
    standin.fail_create_after = 2
    with pytest.raises(CloudExecutorError, match="ResourceLimitExceeded") as info:
        ex.launch_replicas(3, "diloco_replica.py", _args(tmp / "s", sleep=60))
    assert sorted(standin.stops) == sorted(standin.jobs) and len(standin.jobs) == 2
    # The secret key is never sent (SigV4 signs with it), so even botocore's own DEBUG logs
    # lack it; the access key id appears in those DEBUG logs (botocore's, not ours) but not in
    # the error we raise.
    assert SECRET_KEY not in f"{info.value!r}{caplog.text}"
    assert ACCESS_KEY not in repr(info.value)
    assert info.value.__cause__ is None


def test_bad_input_and_missing_credentials_fail_before_launch(aws, monkeypatch, tmp_path):
    standin, make, tmp = aws
    assert "ml.p5.48xlarge" in training_instance_types()
    with pytest.raises(ValueError, match="unknown SageMaker training instance type 'ml.h100.big'"):
        make(instance_type="ml.h100.big")
    with pytest.raises(ValueError, match="image"):
        SageMakerExecutor(None, role_arn=ROLE, output_path="s3://b/o")
    monkeypatch.delenv("SAGEMAKER_ROLE_ARN", raising=False)
    with pytest.raises(ValueError, match="SAGEMAKER_ROLE_ARN"):
        SageMakerExecutor(IMAGE, output_path="s3://b/o", session=_session())
    ex = make()
    with pytest.raises(ValueError, match="n_replicas"):
        ex.launch_replicas(0, "diloco_replica.py")
    with pytest.raises(ValueError, match="instance_count"):
        ex.launch_replicas(1, "diloco_replica.py", resources={"instance_count": 0})
    with pytest.raises(ValueError, match="Environment"):
        ex.launch_replicas(1, "diloco_replica.py", env={"BAD-NAME": "x"})
    assert standin.created == []
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(MissingCredentialsError, match="AWS_ACCESS_KEY_ID"):
        SageMakerExecutor(IMAGE, role_arn=ROLE, output_path="s3://b/o", region="us-east-1")


def test_missing_sdk_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    with pytest.raises(ImportError, match=r"composer-replication\[sagemaker\]"):
        SageMakerExecutor(IMAGE, role_arn=ROLE, output_path="s3://b/o")


def test_public_exports():
    from composer_replication.diloco import serverless

    assert serverless.SageMakerExecutor is SageMakerExecutor
    for name in ("K8sExecutor", "ModalExecutor", "HFJobsExecutor"):
        cls = getattr(serverless, name)
        assert isinstance(cls.backend, str)


def test_in_container_wrapper_writes_failure_file_and_forwards_sigterm(tmp_path, capsys):
    import signal
    import subprocess

    from composer_replication.executors import remote

    failure = tmp_path / "opt" / "failure"
    code = remote.main(
        [
            "--failure-file",
            str(failure),
            "--",
            sys.executable,
            "-c",
            "print('working'); raise SystemExit(5)",
        ]
    )
    assert code == 5 and "working" in capsys.readouterr().out
    assert failure.read_text() == "exit code: 5\nworking\n"
    failure.unlink()
    assert remote.main(["--failure-file", str(failure), "--", sys.executable, "-c", "pass"]) == 0
    assert not failure.exists()
    # `docker stop` sends SIGTERM to the wrapper (PID 1): the replica must get it and the
    # wrapper must report 143, not die and orphan the replica.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "composer_replication.executors.remote",
            "--failure-file",
            str(failure),
            "--",
            sys.executable,
            "-c",
            "import time; print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 143
    assert failure.read_text().startswith("exit code: 143\nup\n")
