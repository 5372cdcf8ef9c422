"""SageMakerExecutor: each DiLoCo replica as one SageMaker training job (boto3).

One training job per replica (not one job with N instances): SageMaker fails a whole
multi-instance job when one host dies, while DiLoCo wants replicas to fail alone. A replica
that itself needs several hosts uses `instance_count` > 1 (its hosts get SageMaker's usual
/opt/ml/input/config/resourceconfig.json; our rank is per job, in REPLICA_RANK).

The container runs `ContainerEntrypoint` = the replica command and `Environment` = its env,
in the given image (e.g. an AWS Deep Learning Container with composer-replication installed).
Status: InProgress + secondary Starting/Downloading/... -> PENDING, Training/Uploading ->
RUNNING, Completed -> SUCCEEDED (exit 0), Failed -> FAILED (exit code parsed from
FailureReason when it names one), Stopped -> CANCELLED, Stopped/MaxRuntimeExceeded -> FAILED.
Logs come from CloudWatch Logs, group /aws/sagemaker/TrainingJobs, streams "<job>/algo-N-...".

Credentials: boto3's standard chain (env vars, ~/.aws, SSO, instance/role credentials) via a
`boto3.Session`; the execution role comes from `role_arn=` or SAGEMAKER_ROLE_ARN. Keys never
leave boto3's signer: errors are re-raised redacted.
"""

from __future__ import annotations

import functools
import os
import re
import time
import uuid
from typing import TYPE_CHECKING

from composer_replication.executors.executor import (
    ExecutorBase,
    ReplicaHandle,
    ReplicaStatus,
    Resources,
    check_arg_style,
    validate_launch,
)
from composer_replication.executors.redact import (
    MissingCredentialsError,
    import_sdk,
    sdk_errors,
)
from composer_replication.executors.remote import FAILURE_FILE
from composer_replication.json_types import JSONDict

if TYPE_CHECKING:
    import boto3

__all__ = ["SageMakerExecutor", "training_instance_types"]

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
REMOTE_MODULE = "composer_replication.executors.remote"
_EXIT_CODE = re.compile(r"exit ?code:?\s*(-?\d+)", re.IGNORECASE)
_ENV_KEY = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_RUNNING_SECONDARY = {"Training", "Uploading"}
MAX_RUNTIME_LIMIT = 28 * 24 * 3600  # SageMaker's ceiling for MaxRuntimeInSeconds


@functools.lru_cache(maxsize=1)
def training_instance_types() -> tuple[str, ...]:
    """Instance types CreateTrainingJob accepts, from botocore's SageMaker service model."""
    botocore_session = import_sdk("botocore.session", "sagemaker")
    model = botocore_session.get_session().get_service_model("sagemaker")
    shape = model.operation_model("CreateTrainingJob").input_shape
    return tuple(shape.members["ResourceConfig"].members["InstanceType"].enum)


class SageMakerExecutor(ExecutorBase):
    """One SageMaker training job per replica (see the module docstring).

    image: ECR image URI with Python and composer-replication (required).
    role_arn: the SageMaker execution role (or env SAGEMAKER_ROLE_ARN).
    output_path: s3:// prefix for the jobs' output (SageMaker requires one).
    instance_type / instance_count / volume_size_gb / max_runtime_seconds: the job's shape.
    session: a `boto3.Session` (default: boto3's standard credential chain; `region`).
    failure_file: where the in-container wrapper (`remote.py`) writes "exit code: N" + the log
      tail on failure (SageMaker reads /opt/ml/output/failure); None runs the command bare.
    endpoint_url / logs_endpoint_url: for tests or VPC endpoints.
    resources at launch: {"instance_type", "instance_count", "max_runtime_seconds"} override.
    """

    backend = "sagemaker"

    def __init__(
        self,
        image: str | None,
        *,
        role_arn: str | None = None,
        output_path: str | None = None,
        instance_type: str = "ml.g5.xlarge",
        instance_count: int = 1,
        volume_size_gb: int = 50,
        max_runtime_seconds: int = 24 * 3600,
        job_prefix: str = "diloco",
        tags: dict[str, str] | None = None,
        python: str = "python",
        arg_style: str = "auto",
        failure_file: str | None = FAILURE_FILE,
        session: boto3.Session | None = None,
        region: str | None = None,
        endpoint_url: str | None = None,
        logs_endpoint_url: str | None = None,
        poll_interval: float = 15.0,
    ) -> None:
        boto3 = import_sdk("boto3", "sagemaker")
        if not image or not isinstance(image, str):
            raise ValueError(
                "SageMakerExecutor needs image='<account>.dkr.ecr.<region>."
                "amazonaws.com/repo:tag' (Python + composer-replication); none given"
            )
        role_arn = role_arn or os.environ.get("SAGEMAKER_ROLE_ARN")
        if not role_arn:
            raise ValueError(
                "SageMakerExecutor needs the execution role: role_arn='arn:aws:iam::"
                "<account>:role/<name>' or env SAGEMAKER_ROLE_ARN"
            )
        if not output_path or not output_path.startswith("s3://"):
            raise ValueError(f"output_path must be an s3:// prefix, got {output_path!r}")
        self._check_shape(instance_type, instance_count, max_runtime_seconds)
        self.image, self.role_arn, self.output_path = image, role_arn, output_path
        self.instance_type, self.instance_count = instance_type, instance_count
        self.volume_size_gb, self.max_runtime_seconds = volume_size_gb, max_runtime_seconds
        self.job_prefix = re.sub(r"[^a-zA-Z0-9-]", "-", job_prefix)[:30].strip("-") or "diloco"
        self.tags = dict(tags or {})
        self.python, self.poll_interval = python, poll_interval
        self.arg_style = check_arg_style(arg_style)
        self.failure_file = failure_file
        self.session = session or boto3.Session(region_name=region)
        creds = self.session.get_credentials()
        if creds is None:
            raise MissingCredentialsError(
                "no AWS credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, configure "
                "~/.aws (aws configure / aws sso login), or run with an instance role"
            )
        frozen = creds.get_frozen_credentials()
        self._redact = [frozen.access_key, frozen.secret_key, frozen.token]
        if not (region or self.session.region_name):
            raise MissingCredentialsError("no AWS region: set AWS_DEFAULT_REGION or pass region=")
        with sdk_errors(self.backend, "creating the boto3 clients", self._redact):
            self.sm = self.session.client(
                "sagemaker", region_name=region, endpoint_url=endpoint_url
            )
            self.logs_client = self.session.client(
                "logs", region_name=region, endpoint_url=logs_endpoint_url or endpoint_url
            )
        self.run_id = uuid.uuid4().hex[:8]

    @staticmethod
    def _check_shape(instance_type: object, instance_count: object, max_runtime: object) -> None:
        types = training_instance_types()
        if instance_type not in types:
            gpu = sorted(
                t for t in types if t.split(".")[1][:2] in ("p3", "p4", "p5", "g4", "g5", "g6")
            )
            raise ValueError(
                f"unknown SageMaker training instance type {instance_type!r}; GPU "
                f"types include {gpu[:12]}... (see training_instance_types())"
            )
        if not isinstance(instance_count, int) or instance_count < 1:
            raise ValueError(f"instance_count must be an integer >= 1, got {instance_count!r}")
        if not isinstance(max_runtime, int) or not 1 <= max_runtime <= MAX_RUNTIME_LIMIT:
            raise ValueError(
                f"max_runtime_seconds must be in [1, {MAX_RUNTIME_LIMIT}], got {max_runtime!r}"
            )

    def check_launch(self, n_replicas: int, entrypoint: str) -> None:
        validate_launch(n_replicas, entrypoint, check_local=False)  # the code is in the image

    def _check_resources(self, resources: Resources) -> Resources:
        unknown = set(resources) - {"instance_type", "instance_count", "max_runtime_seconds"}
        if unknown:
            raise ValueError(
                "SageMakerExecutor resources take instance_type, instance_count, "
                f"max_runtime_seconds; got {sorted(unknown)}"
            )
        self._check_shape(
            resources.get("instance_type", self.instance_type),
            resources.get("instance_count", self.instance_count),
            resources.get("max_runtime_seconds", self.max_runtime_seconds),
        )
        return resources

    def _start(
        self,
        rank: int,
        world_size: int,
        command: list[str],
        env: dict[str, str],
        resources: Resources,
        secrets: dict[str, str],
    ) -> ReplicaHandle:
        env = {**env, **secrets}  # the replica's own process environment is private to it
        bad = [k for k, v in env.items() if not _ENV_KEY.match(k) or len(v) > 512]
        if bad or len(env) > 100:
            raise ValueError(
                f"SageMaker Environment allows <= 100 variables named [a-zA-Z_]"
                f"[a-zA-Z0-9_]* with values <= 512 chars; offending: {bad}"
            )
        name = f"{self.job_prefix}-{self.run_id}-r{rank}"
        tags = {**self.tags, "diloco-run": self.run_id, "diloco-rank": str(rank)}
        with sdk_errors(self.backend, f"starting replica {rank} ({name})", self._redact):
            self.sm.create_training_job(
                TrainingJobName=name,
                AlgorithmSpecification={
                    "TrainingImage": self.image,
                    "TrainingInputMode": "File",
                    "ContainerEntrypoint": self._entrypoint(command),
                },
                RoleArn=self.role_arn,
                OutputDataConfig={"S3OutputPath": self.output_path},
                ResourceConfig={
                    "InstanceType": resources.get("instance_type", self.instance_type),
                    "InstanceCount": resources.get("instance_count", self.instance_count),
                    "VolumeSizeInGB": self.volume_size_gb,
                },
                StoppingCondition={
                    "MaxRuntimeInSeconds": resources.get(
                        "max_runtime_seconds", self.max_runtime_seconds
                    )
                },
                Environment=env,
                Tags=[{"Key": k, "Value": v} for k, v in tags.items()],
            )
        log_location = f"cloudwatch:{LOG_GROUP}/{name}"
        return self._new_handle(rank, name, ReplicaStatus.PENDING, log_location)

    def _entrypoint(self, command: list[str]) -> list[str]:
        """The replica command, wrapped so a failure writes its exit code + log tail to the
        failure file (SageMaker turns it into FailureReason). failure_file=None: run as is."""
        if self.failure_file is None:
            return command
        wrapper = [self.python, "-m", REMOTE_MODULE, "--failure-file", self.failure_file, "--"]
        return [*wrapper, *command]

    def _refresh(self, handle: ReplicaHandle) -> None:
        with sdk_errors(self.backend, f"describing job {handle.job_id}", self._redact):
            d = self.sm.describe_training_job(TrainingJobName=handle.job_id)
        status, secondary = d["TrainingJobStatus"], d.get("SecondaryStatus", "")
        if d.get("TrainingStartTime"):
            handle.start_time = d["TrainingStartTime"].timestamp()
        if status in ("InProgress", "Stopping"):
            running = secondary in _RUNNING_SECONDARY or status == "Stopping"
            handle.status = ReplicaStatus.RUNNING if running else ReplicaStatus.PENDING
            return
        end = d.get("TrainingEndTime")
        handle.end_time = end.timestamp() if end else time.time()
        reason = d.get("FailureReason") or ""
        if status == "Completed":
            handle.status, handle.exit_code = ReplicaStatus.SUCCEEDED, 0
        elif status == "Stopped" and secondary != "MaxRuntimeExceeded":
            handle.status = ReplicaStatus.CANCELLED
        else:  # Failed, or stopped by its own max runtime
            match = _EXIT_CODE.search(reason)
            handle.exit_code = int(match.group(1)) if match else None
            what = "max runtime exceeded" if secondary == "MaxRuntimeExceeded" else status
            self._fail(handle, f"training job {what}" + (f": {reason}" if reason else ""))

    def _terminate(self, handle: ReplicaHandle) -> None:
        try:
            with sdk_errors(self.backend, f"stopping job {handle.job_id}", self._redact):
                self.sm.stop_training_job(TrainingJobName=handle.job_id)
        except Exception as exc:
            # Stopping a job that already ended is refused; that is not a failure to stop it.
            if "cannot be stopped" not in str(exc) and "ValidationException" not in str(exc):
                raise

    def logs(self, handle: ReplicaHandle, tail: int | None = None) -> str:
        """The job's CloudWatch log (all hosts' streams, host order); "" before it starts."""
        if tail is not None and tail <= 0:
            return ""
        lines: list[str] = []
        try:
            with sdk_errors(self.backend, f"reading logs of {handle.job_id}", self._redact):
                streams = self.logs_client.describe_log_streams(
                    logGroupName=LOG_GROUP, logStreamNamePrefix=f"{handle.job_id}/"
                )["logStreams"]
                for stream in sorted(streams, key=lambda s: s["logStreamName"]):
                    lines += self._stream_lines(stream["logStreamName"], tail)
        except Exception as exc:
            if "ResourceNotFoundException" in str(exc):  # no log group / stream yet
                return ""
            raise
        if tail is not None:
            lines = lines[-tail:]
        return "".join(line + "\n" for line in lines)

    def _stream_lines(self, stream: str, tail: int | None) -> list[str]:
        if tail is not None:  # newest `tail` events, one call
            events = self.logs_client.get_log_events(
                logGroupName=LOG_GROUP, logStreamName=stream, limit=tail, startFromHead=False
            )["events"]
            return [e["message"] for e in events]
        out: list[str] = []
        kwargs: JSONDict = {
            "logGroupName": LOG_GROUP,
            "logStreamName": stream,
            "startFromHead": True,
        }
        while True:
            page = self.logs_client.get_log_events(**kwargs)
            out += [e["message"] for e in page["events"]]
            token = page.get("nextForwardToken")
            if not page["events"] or token == kwargs.get("nextToken"):
                return out  # CloudWatch signals the end by repeating the token
            kwargs["nextToken"] = token
