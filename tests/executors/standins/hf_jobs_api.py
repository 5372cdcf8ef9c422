"""A stand-in of the Hugging Face Jobs REST API (the part huggingface_hub's HfApi calls).

  GET  /api/whoami-v2                         the token's user (namespace)
  POST /api/jobs/{ns}                         create (body checked like the Hub does)
  GET  /api/jobs/{ns}/{id}                    JobInfo JSON (stage SCHEDULING -> RUNNING -> ...)
  GET  /api/jobs/{ns}/{id}/logs[?tail=N]      server-sent events, one `data: {...}` per line
  POST /api/jobs/{ns}/{id}/cancel             stop the job (stage CANCELED)

Each job's command runs as a local process with `environment` + `secrets` as its env, after
`pending_seconds` of SCHEDULING. A non-zero exit gives stage ERROR with the message
"Job failed with exit code: N"; passing timeoutSeconds kills it (ERROR, "Job timed out").
"""

from __future__ import annotations

import json
import secrets as _secrets
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from .common import Container, JobLoop, rfc3339

USER = "diloco-user"


def _err(code: int, message: str):
    return code, {"error": message}, "application/json"


class HFJobsStandin(JobLoop):
    def __init__(
        self,
        workdir: Path,
        *,
        token: str,
        flavors: list[str],
        pending_seconds: float = 0.3,
    ) -> None:
        self.workdir = Path(workdir)
        self.token = token
        self.flavors = set(flavors)
        self.pending_seconds = pending_seconds
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.created: list[dict[str, Any]] = []
        self.cancels: list[str] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.fail_create_after: int | None = None
        self._start_loop()

    def handle(self, method: str, path: str, headers: dict[str, str], body: Any):
        if headers.get("authorization") != f"Bearer {self.token}":
            return _err(401, "Invalid credentials in Authorization header")
        url = urlparse(path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        parts = url.path.strip("/").split("/")
        with self._lock:
            if parts == ["api", "whoami-v2"] and method == "GET":
                return (
                    200,
                    {"type": "user", "name": USER, "id": "u1", "orgs": []},
                    "application/json",
                )
            if parts[:2] != ["api", "jobs"] or len(parts) < 3:
                return _err(404, "not found")
            if parts[2] != USER:
                return _err(403, f"no access to namespace {parts[2]}")
            if len(parts) == 3 and method == "POST":
                return self._create(body)
            job = self.jobs.get(parts[3]) if len(parts) > 3 else None
            if job is None:
                return _err(404, "Job not found")
            if len(parts) == 4 and method == "GET":
                return 200, self._info(job), "application/json"
            if len(parts) == 5 and parts[4] == "logs" and method == "GET":
                return 200, self._sse(job, query.get("tail")), "text/event-stream"
            if len(parts) == 5 and parts[4] == "cancel" and method == "POST":
                self.cancels.append(job["id"])
                if job["stage"] in ("SCHEDULING", "RUNNING"):
                    job["stage"] = "CANCELED"
                    if job["container"] is not None:
                        job["container"].kill()
                return 200, None, "application/json"
        return _err(404, "not found")

    def _validate(self, body: Any) -> str | None:
        if not isinstance(body, dict):
            return "body must be a JSON object"
        if not body.get("dockerImage") and not body.get("spaceId"):
            return "dockerImage or spaceId is required"
        cmd = body.get("command")
        if not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) for a in cmd):
            return "command must be a non-empty list of strings"
        if body.get("flavor") not in self.flavors:
            return f"unknown flavor {body.get('flavor')!r}"
        for key in ("environment", "secrets", "labels"):
            val = body.get(key, {})
            if not isinstance(val, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in val.items()
            ):
                return f"{key} must map strings to strings"
        t = body.get("timeoutSeconds")
        if t is not None and (not isinstance(t, int) or t <= 0):
            return "timeoutSeconds must be a positive integer"
        return None

    def _create(self, body: Any):
        if self.fail_create_after is not None and len(self.created) >= self.fail_create_after:
            return _err(500, "injected failure: no capacity")
        problem = self._validate(body)
        if problem:
            return _err(400, problem)
        self.created.append(body)
        job_id = _secrets.token_hex(12)
        job = {
            "id": job_id,
            "body": body,
            "created": time.time(),
            "stage": "SCHEDULING",
            "message": None,
            "container": None,
            "started": None,
            "finished": None,
        }
        self.jobs[job_id] = job
        return 200, self._info(job), "application/json"

    def _info(self, job: dict[str, Any]) -> dict[str, Any]:
        b = job["body"]
        return {
            "id": job["id"],
            "createdAt": rfc3339(job["created"]),
            "startedAt": rfc3339(job["started"]),
            "finishedAt": rfc3339(job["finished"]),
            "dockerImage": b.get("dockerImage"),
            "command": b["command"],
            "arguments": b.get("arguments", []),
            "environment": b.get("environment", {}),
            # The Hub never returns secret values, only that they are set.
            "secrets": dict.fromkeys(b.get("secrets", {}), "********"),
            "flavor": b["flavor"],
            "labels": b.get("labels"),
            "status": {"stage": job["stage"], "message": job["message"]},
            "owner": {"id": "u1", "name": USER, "type": "user"},
        }

    def _sse(self, job: dict[str, Any], tail: str | None):
        text = job["container"].text() if job["container"] is not None else ""
        lines = text.splitlines()
        if tail is not None:
            lines = lines[-int(tail) :] if int(tail) else []
        ts = rfc3339(job["started"] or time.time())
        events = [f"===== Job started at {ts} =====", *lines]
        for line in events:
            yield b"data: " + json.dumps({"timestamp": ts, "data": line}).encode() + b"\n\n"

    def _tick(self) -> None:
        for job in self.jobs.values():
            self._step(job)

    def _step(self, job: dict[str, Any]) -> None:
        b = job["body"]
        if job["stage"] == "SCHEDULING" and time.time() - job["created"] >= self.pending_seconds:
            env = {**b.get("environment", {}), **b.get("secrets", {})}
            log = self.workdir / f"hfjob-{job['id']}.log"
            job["container"] = Container(list(b["command"]), env, log, str(self.workdir))
            job["started"] = job["container"].started_at
            job["stage"] = "RUNNING"
        if job["stage"] != "RUNNING":
            return
        code = job["container"].exit_code
        timeout = b.get("timeoutSeconds")
        if code is None and timeout and time.time() - job["started"] > timeout:
            job["container"].kill()
            job["stage"], job["message"] = "ERROR", "Job timed out"
            job["finished"] = time.time()
        elif code is not None:
            job["finished"] = time.time()
            if code == 0:
                job["stage"] = "COMPLETED"
            else:
                job["stage"], job["message"] = "ERROR", f"Job failed with exit code: {code}"

    def _containers(self) -> list[Container | None]:
        return [job["container"] for job in self.jobs.values()]
