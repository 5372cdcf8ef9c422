"""A stand-in of the SageMaker training-job API and the CloudWatch Logs calls that read it.

AWS JSON 1.1 protocol (POST /, `X-Amz-Target`), the part boto3 uses for SageMakerExecutor:
  SageMaker.CreateTrainingJob / DescribeTrainingJob / StopTrainingJob
  Logs_20140328.DescribeLogStreams / GetLogEvents   (group /aws/sagemaker/TrainingJobs)

moto covers create/describe but finishes every job at once and has no StopTrainingJob; this
stand-in adds what it lacks: InProgress with secondary statuses Starting -> Downloading ->
Training -> Uploading, then Completed / Failed ("AlgorithmError: ..., exit code: N") /
Stopping -> Stopped, MaxRuntimeExceeded, and the container's output as a log stream. The
container is a local process running ContainerEntrypoint + ContainerArguments with the job's
Environment. A failing container's /opt/ml/output/failure file becomes FailureReason (the
stand-in gives each job its own folder, passed as $STANDIN_OPT_ML). Requests must be
SigV4-signed with the expected access key id.
"""

from __future__ import annotations

import functools
import re
import time
from pathlib import Path
from typing import Any

import botocore.session

from .common import Container, JobLoop

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_ENV_KEY = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_ROLE = re.compile(r"^arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+$")


@functools.lru_cache(maxsize=1)
def _instance_types() -> frozenset[str]:
    model = botocore.session.get_session().get_service_model("sagemaker")
    shape = model.operation_model("CreateTrainingJob").input_shape
    return frozenset(shape.members["ResourceConfig"].members["InstanceType"].enum)


def _err(kind: str, message: str, code: int = 400):
    return code, {"__type": kind, "message": message}, "application/x-amz-json-1.1"


class SageMakerStandin(JobLoop):
    def __init__(
        self,
        workdir: Path,
        *,
        access_key: str,
        pending_seconds: float = 0.3,
        account: str = "123456789012",
        region: str = "us-east-1",
    ) -> None:
        self.workdir = Path(workdir)
        self.access_key = access_key
        self.pending_seconds = pending_seconds
        self.account, self.region = account, region
        self.instance_types = _instance_types()
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.created: list[dict[str, Any]] = []
        self.stops: list[str] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.fail_create_after: int | None = None
        self._start_loop()

    def handle(self, method: str, path: str, headers: dict[str, str], body: Any):
        auth = headers.get("authorization", "")
        if not auth.startswith(f"AWS4-HMAC-SHA256 Credential={self.access_key}/"):
            return _err(
                "UnrecognizedClientException",
                "The security token included in the request is invalid.",
            )
        target = headers.get("x-amz-target", "")
        with self._lock:
            op = {
                "SageMaker.CreateTrainingJob": self._create,
                "SageMaker.DescribeTrainingJob": self._describe,
                "SageMaker.StopTrainingJob": self._stop_job,
                "Logs_20140328.DescribeLogStreams": self._streams,
                "Logs_20140328.GetLogEvents": self._events,
            }.get(target)
            if op is None:
                return _err("UnknownOperationException", f"unknown operation {target}")
            return op(body or {})

    # ------------------------------------------------------------------ SageMaker
    def _validate(self, b: dict[str, Any]) -> str | None:
        name = b.get("TrainingJobName", "")
        if not _NAME.match(name):
            return f"Value '{name}' at 'trainingJobName' failed to satisfy constraint"
        if not _ROLE.match(b.get("RoleArn", "")):
            return "Value at 'roleArn' failed to satisfy constraint"
        if not (b.get("OutputDataConfig") or {}).get("S3OutputPath", "").startswith("s3://"):
            return "OutputDataConfig.S3OutputPath must be an s3:// URI"
        alg = b.get("AlgorithmSpecification") or {}
        if not alg.get("TrainingImage"):
            return "AlgorithmSpecification.TrainingImage is required"
        if alg.get("TrainingInputMode") not in ("File", "Pipe", "FastFile"):
            return "AlgorithmSpecification.TrainingInputMode is required"
        if not alg.get("ContainerEntrypoint"):
            return "this stand-in runs ContainerEntrypoint; it is required here"
        rc = b.get("ResourceConfig") or {}
        if rc.get("InstanceType") not in self.instance_types:
            return f"Value '{rc.get('InstanceType')}' at 'resourceConfig.instanceType' failed to satisfy constraint: Member must satisfy enum value set"
        if not isinstance(rc.get("InstanceCount"), int) or rc["InstanceCount"] < 1:
            return "ResourceConfig.InstanceCount must be >= 1"
        mr = (b.get("StoppingCondition") or {}).get("MaxRuntimeInSeconds")
        if not isinstance(mr, int) or not 1 <= mr <= 2419200:
            return "StoppingCondition.MaxRuntimeInSeconds must be in [1, 2419200]"
        env = b.get("Environment") or {}
        if len(env) > 100 or not all(_ENV_KEY.match(k) and len(v) <= 512 for k, v in env.items()):
            return "Environment: at most 100 entries, keys [a-zA-Z_][a-zA-Z0-9_]*, values <= 512"
        return None

    def _create(self, b: dict[str, Any]):
        if self.fail_create_after is not None and len(self.created) >= self.fail_create_after:
            return _err(
                "ResourceLimitExceeded",
                "The account-level service limit 'ml.g5.xlarge for training job usage' is 2 Instances",
            )
        problem = self._validate(b)
        if problem:
            return _err("ValidationException", problem)
        name = b["TrainingJobName"]
        if name in self.jobs:
            return _err("ResourceInUse", f"Training job names must be unique: {name}")
        self.created.append(b)
        arn = f"arn:aws:sagemaker:{self.region}:{self.account}:training-job/{name.lower()}"
        self.jobs[name] = {
            "body": b,
            "arn": arn,
            "created": time.time(),
            "status": "InProgress",
            "secondary": "Starting",
            "failure": None,
            "container": None,
            "started": None,
            "ended": None,
            "stop_requested": False,
        }
        return 200, {"TrainingJobArn": arn}, "application/x-amz-json-1.1"

    def _describe(self, b: dict[str, Any]):
        job = self.jobs.get(b.get("TrainingJobName", ""))
        if job is None:
            return _err(
                "ValidationException", f"Requested resource not found: {b.get('TrainingJobName')}"
            )
        body = job["body"]
        out = {
            "TrainingJobName": body["TrainingJobName"],
            "TrainingJobArn": job["arn"],
            "TrainingJobStatus": job["status"],
            "SecondaryStatus": job["secondary"],
            "AlgorithmSpecification": body["AlgorithmSpecification"],
            "RoleArn": body["RoleArn"],
            "OutputDataConfig": body["OutputDataConfig"],
            "ResourceConfig": body["ResourceConfig"],
            "StoppingCondition": body["StoppingCondition"],
            "Environment": body.get("Environment", {}),
            "CreationTime": job["created"],
            "LastModifiedTime": time.time(),
        }
        if job["failure"]:
            out["FailureReason"] = job["failure"]
        if job["started"]:
            out["TrainingStartTime"] = job["started"]
        if job["ended"]:
            out["TrainingEndTime"] = job["ended"]
        return 200, out, "application/x-amz-json-1.1"

    def _stop_job(self, b: dict[str, Any]):
        name = b.get("TrainingJobName", "")
        job = self.jobs.get(name)
        if job is None:
            return _err("ValidationException", f"Requested resource not found: {name}")
        if job["status"] != "InProgress":
            return _err(
                "ValidationException", f"The job status is {job['status']}; it cannot be stopped"
            )
        self.stops.append(name)
        job["status"] = job["secondary"] = "Stopping"
        job["stop_requested"] = True
        if job["container"] is not None:
            job["container"].kill()
        return 200, {}, "application/x-amz-json-1.1"

    # ------------------------------------------------------------------ CloudWatch Logs
    def _stream_name(self, name: str) -> str:
        return f"{name}/algo-1-{int(self.jobs[name]['created'])}"

    def _streams(self, b: dict[str, Any]):
        if b.get("logGroupName") != LOG_GROUP:
            return _err("ResourceNotFoundException", "The specified log group does not exist.")
        prefix = b.get("logStreamNamePrefix", "")
        streams = [
            {"logStreamName": self._stream_name(n), "creationTime": int(j["started"] * 1000)}
            for n, j in self.jobs.items()
            if j["container"] is not None and self._stream_name(n).startswith(prefix)
        ]
        return 200, {"logStreams": streams}, "application/x-amz-json-1.1"

    def _events(self, b: dict[str, Any]):
        name = b.get("logStreamName", "").split("/")[0]
        job = self.jobs.get(name)
        if job is None or job["container"] is None or b.get("logGroupName") != LOG_GROUP:
            return _err("ResourceNotFoundException", "The specified log stream does not exist.")
        lines = job["container"].text().splitlines()
        ts = int(job["started"] * 1000)
        events = [
            {"timestamp": ts + i, "message": line, "ingestionTime": ts + i}
            for i, line in enumerate(lines)
        ]
        limit = int(b.get("limit") or 10000)
        token = b.get("nextToken")
        if token:
            start = int(token.split("/")[1])
        elif b.get("startFromHead"):
            start = 0
        else:  # newest events first page (what `limit` without startFromHead returns)
            start = max(len(events) - limit, 0)
        page = events[start : start + limit]
        end = start + len(page)
        return (
            200,
            {"events": page, "nextForwardToken": f"f/{end}", "nextBackwardToken": f"b/{start}"},
            "application/x-amz-json-1.1",
        )

    # ------------------------------------------------------------------ lifecycle
    def _tick(self) -> None:
        for job in self.jobs.values():
            self._step(job)

    def _step(self, job: dict[str, Any]) -> None:
        b = job["body"]
        if job["status"] == "InProgress" and job["container"] is None:
            age = time.time() - job["created"]
            if age >= self.pending_seconds:
                alg = b["AlgorithmSpecification"]
                argv = list(alg["ContainerEntrypoint"]) + list(alg.get("ContainerArguments") or [])
                log = self.workdir / f"sm-{b['TrainingJobName']}.log"
                # The container's private /opt/ml: here a per-job folder named by an env var
                # (jobs share one host), so a test's failure_file is "$STANDIN_OPT_ML/failure".
                job["opt_ml"] = self.workdir / f"opt-ml-{b['TrainingJobName']}"
                env = {**(b.get("Environment") or {}), "STANDIN_OPT_ML": str(job["opt_ml"])}
                job["container"] = Container(argv, env, log, str(self.workdir))
                job["started"] = job["container"].started_at
                job["secondary"] = "Training"
            elif age >= self.pending_seconds / 2:
                job["secondary"] = "Downloading"
            return
        if job["container"] is None or job["status"] not in ("InProgress", "Stopping"):
            return
        code = job["container"].exit_code
        max_runtime = b["StoppingCondition"]["MaxRuntimeInSeconds"]
        if code is None and time.time() - job["started"] > max_runtime:
            job["container"].kill()
            job["status"], job["secondary"] = "Stopped", "MaxRuntimeExceeded"
            job["ended"] = time.time()
            return
        if code is None:
            return
        job["ended"] = time.time()
        if job["stop_requested"]:
            job["status"] = job["secondary"] = "Stopped"
        elif code == 0:
            job["status"] = job["secondary"] = "Completed"
        else:
            job["status"] = job["secondary"] = "Failed"
            failure = job["opt_ml"] / "failure"
            if failure.exists():  # what the algorithm wrote, cut like SageMaker does
                job["failure"] = "AlgorithmError: " + failure.read_text()[:1024]
            else:
                job["failure"] = f"AlgorithmError: , exit code: {code}"

    def _containers(self) -> list[Container | None]:
        return [job["container"] for job in self.jobs.values()]
