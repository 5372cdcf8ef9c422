"""The Kubernetes Indexed Job that K8sExecutor submits, built from plain arguments.

Kept apart from the executor so the spec (what the cluster is asked to run) can be read and
tested on its own. See `build_indexed_job` for the choices it encodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubernetes.client import V1Job

__all__ = ["INDEX_ANNOTATION", "JOB_NAME_LABEL", "build_indexed_job", "parse_indexes"]

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
# Exit code of a container stopped by SIGTERM (128 + 15): what deleting a pod produces.
SIGTERM_EXIT = 143


def parse_indexes(text: str | None) -> set[int]:
    """The Job API's compressed index list ("0-2,4") -> {0, 1, 2, 4}."""
    out: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def build_indexed_job(
    k: ModuleType,
    *,
    name: str,
    image: str,
    command: list[str],
    base_env: dict[str, str],
    rank_keys: set[str],
    offset: int,
    count: int,
    limits: dict[str, str],
    secret_env: dict[str, tuple[str, str]],
    env_from_secrets: Sequence[str],
    backoff_limit_per_index: int,
    ttl_seconds_after_finished: int | None,
    active_deadline_seconds: int | None,
    service_account: str | None,
    node_selector: dict[str, str] | None,
    image_pull_secrets: Sequence[str],
    labels: dict[str, str],
) -> V1Job:
    """A `V1Job` running `count` indexes of `command`; index i is rank offset + i.

    `k` is the `kubernetes.client` module. Choices encoded here:
    - completionMode Indexed, completions = parallelism = count, restartPolicy Never, and
      backoffLimitPerIndex: one replica is retried alone, the others are untouched.
    - The rank variables (`rank_keys`) come from the completion-index annotation through the
      downward API when offset is 0 (no shell needed). With an offset they are computed by a
      `/bin/sh -c` wrapper from JOB_COMPLETION_INDEX, which Kubernetes sets in every pod.
    - podFailurePolicy: disruptions (preemption, drain) are ignored, i.e. retried without
      counting; exit 143 (we deleted the pod to cancel it) fails the index, so it is not retried.
    - limits are also the requests (GPUs must be; for CPU/memory it gives Guaranteed QoS).
    """
    env = [k.V1EnvVar(name=n, value=v) for n, v in base_env.items() if n not in rank_keys]
    if rank_keys and offset == 0:
        index_ref = k.V1ObjectFieldSelector(
            field_path=f"metadata.annotations['{INDEX_ANNOTATION}']"
        )
        env += [
            k.V1EnvVar(name=n, value_from=k.V1EnvVarSource(field_ref=index_ref))
            for n in sorted(rank_keys)
        ]
    elif rank_keys:
        exports = " ".join(f"{n}=$((JOB_COMPLETION_INDEX + {offset}))" for n in sorted(rank_keys))
        command = ["/bin/sh", "-c", f'export {exports}; exec "$@"', "sh", *command]
    for var, (secret, key) in sorted(secret_env.items()):
        selector = k.V1SecretKeySelector(name=secret, key=key)
        env.append(k.V1EnvVar(name=var, value_from=k.V1EnvVarSource(secret_key_ref=selector)))
    env_from = [k.V1EnvFromSource(secret_ref=k.V1SecretEnvSource(name=s)) for s in env_from_secrets]
    container = k.V1Container(
        name="replica",
        image=image,
        command=command,
        env=env,
        env_from=env_from or None,
        resources=k.V1ResourceRequirements(limits=limits, requests=limits) if limits else None,
    )
    pull = [k.V1LocalObjectReference(name=s) for s in image_pull_secrets]
    pod_spec = k.V1PodSpec(
        containers=[container],
        restart_policy="Never",
        service_account_name=service_account,
        node_selector=node_selector,
        image_pull_secrets=pull or None,
    )
    disruption = k.V1PodFailurePolicyOnPodConditionsPattern(type="DisruptionTarget", status="True")
    cancelled = k.V1PodFailurePolicyOnExitCodesRequirement(operator="In", values=[SIGTERM_EXIT])
    policy = k.V1PodFailurePolicy(
        rules=[
            k.V1PodFailurePolicyRule(action="Ignore", on_pod_conditions=[disruption]),
            k.V1PodFailurePolicyRule(action="FailIndex", on_exit_codes=cancelled),
        ]
    )
    all_labels = {"app.kubernetes.io/name": "composer-replication", **labels}
    return k.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=k.V1ObjectMeta(name=name, labels=all_labels),
        spec=k.V1JobSpec(
            completion_mode="Indexed",
            completions=count,
            parallelism=count,
            backoff_limit_per_index=backoff_limit_per_index,
            pod_failure_policy=policy,
            ttl_seconds_after_finished=ttl_seconds_after_finished,
            active_deadline_seconds=active_deadline_seconds,
            template=k.V1PodTemplateSpec(metadata=k.V1ObjectMeta(labels=all_labels), spec=pod_spec),
        ),
    )
