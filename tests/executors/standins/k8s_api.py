"""A stand-in of the Kubernetes API server + Job controller + kubelet for Indexed Jobs.

Serves the endpoints the kubernetes Python client calls for K8sExecutor:
  POST   /apis/batch/v1/namespaces/{ns}/jobs            create (validated like the API server)
  GET    /apis/batch/v1/namespaces/{ns}/jobs/{name}     job with status
  DELETE /apis/batch/v1/namespaces/{ns}/jobs/{name}     delete (propagationPolicy honoured)
  GET    /api/v1/namespaces/{ns}/pods?labelSelector=..  pods of a job
  DELETE /api/v1/namespaces/{ns}/pods/{pod}             delete one pod (SIGTERM -> exit 143)
  GET    /api/v1/namespaces/{ns}/pods/{pod}/log         container log (tailLines)
  POST   /api/v1/namespaces/{ns}/secrets                create a Secret (stringData)
  PATCH  /api/v1/namespaces/{ns}/secrets/{name}         set ownerReferences (deleted with the Job)
  DELETE /api/v1/namespaces/{ns}/secrets/{name}         delete a Secret

The "controller" runs every index of an Indexed Job as a pod whose container is a local
process: Pending for `pending_seconds`, then Running, then Succeeded/Failed with the process's
exit code. Env is resolved like the kubelet does (value, fieldRef to the completion-index
annotation, secretKeyRef, envFrom secretRef, JOB_COMPLETION_INDEX). A failed index is retried
up to backoffLimitPerIndex times unless a podFailurePolicy FailIndex rule matches its exit code.
Job status carries active/succeeded/failed counts, completedIndexes/failedIndexes in the
API's compressed "0-2,4" form and Complete/Failed conditions.
"""

from __future__ import annotations

import re
import secrets as _secrets
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from .common import Container, JobLoop, rfc3339

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def compress_indexes(indexes: set[int]) -> str:
    """{0,1,2,4} -> "0-2,4" (the Job API's format)."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(indexes):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any], str]:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return code, body, "application/json"


class K8sApiStandin(JobLoop):
    def __init__(
        self,
        workdir: Path,
        *,
        token: str | None = None,
        secrets: dict[str, dict[str, str]] | None = None,
        pending_seconds: float = 0.3,
    ) -> None:
        self.workdir = Path(workdir)
        self.token = token
        self.secrets = secrets or {}
        self.secret_owners: dict[str, str | None] = {}  # created Secret -> owning Job name
        self.pending_seconds = pending_seconds
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.created: list[dict[str, Any]] = []  # job bodies as POSTed
        self.deletes: list[tuple[str, dict[str, Any] | None]] = []
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.fail_create_after: int | None = None  # inject: reject the (k+1)-th create with 500
        self.echo_auth_on_error = False  # inject: a 500 whose message echoes the headers
        self._start_loop()

    # ------------------------------------------------------------------ HTTP
    def handle(self, method: str, path: str, headers: dict[str, str], body: Any):
        if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        if self.echo_auth_on_error and method == "POST":
            # Some proxies echo the request headers in errors; the executor must redact them.
            return _status(500, "InternalError", f"upstream failed for {headers!r}")
        url = urlparse(path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        parts = url.path.strip("/").split("/")
        with self._lock:
            if len(parts) >= 6 and parts[:4] == ["apis", "batch", "v1", "namespaces"]:
                ns = parts[4]
                if len(parts) == 6 and parts[5] == "jobs" and method == "POST":
                    return self._create_job(ns, body)
                if len(parts) == 7 and parts[5] == "jobs":
                    if method == "GET":
                        return self._get_job(ns, parts[6])
                    if method == "DELETE":
                        return self._delete_job(ns, parts[6], body, query)
            if (
                parts[:3] == ["api", "v1", "namespaces"]
                and len(parts) >= 5
                and (parts[4] == "secrets")
            ):
                return self._secret_call(method, parts[3], parts[5:], body)
            if parts[:3] == ["api", "v1", "namespaces"] and len(parts) >= 5 and parts[4] == "pods":
                ns = parts[3]
                if len(parts) == 5 and method == "GET":
                    return self._list_pods(ns, query.get("labelSelector", ""))
                if len(parts) == 6 and method == "DELETE":
                    return self._delete_pod(ns, parts[5])
                if len(parts) == 7 and parts[6] == "log" and method == "GET":
                    return self._pod_log(ns, parts[5], query)
        return _status(404, "NotFound", f"the server could not find the requested resource {path}")

    # ------------------------------------------------------------------ secrets
    def _secret_call(self, method: str, ns: str, rest: list[str], body: Any):
        if method == "POST" and not rest:
            name = body["metadata"]["name"]
            if name in self.secrets:
                return _status(409, "AlreadyExists", f'secrets "{name}" already exists')
            self.secrets[name] = dict(body.get("stringData") or {})
            self.secret_owners[name] = None
            return (
                201,
                {"kind": "Secret", "metadata": {"name": name, "namespace": ns}},
                ("application/json"),
            )
        if len(rest) == 1 and rest[0] in self.secrets:
            name = rest[0]
            if method == "PATCH":
                owners = (body.get("metadata") or {}).get("ownerReferences") or []
                self.secret_owners[name] = owners[0]["name"] if owners else None
                return 200, {"kind": "Secret", "metadata": {"name": name}}, "application/json"
            if method == "DELETE":
                del self.secrets[name]
                self.secret_owners.pop(name, None)
                return 200, {"kind": "Status", "status": "Success"}, "application/json"
        return _status(404, "NotFound", f"secret {rest} not found")

    # ------------------------------------------------------------------ jobs
    def _validate(self, body: Any) -> str | None:
        if not isinstance(body, dict) or body.get("kind") != "Job":
            return "body must be a Job"
        if body.get("apiVersion") != "batch/v1":
            return "apiVersion must be batch/v1"
        name = (body.get("metadata") or {}).get("name", "")
        if not _DNS1123.match(name) or len(name) > 63:
            return f"metadata.name: Invalid value: {name!r}: must be a DNS-1123 label"
        spec = body.get("spec") or {}
        if spec.get("completionMode") != "Indexed":
            return "spec.completionMode: must be Indexed for this test"
        n = spec.get("completions")
        if not isinstance(n, int) or n < 1 or spec.get("parallelism") != n:
            return "spec.completions and spec.parallelism must be equal positive integers"
        bl = spec.get("backoffLimitPerIndex")
        if not isinstance(bl, int) or bl < 0:
            return "spec.backoffLimitPerIndex: Required value"
        pod = (spec.get("template") or {}).get("spec") or {}
        if pod.get("restartPolicy") != "Never":
            return "spec.template.spec.restartPolicy: must be Never with backoffLimitPerIndex"
        for rule in (spec.get("podFailurePolicy") or {}).get("rules", []):
            if rule.get("action") not in ("FailJob", "FailIndex", "Ignore", "Count"):
                return f"podFailurePolicy action {rule.get('action')!r} invalid"
        containers = pod.get("containers") or []
        if len(containers) != 1:
            return "expected exactly one container"
        c = containers[0]
        if not c.get("name") or not c.get("image"):
            return "spec.template.spec.containers[0]: name and image are required"
        if not isinstance(c.get("command"), list) or not all(
            isinstance(a, str) for a in c["command"]
        ):
            return "containers[0].command must be a list of strings"
        for e in c.get("env") or []:
            if not _ENV_NAME.match(e.get("name", "")):
                return f"env name {e.get('name')!r} invalid"
            if ("value" in e) == ("valueFrom" in e):
                return f"env {e['name']}: exactly one of value / valueFrom"
            if "value" in e and not isinstance(e["value"], str):
                return f"env {e['name']}: value must be a string"
        for kind in ("limits", "requests"):
            for key, q in ((c.get("resources") or {}).get(kind) or {}).items():
                if not isinstance(q, str):
                    return f"resources.{kind}.{key}: quantities are strings"
                if key == "nvidia.com/gpu" and not q.isdigit():
                    return "nvidia.com/gpu must be a whole number"
        return None

    def _create_job(self, ns: str, body: Any):
        if self.fail_create_after is not None and len(self.created) >= self.fail_create_after:
            return _status(500, "InternalError", "injected create failure")
        problem = self._validate(body)
        if problem:
            return _status(422, "Invalid", f"Job.batch is invalid: {problem}")
        name = body["metadata"]["name"]
        if (ns, name) in self.jobs:
            return _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
        self.created.append(body)
        now = time.time()
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                **body["metadata"],
                "namespace": ns,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": rfc3339(now),
                "resourceVersion": "1",
            },
            "spec": body["spec"],
            "status": {"startTime": rfc3339(now)},
            "_created": now,
            "_indexes": {
                i: {"failures": 0, "pod": None, "done": None}
                for i in range(body["spec"]["completions"])
            },
            "_deleting": False,
        }
        self.jobs[(ns, name)] = job
        for i in job["_indexes"]:
            self._new_pod(ns, job, i)
        return 201, self._public(job), "application/json"

    def _public(self, job: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in job.items() if not k.startswith("_")}

    def _get_job(self, ns: str, name: str):
        job = self.jobs.get((ns, name))
        if job is None:
            return _status(404, "NotFound", f'jobs.batch "{name}" not found')
        return 200, self._public(job), "application/json"

    def _delete_job(self, ns: str, name: str, body: Any, query: dict[str, str]):
        job = self.jobs.get((ns, name))
        if job is None:
            return _status(404, "NotFound", f'jobs.batch "{name}" not found')
        policy = (body or {}).get("propagationPolicy") or query.get("propagationPolicy")
        self.deletes.append((name, body))
        job["_deleting"] = True
        if policy == "Foreground":
            # Foreground: the job stays visible (with a deletionTimestamp and the
            # foregroundDeletion finalizer) until its pods are gone.
            job["metadata"]["deletionTimestamp"] = rfc3339(time.time())
            job["metadata"]["finalizers"] = ["foregroundDeletion"]
            for pod in self._job_pods(ns, name):
                self._terminate_pod(pod)
            return 200, self._public(job), "application/json"
        if policy == "Orphan":
            del self.jobs[(ns, name)]
        else:  # Background (the default for batch/v1 via the API is orphan-free background)
            for pod in self._job_pods(ns, name):
                self._terminate_pod(pod)
            del self.jobs[(ns, name)]
        return (
            200,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Success",
                "details": {"name": name, "group": "batch", "kind": "jobs"},
            },
            "application/json",
        )

    # ------------------------------------------------------------------ pods
    def _new_pod(self, ns: str, job: dict[str, Any], index: int) -> None:
        jname = job["metadata"]["name"]
        name = f"{jname}-{index}-{_secrets.token_hex(3)[:5]}"
        template = job["spec"]["template"]
        labels = {
            **((template.get("metadata") or {}).get("labels") or {}),
            "job-name": jname,
            "batch.kubernetes.io/job-name": jname,
            "controller-uid": job["metadata"]["uid"],
            "batch.kubernetes.io/job-completion-index": str(index),
        }
        annotations = {
            **((template.get("metadata") or {}).get("annotations") or {}),
            INDEX_ANNOTATION: str(index),
        }
        pod = {
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": labels,
                "annotations": annotations,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": rfc3339(time.time()),
            },
            "spec": template["spec"],
            "_index": index,
            "_job": jname,
            "_created": time.monotonic(),
            "_container": None,
            "_phase": "Pending",
            "_waiting": "ContainerCreating",
        }
        self.pods[(ns, name)] = pod
        job["_indexes"][index]["pod"] = name

    def _job_pods(self, ns: str, job_name: str) -> list[dict[str, Any]]:
        return [p for (pns, _), p in self.pods.items() if pns == ns and p["_job"] == job_name]

    def _pod_env(self, pod: dict[str, Any]) -> dict[str, str] | str:
        c = pod["spec"]["containers"][0]
        env: dict[str, str] = {"JOB_COMPLETION_INDEX": str(pod["_index"])}
        for ref in c.get("envFrom") or []:
            secret = self.secrets.get((ref.get("secretRef") or {}).get("name", ""))
            if secret is None:
                return "CreateContainerConfigError"
            env.update(secret)
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = e["value"]
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                m = re.fullmatch(r"metadata\.annotations\['(.+)'\]", vf["fieldRef"]["fieldPath"])
                if not m:
                    return "CreateContainerConfigError"
                env[e["name"]] = pod["metadata"]["annotations"].get(m.group(1), "")
            elif "secretKeyRef" in vf:
                ref = vf["secretKeyRef"]
                value = self.secrets.get(ref["name"], {}).get(ref["key"])
                if value is None:
                    return "CreateContainerConfigError"
                env[e["name"]] = value
        return env

    def _terminate_pod(self, pod: dict[str, Any]) -> None:
        pod["metadata"]["deletionTimestamp"] = rfc3339(time.time())
        if pod["_container"] is not None:
            pod["_container"].kill()
        elif pod["_phase"] == "Pending":
            pod["_phase"] = "Failed"
            pod["_exit"] = 137

    def _delete_pod(self, ns: str, name: str):
        pod = self.pods.get((ns, name))
        if pod is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        self._terminate_pod(pod)
        return 200, self._pod_json(pod), "application/json"

    def _pod_json(self, pod: dict[str, Any]) -> dict[str, Any]:
        c = pod["spec"]["containers"][0]
        cont: Container | None = pod["_container"]
        state: dict[str, Any]
        if pod["_phase"] == "Pending":
            state = {"waiting": {"reason": pod["_waiting"]}}
        elif pod["_phase"] == "Running":
            state = {"running": {"startedAt": rfc3339(cont.started_at if cont else None)}}
        else:
            code = pod["_exit"]
            state = {
                "terminated": {
                    "exitCode": code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": rfc3339(cont.started_at if cont else None),
                    "finishedAt": rfc3339(cont.finished_at if cont else time.time()),
                }
            }
        status = {
            "phase": pod["_phase"],
            "containerStatuses": [
                {
                    "name": c["name"],
                    "image": c["image"],
                    "imageID": "",
                    "ready": pod["_phase"] == "Running",
                    "restartCount": 0,
                    "state": state,
                }
            ],
        }
        if cont is not None:
            status["startTime"] = rfc3339(cont.started_at)
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": pod["metadata"],
            "spec": pod["spec"],
            "status": status,
        }

    def _list_pods(self, ns: str, selector: str):
        want = dict(kv.split("=", 1) for kv in selector.split(",") if "=" in kv)
        items = [
            self._pod_json(p)
            for (pns, _), p in self.pods.items()
            if pns == ns and all(p["metadata"]["labels"].get(k) == v for k, v in want.items())
        ]
        return (
            200,
            {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items},
            "application/json",
        )

    def _pod_log(self, ns: str, name: str, query: dict[str, str]):
        pod = self.pods.get((ns, name))
        if pod is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        if pod["_container"] is None:
            return _status(
                400,
                "BadRequest",
                f'container "{pod["spec"]["containers"][0]["name"]}" in pod "{name}" is waiting to start: ContainerCreating',
            )
        text = pod["_container"].text()
        if "tailLines" in query:
            n = int(query["tailLines"])
            text = "".join(text.splitlines(keepends=True)[-n:]) if n else ""
        return 200, text, "text/plain"

    # ------------------------------------------------------------------ controller
    def _tick(self) -> None:
        for key, job in list(self.jobs.items()):
            self._step(key, job)

    def _step(self, key: tuple[str, str], job: dict[str, Any]) -> None:
        ns, name = key
        spec = job["spec"]
        deadline = spec.get("activeDeadlineSeconds")
        if (
            deadline
            and not job["_deleting"]
            and not job["status"].get("conditions")
            and time.time() - job["_created"] > deadline
        ):
            # Like the Job controller: kill every running pod, fail the job as a whole.
            for pod in self._job_pods(ns, name):
                self._terminate_pod(pod)
            now = rfc3339(time.time())
            job["status"]["conditions"] = [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "DeadlineExceeded",
                    "message": "Job was active longer than specified deadline",
                    "lastProbeTime": now,
                    "lastTransitionTime": now,
                }
            ]
        for index, st in job["_indexes"].items():
            pod = self.pods.get((ns, st["pod"])) if st["pod"] else None
            if pod is None:
                continue
            if pod["_phase"] == "Pending" and not job["_deleting"]:
                if time.monotonic() - pod["_created"] >= self.pending_seconds:
                    env = self._pod_env(pod)
                    if isinstance(env, str):
                        pod["_waiting"] = env
                        continue
                    c = pod["spec"]["containers"][0]
                    argv = list(c["command"]) + list(c.get("args") or [])
                    log = self.workdir / f"{pod['metadata']['name']}.log"
                    pod["_container"] = Container(argv, env, log, str(self.workdir))
                    pod["_phase"] = "Running"
            if pod["_phase"] == "Running":
                code = pod["_container"].exit_code
                if code is not None:
                    pod["_exit"] = code
                    pod["_phase"] = "Succeeded" if code == 0 else "Failed"
            if st["done"] is not None or job["_deleting"] or job["status"].get("conditions"):
                continue  # a finished (or failed-as-a-whole) job does not touch its indexes
            if pod["_phase"] == "Succeeded":
                st["done"] = "succeeded"
            elif pod["_phase"] == "Failed":
                st["failures"] += 1
                fail_index = any(
                    r.get("action") == "FailIndex"
                    and (r.get("onExitCodes") or {}).get("operator") == "In"
                    and pod["_exit"] in (r.get("onExitCodes") or {}).get("values", [])
                    for r in (spec.get("podFailurePolicy") or {}).get("rules", [])
                )
                if fail_index or st["failures"] > spec["backoffLimitPerIndex"]:
                    st["done"] = "failed"
                else:
                    self._new_pod(ns, job, index)
        self._update_status(key, job)

    def _update_status(self, key: tuple[str, str], job: dict[str, Any]) -> None:
        ns, name = key
        pods = self._job_pods(ns, name)
        if job["_deleting"]:
            if all(p["_phase"] not in ("Running",) for p in pods) or not pods:
                for (pns, pname), p in list(self.pods.items()):
                    if pns == ns and p["_job"] == name:
                        del self.pods[(pns, pname)]
                if job["metadata"].get("deletionTimestamp"):
                    del self.jobs[key]
            return
        idx = job["_indexes"]
        completed = {i for i, s in idx.items() if s["done"] == "succeeded"}
        failed = {i for i, s in idx.items() if s["done"] == "failed"}
        status = job["status"]
        status["active"] = sum(p["_phase"] in ("Pending", "Running") for p in pods)
        status["ready"] = sum(p["_phase"] == "Running" for p in pods)
        status["succeeded"] = sum(p["_phase"] == "Succeeded" for p in pods)
        status["failed"] = sum(p["_phase"] == "Failed" for p in pods)
        status["completedIndexes"] = compress_indexes(completed)
        if failed:
            status["failedIndexes"] = compress_indexes(failed)
        if len(completed) + len(failed) == len(idx) and not status.get("conditions"):
            now = rfc3339(time.time())
            if failed:
                cond = {
                    "type": "Failed",
                    "status": "True",
                    "reason": "FailedIndexes",
                    "message": "Job has failed indexes",
                }
            else:
                cond = {"type": "Complete", "status": "True"}
                status["completionTime"] = now
            status["conditions"] = [{**cond, "lastProbeTime": now, "lastTransitionTime": now}]

    def _containers(self) -> list[Container | None]:
        return [pod["_container"] for pod in self.pods.values()]
