"""HFJobsExecutor: each DiLoCo replica as one Hugging Face Job.

Built on huggingface_hub's `HfApi.run_job` / `inspect_job` / `fetch_job_logs` / `cancel_job`.
Every replica is its own Job (same image, flavor, command; its rank in the environment), so one
crash never takes the others down and each is billed only while it runs.

Stage mapping: SCHEDULING -> PENDING, RUNNING/UPDATING -> RUNNING, COMPLETED -> SUCCEEDED (exit
0), ERROR -> FAILED (exit code parsed from the status message when it names one), CANCELED ->
CANCELLED, DELETED -> FAILED. Jobs carry labels `diloco-run` / `diloco-rank`, so a run's jobs
can be listed (`hf jobs ps`, `HfApi.list_jobs(labels=...)`).

Credentials: huggingface_hub's standard places (`token=` argument, HF_TOKEN, the token saved by
`hf auth login`). The token is sent only as a request header; it never appears in handles,
logs or exceptions. Values passed in `secrets` are stored encrypted by the Hub and reach the
container as environment variables.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from huggingface_hub import JobInfo

__all__ = ["HFJobsExecutor", "known_flavors"]

_EXIT_CODE = re.compile(r"exit(?:ed)?(?: with)?[ _]code:?\s*(-?\d+)", re.IGNORECASE)
_STAGES = {
    "SCHEDULING": ReplicaStatus.PENDING,
    "RUNNING": ReplicaStatus.RUNNING,
    "UPDATING": ReplicaStatus.RUNNING,
}


def known_flavors() -> list[str]:
    """Hardware flavors of the installed huggingface_hub (its JobHardware enum)."""
    hub = import_sdk("huggingface_hub", "hf-jobs")
    return [f.value for f in hub.JobHardware]


class HFJobsExecutor(ExecutorBase):
    """One Hugging Face Job per replica (see the module docstring).

    image: Docker image (or "hf.co/spaces/..."), holding Python and composer-replication.
    flavor: hardware, one of `known_flavors()` (e.g. "a10g-small", "a100-large", "h200").
    timeout: per-job limit, seconds or "30m" / "2h" / "1d" (the Hub stops the job after it).
    secrets: {"ENV": value} stored encrypted by the Hub, set as env in the container.
    namespace: user or org that owns (and pays for) the jobs; default: the token's user.
    api: an `HfApi` (tests pass HfApi(endpoint=stand-in)); else HfApi(endpoint, token).
    resources at launch: {"flavor": ..., "timeout": ...} override the defaults per launch.
    """

    backend = "hf_jobs"

    def __init__(
        self,
        image: str | None,
        *,
        flavor: str = "a10g-small",
        timeout: int | float | str | None = "2h",
        secrets: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        namespace: str | None = None,
        python: str = "python",
        arg_style: str = "auto",
        api: Any = None,
        endpoint: str | None = None,
        token: str | None = None,
        poll_interval: float = 5.0,
    ) -> None:
        hub = import_sdk("huggingface_hub", "hf-jobs")
        if not image or not isinstance(image, str):
            raise ValueError(
                "HFJobsExecutor needs image='repo/name:tag' (a Docker image with "
                "Python and composer-replication installed); none was given"
            )
        self._check_flavor(flavor)
        self.image = image
        self.flavor = flavor
        self.timeout = timeout
        self.secrets = dict(secrets or {})
        self.labels = dict(labels or {})
        self.namespace = namespace
        self.python = python
        self.arg_style = check_arg_style(arg_style)
        self.poll_interval = poll_interval
        self.api = api if api is not None else hub.HfApi(endpoint=endpoint, token=token)
        # Resolve the token the SDK would use, only to fail early and to know what to redact.
        self._token = token or (self.api.token if isinstance(self.api.token, str) else None)
        self._token = self._token or hub.get_token()
        if not self._token:
            raise MissingCredentialsError(
                "no Hugging Face token: set HF_TOKEN, run `hf auth login`, or pass token="
            )
        self._redact = [self._token, *self.secrets.values()]
        self.run_id = uuid.uuid4().hex[:10]

    @staticmethod
    def _check_flavor(flavor: object) -> None:
        flavors = known_flavors()
        if flavor not in flavors:
            raise ValueError(f"unknown HF Jobs flavor {flavor!r}; choose one of {flavors}")

    def check_launch(self, n_replicas: int, entrypoint: str) -> None:
        validate_launch(n_replicas, entrypoint, check_local=False)  # the code is in the image

    def _check_resources(self, resources: Resources) -> Resources:
        unknown = set(resources) - {"flavor", "timeout"}
        if unknown:
            raise ValueError(
                f"HFJobsExecutor resources take 'flavor' and 'timeout', got {sorted(unknown)}; "
                "GPUs come with the flavor (e.g. 'a100-large')"
            )
        if "flavor" in resources:
            self._check_flavor(resources["flavor"])
        if self.namespace is None:  # once, before the first job: also proves the token works
            with sdk_errors(self.backend, "resolving the namespace (whoami)", self._redact):
                self.namespace = self.api.whoami(token=self._token)["name"]
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
        """The rank's own secrets join the job's encrypted secrets (never its plain env)."""
        labels = {**self.labels, "diloco-run": self.run_id, "diloco-rank": str(rank)}
        self._redact += list(secrets.values())
        with sdk_errors(self.backend, f"starting replica {rank}", self._redact):
            job = self.api.run_job(
                image=self.image,
                command=command,
                env=env,
                secrets={**self.secrets, **secrets} or None,
                flavor=resources.get("flavor", self.flavor),
                timeout=resources.get("timeout", self.timeout),
                labels=labels,
                namespace=self.namespace,
                token=self._token,
            )
        handle = self._new_handle(rank, job.id, ReplicaStatus.PENDING, getattr(job, "url", None))
        self._apply(handle, job)
        return handle

    def _apply(self, handle: ReplicaHandle, job: JobInfo) -> None:
        stage = str(getattr(job.status.stage, "value", job.status.stage))
        if job.started_at is not None:
            handle.start_time = job.started_at.timestamp()
        if stage in _STAGES:
            handle.status = _STAGES[stage]
            return
        handle.end_time = job.finished_at.timestamp() if job.finished_at else time.time()
        message = job.status.message or ""
        if stage == "COMPLETED":
            handle.status, handle.exit_code = ReplicaStatus.SUCCEEDED, 0
        elif stage == "CANCELED":
            handle.status = ReplicaStatus.CANCELLED
        else:  # ERROR, DELETED, or a stage this version does not know: not a success
            match = _EXIT_CODE.search(message)
            handle.exit_code = int(match.group(1)) if match else None
            self._fail(handle, f"job {stage}" + (f": {message}" if message else ""))

    def _refresh(self, handle: ReplicaHandle) -> None:
        with sdk_errors(self.backend, f"inspecting job {handle.job_id}", self._redact):
            job = self.api.inspect_job(
                job_id=handle.job_id, namespace=self.namespace, token=self._token
            )
        self._apply(handle, job)

    def _terminate(self, handle: ReplicaHandle) -> None:
        with sdk_errors(self.backend, f"cancelling job {handle.job_id}", self._redact):
            self.api.cancel_job(job_id=handle.job_id, namespace=self.namespace, token=self._token)

    def logs(self, handle: ReplicaHandle, tail: int | None = None) -> str:
        """The job's log so far (non-blocking fetch; the Hub replays it as server-sent events)."""
        if tail is not None and tail <= 0:
            return ""
        with sdk_errors(self.backend, f"fetching logs of job {handle.job_id}", self._redact):
            lines = list(
                self.api.fetch_job_logs(
                    job_id=handle.job_id,
                    namespace=self.namespace,
                    follow=False,
                    tail=tail,
                    token=self._token,
                )
            )
        return "".join(line if line.endswith("\n") else line + "\n" for line in lines)
