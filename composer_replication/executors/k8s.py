"""K8sExecutor: N DiLoCo replicas as one Kubernetes Indexed Job.

One Job with `completionMode: Indexed` and completions = parallelism = N runs index k as
replica k. The rank reaches the container without any shell: REPLICA_RANK (and the
`rank_env` alias) are set from the pod's `batch.kubernetes.io/job-completion-index`
annotation through the downward API (`fieldRef`), so any image with Python works. (When a
MultiExecutor gives this executor ranks a..a+k-1 with a > 0, the command is wrapped in
`/bin/sh -c` to add the offset to JOB_COMPLETION_INDEX; that case needs /bin/sh in the image.)

Failure semantics: `backoffLimitPerIndex` retries one replica without touching the others (a
dead replica must not stop the run; DiLoCo survives a late or missing contribution). The pod
failure policy ignores disruptions (preemption, node drain: retried, not counted) and fails an
index whose container exited 143 (SIGTERM, i.e. we cancelled it), so a cancelled replica is
not restarted. Status comes from the Job (completedIndexes / failedIndexes) and its pods
(phase, exit code, retries); logs from the pods; cancelling the whole job deletes it with
propagationPolicy Foreground so no pod outlives it.

Credentials: the kubernetes client's standard places, in-cluster service account first, then
kubeconfig (KUBECONFIG or ~/.kube/config, optional `context`), or an `api_client` you build.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from composer_replication.executors.executor import (
    ENV_RANK,
    EntrypointArgs,
    ExecutorBase,
    ReplicaHandle,
    ReplicaStatus,
    Resources,
    SecretsByRank,
    check_arg_style,
    check_secrets,
    replica_env,
    tail_lines,
    validate_launch,
)
from composer_replication.executors.k8s_job import (
    INDEX_ANNOTATION,
    JOB_NAME_LABEL,
    build_indexed_job,
    parse_indexes,
)
from composer_replication.executors.redact import (
    MissingCredentialsError,
    import_sdk,
    sdk_errors,
)

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

__all__ = ["K8sExecutor", "parse_indexes"]

# Friendly resource names -> Kubernetes resource names.
_RESOURCE_NAMES = {"gpu": "nvidia.com/gpu", "cpu": "cpu", "memory": "memory"}
_SNAPSHOT_LINES = 500  # log lines kept per replica before its pod is deleted


class K8sExecutor(ExecutorBase):
    """Replicas as the indexes of one Kubernetes Indexed Job (see the module docstring).

    image: container image holding Python and composer-replication (required).
    namespace / name_prefix / labels: where and under which name the Job is created.
    secret_env: {"ENV_NAME": ("secret-name", "key")} -> env from a Secret (secretKeyRef).
    env_from_secrets: Secrets whose every key becomes an env variable (envFrom).
    backoff_limit_per_index: retries of one replica before it counts as failed.
    python: interpreter name inside the image.
    api_client: a ready `kubernetes.client.ApiClient` (tests point its host at a stand-in);
      otherwise in-cluster config, then kubeconfig (`config_file`, `context`).
    resources at launch: {"gpu": 1, "cpu": "4", "memory": "16Gi", "<any k8s name>": q}.
    """

    backend = "k8s"

    def __init__(
        self,
        image: str | None,
        *,
        namespace: str = "default",
        name_prefix: str = "diloco",
        secret_env: dict[str, tuple[str, str]] | None = None,
        env_from_secrets: Sequence[str] = (),
        backoff_limit_per_index: int = 0,
        ttl_seconds_after_finished: int | None = 86400,
        active_deadline_seconds: int | None = None,
        service_account: str | None = None,
        node_selector: dict[str, str] | None = None,
        image_pull_secrets: Sequence[str] = (),
        labels: dict[str, str] | None = None,
        python: str = "python",
        arg_style: str = "auto",
        api_client: ApiClient | None = None,
        config_file: str | None = None,
        context: str | None = None,
        poll_interval: float = 2.0,
        request_timeout: float = 30.0,
    ) -> None:
        if not image or not isinstance(image, str):
            raise ValueError(
                "K8sExecutor needs image='registry/repo:tag' (an image with Python "
                "and composer-replication installed); none was given"
            )
        if backoff_limit_per_index < 0:
            raise ValueError(f"backoff_limit_per_index must be >= 0, got {backoff_limit_per_index}")
        self._client = import_sdk("kubernetes.client", "k8s")
        self.image = image
        self.namespace = namespace
        self.name_prefix = name_prefix.lower().strip("-")[:40] or "diloco"
        self.secret_env = dict(secret_env or {})
        self.env_from_secrets = list(env_from_secrets)
        self.backoff_limit_per_index = backoff_limit_per_index
        self.ttl_seconds_after_finished = ttl_seconds_after_finished
        self.active_deadline_seconds = active_deadline_seconds
        self.service_account = service_account
        self.node_selector = node_selector
        self.image_pull_secrets = list(image_pull_secrets)
        self.labels = dict(labels or {})
        self.python = python
        self.arg_style = check_arg_style(arg_style)
        self.poll_interval = poll_interval
        self.request_timeout = request_timeout  # a hung API server must not hang collect()
        self.api_client = api_client or self._load_client(config_file, context)
        cfg = self.api_client.configuration
        self._secrets = [*(cfg.api_key or {}).values(), cfg.password, cfg.access_token]
        self.batch = self._client.BatchV1Api(self.api_client)
        self.core = self._client.CoreV1Api(self.api_client)
        self._cancelled: dict[str, set[int]] = {}  # job name -> indexes we cancelled
        self._log_cache: dict[str, str] = {}

    def _load_client(self, config_file: str | None, context: str | None) -> ApiClient:
        config = import_sdk("kubernetes.config", "k8s")
        cfg = self._client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            try:
                config.load_kube_config(
                    config_file=config_file, context=context, client_configuration=cfg
                )
            except (config.ConfigException, OSError, TypeError) as exc:
                raise MissingCredentialsError(
                    "no Kubernetes credentials: not running in a pod with a service account and "
                    f"no usable kubeconfig ({type(exc).__name__}); set KUBECONFIG, create "
                    "~/.kube/config, or pass api_client="
                ) from None
        return self._client.ApiClient(cfg)

    # ------------------------------------------------------------------ launch
    def check_launch(self, n_replicas: int, entrypoint: str) -> None:
        # The code lives in the image, so nothing is checked on the driver's machine.
        validate_launch(n_replicas, entrypoint, check_local=False)

    def _check_resources(self, resources: Resources) -> Resources:
        out: Resources = {}  # Kubernetes quantities, as strings
        for key, value in resources.items():
            name = _RESOURCE_NAMES.get(key, key)
            if "/" not in name and name not in ("cpu", "memory", "ephemeral-storage"):
                raise ValueError(
                    f"unknown resource {key!r}: use gpu, cpu, memory, ephemeral-storage or a "
                    "Kubernetes extended resource name such as 'nvidia.com/gpu'"
                )
            if name.endswith("/gpu") and (not str(value).isdigit() or int(str(value)) < 1):
                raise ValueError(f"{key} must be a whole number of GPUs >= 1, got {value!r}")
            out[name] = str(value)
        return out

    def launch_ranks(
        self,
        ranks: Sequence[int],
        world_size: int,
        entrypoint: str,
        entrypoint_args: EntrypointArgs | None = None,
        *,
        env: dict[str, str] | None = None,
        resources: Resources | None = None,
        secrets: SecretsByRank | None = None,
    ) -> list[ReplicaHandle]:
        """Create one Indexed Job for ranks a..a+k-1 (they must be consecutive).

        With per-rank ``secrets`` every rank is its own one-index Job whose container reads its
        values from its own Kubernetes Secret (``secretKeyRef``; owned by the Job, so deleting
        the Job deletes it): pods of one Indexed Job share one template and could not be given
        different Secrets.
        """
        ranks = sorted(ranks)
        if not ranks or any(not isinstance(r, int) or not 0 <= r < world_size for r in ranks):
            raise ValueError(f"ranks must be integers in [0, {world_size}), got {ranks}")
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ValueError(f"K8sExecutor runs consecutive ranks as one Indexed Job, got {ranks}")
        if check_secrets(secrets, ranks):
            return super().launch_ranks(
                ranks,
                world_size,
                entrypoint,
                entrypoint_args,
                env=env,
                resources=resources,
                secrets=secrets,
            )
        command, limits = self._prepare(world_size, entrypoint, entrypoint_args, resources)
        base_env = replica_env(ranks[0], world_size, entrypoint_args, env)
        rank_keys = {ENV_RANK}
        if isinstance(entrypoint_args, dict) and entrypoint_args.get("rank_env"):
            rank_keys.add(str(entrypoint_args["rank_env"]))
        quantities = {name: str(q) for name, q in limits.items()}
        return self._create_job(ranks[0], len(ranks), command, base_env, rank_keys, quantities)

    def _start(
        self,
        rank: int,
        world_size: int,
        command: list[str],
        env: dict[str, str],
        resources: Resources,
        secrets: dict[str, str],
    ) -> ReplicaHandle:
        """One replica as its own one-index Job (its env already holds its rank); its secrets,
        if any, in its own Kubernetes Secret."""
        quantities = {name: str(q) for name, q in resources.items()}
        return self._create_job(rank, 1, command, env, set(), quantities, secrets)[0]

    def _create_secret(self, name: str, values: dict[str, str]) -> None:
        k = self._client
        body = k.V1Secret(
            metadata=k.V1ObjectMeta(name=name, labels={**self.labels, "diloco-job": name}),
            string_data=dict(values),
            type="Opaque",
        )
        with sdk_errors(
            self.backend, f"creating secret {name}", [*self._secrets, *values.values()]
        ):
            self.core.create_namespaced_secret(
                namespace=self.namespace, body=body, _request_timeout=self.request_timeout
            )

    def _own_secret(self, secret: str, job: str, uid: str | None) -> None:
        """Make the Job own its Secret, so Kubernetes deletes the Secret with the Job."""
        if not uid:
            return
        ref = {"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": uid}
        with sdk_errors(self.backend, f"patching secret {secret}", self._secrets):
            self.core.patch_namespaced_secret(
                name=secret,
                namespace=self.namespace,
                body={"metadata": {"ownerReferences": [ref]}},
                _request_timeout=self.request_timeout,
            )

    def _delete_secret(self, name: str) -> None:
        try:
            with sdk_errors(self.backend, f"deleting secret {name}", self._secrets):
                self.core.delete_namespaced_secret(
                    name=name, namespace=self.namespace, _request_timeout=self.request_timeout
                )
        except Exception as exc:  # already gone (owned by its deleted Job) is fine
            if "404" not in str(exc) and "NotFound" not in str(exc):
                raise

    def _create_job(
        self,
        offset: int,
        count: int,
        command: list[str],
        base_env: dict[str, str],
        rank_keys: set[str],
        limits: dict[str, str],
        secrets: dict[str, str] | None = None,
    ) -> list[ReplicaHandle]:
        name = f"{self.name_prefix}-{uuid.uuid4().hex[:10]}"
        secret_env = dict(self.secret_env)
        if secrets:
            secret_name = f"{name}-secrets"
            self._create_secret(secret_name, secrets)
            secret_env.update({var: (secret_name, var) for var in secrets})
        job = build_indexed_job(
            self._client,
            name=name,
            image=self.image,
            command=command,
            base_env=base_env,
            rank_keys=rank_keys,
            offset=offset,
            count=count,
            limits=limits,
            secret_env=secret_env,
            env_from_secrets=self.env_from_secrets,
            backoff_limit_per_index=self.backoff_limit_per_index,
            ttl_seconds_after_finished=self.ttl_seconds_after_finished,
            active_deadline_seconds=self.active_deadline_seconds,
            service_account=self.service_account,
            node_selector=self.node_selector,
            image_pull_secrets=self.image_pull_secrets,
            labels=self.labels,
        )
        try:
            with sdk_errors(self.backend, f"creating job {name}", self._secrets):
                created = self.batch.create_namespaced_job(
                    namespace=self.namespace, body=job, _request_timeout=self.request_timeout
                )
            if secrets:
                self._own_secret(f"{name}-secrets", name, created.metadata.uid)
        except Exception:
            # The request may have reached the server even though the call failed (timeout):
            # make sure no half-known job is left running.
            self._delete_job(name, quiet=True)
            if secrets:
                self._delete_secret(f"{name}-secrets")
            raise
        now = time.time()
        return [
            self._new_handle(
                offset + i,
                f"{name}/{i}",
                ReplicaStatus.PENDING,
                f"k8s://{self.namespace}/jobs/{name}/{i}",
                start_time=now,
            )
            for i in range(count)
        ]

    # ------------------------------------------------------------------ watch
    @staticmethod
    def _split(handle: ReplicaHandle) -> tuple[str, int]:
        name, _, index = handle.job_id.rpartition("/")
        return name, int(index)

    def _index_pods(self, name: str) -> dict[int, list[Any]]:
        with sdk_errors(self.backend, f"listing pods of job {name}", self._secrets):
            pods = self.core.list_namespaced_pod(
                namespace=self.namespace,
                label_selector=f"{JOB_NAME_LABEL}={name}",
                _request_timeout=self.request_timeout,
            ).items
        by_index: dict[int, list[Any]] = defaultdict(list)
        for pod in pods:
            index = (pod.metadata.annotations or {}).get(INDEX_ANNOTATION)
            if index is not None:
                by_index[int(index)].append(pod)
        for plist in by_index.values():
            plist.sort(key=lambda p: (p.metadata.creation_timestamp or 0, p.metadata.name))
        return by_index

    def _read_job(self, name: str) -> Any | None:
        """The Job object, or None when it no longer exists (404)."""
        try:
            with sdk_errors(self.backend, f"reading job {name}", self._secrets):
                return self.batch.read_namespaced_job(
                    name=name, namespace=self.namespace, _request_timeout=self.request_timeout
                )
        except Exception as exc:
            if "404" in str(exc) or "NotFound" in str(exc):
                return None
            raise

    def poll(self, handles: list[ReplicaHandle]) -> list[ReplicaHandle]:
        """One job read and one pod list per job, whatever the number of replicas."""
        groups: dict[str, list[ReplicaHandle]] = defaultdict(list)
        for h in handles:
            if not h.status.done:
                groups[self._split(h)[0]].append(h)
        for name, group in groups.items():
            job = self._read_job(name)
            if job is None:
                for h in group:
                    self._fail(h, f"job {name} no longer exists (deleted outside this executor)")
                continue
            status = job.status
            completed = parse_indexes(status.completed_indexes if status else None)
            failed = parse_indexes(status.failed_indexes if status else None)
            pods = self._index_pods(name)
            job_failed = (
                next(
                    (
                        c
                        for c in (status.conditions or [])
                        if c.type == "Failed" and c.status == "True"
                    ),
                    None,
                )
                if status
                else None
            )
            for h in group:
                index = self._split(h)[1]
                self._update(h, name, index, completed, failed, pods.get(index, []))
                if job_failed is not None and not h.status.done:
                    # The whole job ended (activeDeadlineSeconds, backoffLimit, ...): indexes
                    # neither completed nor failed will never run again.
                    self._fail(h, f"job failed: {job_failed.reason}: {job_failed.message}")
        return handles

    def _update(
        self,
        h: ReplicaHandle,
        name: str,
        index: int,
        completed: set[int],
        failed: set[int],
        pods: list[Any],
    ) -> None:
        h.restarts = max(len(pods) - 1, 0)
        last = pods[-1] if pods else None
        state = None
        if last is not None and last.status and last.status.container_statuses:
            state = last.status.container_statuses[0].state
        terminated = state.terminated if state is not None else None
        if last is not None:
            h.log_location = f"k8s://{self.namespace}/pods/{last.metadata.name}"
        if index in completed or index in failed:
            h.exit_code = (
                terminated.exit_code
                if terminated is not None
                else (0 if index in completed else None)
            )
            if terminated is not None and terminated.finished_at is not None:
                h.end_time = terminated.finished_at.timestamp()
            if index in completed:
                h.status = ReplicaStatus.SUCCEEDED
            else:
                code = "unknown" if h.exit_code is None else h.exit_code
                retries = f" after {h.restarts} retries" if h.restarts else ""
                self._fail(h, f"replica {h.replica_id} exited with code {code}{retries}")
            return
        phase = last.status.phase if last is not None and last.status else "Pending"
        if phase == "Running" or (
            phase in ("Failed", "Succeeded") and h.status is ReplicaStatus.RUNNING
        ):
            h.status = ReplicaStatus.RUNNING
            if state is not None and state.running is not None and state.running.started_at:
                h.start_time = state.running.started_at.timestamp()
        else:
            h.status = ReplicaStatus.PENDING

    # ------------------------------------------------------------------ logs
    def logs(self, handle: ReplicaHandle, tail: int | None = None) -> str:
        """The log of the replica's latest pod (its last attempt); cached once deleted."""
        name, index = self._split(handle)
        text: str | None = None
        try:
            pods = self._index_pods(name).get(index, [])
            if pods:
                with sdk_errors(
                    self.backend, f"reading log of {pods[-1].metadata.name}", self._secrets
                ):
                    text = self.core.read_namespaced_pod_log(
                        name=pods[-1].metadata.name,
                        namespace=self.namespace,
                        tail_lines=tail,
                        _request_timeout=self.request_timeout,
                    )
        except Exception:
            # A pod that is still starting has no log yet, a deleted one none any more: fall
            # back to what was saved before deletion.
            text = None
        if text is None:
            return tail_lines(self._log_cache.get(handle.job_id, ""), tail)
        if tail is None:
            self._log_cache[handle.job_id] = text
        return text

    def _snapshot(self, handles: list[ReplicaHandle]) -> None:
        for h in handles:
            try:
                self._log_cache[h.job_id] = self.logs(h, tail=_SNAPSHOT_LINES)
            except Exception:
                pass

    # ------------------------------------------------------------------ stop
    def _delete_job(self, name: str, quiet: bool = False) -> None:
        try:
            with sdk_errors(self.backend, f"deleting job {name}", self._secrets):
                self.batch.delete_namespaced_job(
                    name=name,
                    namespace=self.namespace,
                    propagation_policy="Foreground",
                    body=self._client.V1DeleteOptions(propagation_policy="Foreground"),
                    _request_timeout=self.request_timeout,
                )
        except Exception as exc:
            if not quiet and "404" not in str(exc) and "NotFound" not in str(exc):
                raise

    def _stop(self, handles: list[ReplicaHandle]) -> None:
        """Stop these replicas: delete the whole job once nothing else of it still runs,
        otherwise delete only their pods (exit 143 -> FailIndex, so they are not retried)."""
        self._snapshot(handles)
        groups: dict[str, list[ReplicaHandle]] = defaultdict(list)
        for h in handles:
            groups[self._split(h)[0]].append(h)
        for name, group in groups.items():
            cancelled = self._cancelled.setdefault(name, set())
            cancelled.update(self._split(h)[1] for h in group)
            job = self._read_job(name)
            if job is None:
                continue  # already gone: nothing left to stop
            status = job.status
            done = parse_indexes(status.completed_indexes if status else None)
            done |= parse_indexes(status.failed_indexes if status else None)
            if len(done | cancelled) >= (job.spec.completions or 0):
                self._delete_job(name)
                continue
            pods = self._index_pods(name)
            for h in group:
                for pod in pods.get(self._split(h)[1], []):
                    with sdk_errors(
                        self.backend, f"deleting pod {pod.metadata.name}", self._secrets
                    ):
                        self.core.delete_namespaced_pod(
                            name=pod.metadata.name,
                            namespace=self.namespace,
                            _request_timeout=self.request_timeout,
                        )

    def _refresh(self, handle: ReplicaHandle) -> None:
        self.poll([handle])

    def _terminate(self, handle: ReplicaHandle) -> None:
        self._stop([handle])

    def cancel(self, handles: list[ReplicaHandle]) -> None:
        """Stop every unfinished replica in `handles` and mark it CANCELLED."""
        live = [h for h in handles if not h.status.done]
        if not live:
            return
        self._stop(live)
        now = time.time()
        for h in live:
            h.status = ReplicaStatus.CANCELLED
            h.end_time = h.end_time or now

    def _timeout(self, pending: list[ReplicaHandle], timeout: float) -> None:
        self._stop(pending)  # snapshots the logs first, so the failure carries its tail
        for h in pending:
            self._fail(h, f"timeout after {timeout:g}s")

    def _cancel_quietly(self, handles: list[ReplicaHandle]) -> None:
        try:
            self.cancel(handles)
        except Exception:  # on the way out of another error: that one matters more
            pass
