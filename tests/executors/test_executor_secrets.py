"""Per-rank secrets (each replica's own signing key): every backend hands rank r only its own
values, through its secret mechanism, and never in a job spec's plain environment.

local: the process environment; HF Jobs: the job's encrypted ``secrets``; Modal: a
``Secret.from_dict`` in that call's function options; Kubernetes: one Secret per rank, read by
``secretKeyRef`` and owned by the rank's Job; SageMaker: the job's Environment; Ray: the actor's
``runtime_env`` env_vars; Multi: each sub-executor gets only its ranks' secrets.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _executor_helpers import PROBE, probe, wait_for_records  # noqa: E402
from _executor_helpers import replica_args as _args  # noqa: E402
from test_hf_jobs_executor import hub  # noqa: E402, F401  (fixtures)
from test_k8s_executor import cluster  # noqa: E402, F401
from test_modal_executor import _make as make_modal  # noqa: E402
from test_modal_executor import fake  # noqa: E402, F401
from test_sagemaker_executor import aws  # noqa: E402, F401

from composer_replication.executors.executor import check_secrets  # noqa: E402
from composer_replication.executors.local import LocalProcessExecutor  # noqa: E402

NAME = "COMPOSER_SIGNING_KEY"
SECRETS = {r: {NAME: f"private-key-of-rank-{r}-0f9e8d"} for r in range(3)}


def _own_key_only(store: Path, n: int = 3) -> None:
    for rank in range(n):
        rec = json.loads((store / f"rank-{rank}.json").read_text())
        assert rec["env"][NAME] == SECRETS[rank][NAME], rec


def test_check_secrets_rejects_what_cannot_be_handed_over():
    assert check_secrets(None, [0]) == {}
    with pytest.raises(ValueError, match="rank 5, which this launch does not start"):
        check_secrets({5: {NAME: "x"}}, [0, 1])
    with pytest.raises(ValueError, match="environment variable names to strings"):
        check_secrets({0: {"not a name": "x"}}, [0])
    with pytest.raises(ValueError, match="environment variable names to strings"):
        check_secrets({0: {NAME: 1}}, [0])


def test_local_processes_get_only_their_own_secret(tmp_path):
    store = tmp_path / "store"
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs", poll_interval=0.05)
    handles = ex.launch_replicas(
        3, PROBE, ["--store", str(store), "--echo-env", NAME], secrets=SECRETS
    )
    ex.collect(handles, timeout=60)
    recs = wait_for_records(str(store), 3)
    for rank in range(3):
        assert recs[rank]["env"][NAME] == SECRETS[rank][NAME]


def test_hf_jobs_rank_secrets_are_job_secrets_not_env(hub):  # noqa: F811
    standin, make, tmp = hub
    ex = make(secrets={"WANDB_API_KEY": "shared"})
    store = tmp / "store"
    handles = ex.launch_replicas(
        3, "diloco_replica.py", _args(store, **{"show-env": [NAME]}), secrets=SECRETS
    )
    for rank, body in enumerate(standin.created):
        assert body["secrets"] == {"WANDB_API_KEY": "shared", **SECRETS[rank]}
        assert NAME not in body["environment"]
    ex.collect(handles, timeout=60)
    _own_key_only(store)


def test_modal_rank_secrets_are_modal_secrets_not_call_arguments(fake, tmp_path):  # noqa: F811
    ex = make_modal(fake, secrets=["wandb"])
    store = tmp_path / "store"
    handles = ex.launch_replicas(
        3, "diloco_replica.py", _args(store, **{"show-env": [NAME]}), secrets=SECRETS
    )
    spawns = [args for name, args, _ in fake.calls if name == "Function.spawn"]
    assert not any(SECRETS[r][NAME] in json.dumps(args) for args in spawns for r in SECRETS)
    options = [kw for name, _, kw in fake.calls if name == "Function.with_options"]
    assert len(options) == 3 and all(kw["secrets"][0].name == "wandb" for kw in options)
    assert all(SECRETS[0][NAME] not in repr(c) for c in fake.calls)  # values never recorded
    ex.collect(handles, timeout=60)
    _own_key_only(store)


def test_k8s_rank_secrets_live_in_per_rank_secrets_owned_by_their_jobs(cluster):  # noqa: F811
    standin, make, tmp = cluster
    ex = make()
    store = tmp / "store"
    handles = ex.launch_replicas(
        3, "diloco_replica.py", _args(store, **{"show-env": [NAME]}), secrets=SECRETS
    )
    assert len(standin.created) == 3  # one Job per rank: one pod template cannot hold 3 Secrets
    for body in standin.created:
        env = body["spec"]["template"]["spec"]["containers"][0]["env"]
        entry = next(e for e in env if e["name"] == NAME)
        job = body["metadata"]["name"]
        assert entry["valueFrom"]["secretKeyRef"] == {"name": f"{job}-secrets", "key": NAME}
        assert standin.secret_owners[f"{job}-secrets"] == job
    assert all(SECRETS[r][NAME] not in json.dumps(standin.created) for r in range(3))
    ex.collect(handles, timeout=60)
    _own_key_only(store)


def test_sagemaker_rank_secrets_reach_only_their_job(aws):  # noqa: F811
    standin, make, tmp = aws
    ex = make()
    store = tmp / "store"
    handles = ex.launch_replicas(
        3, "diloco_replica.py", _args(store, **{"show-env": [NAME]}), secrets=SECRETS
    )
    for rank, body in enumerate(standin.created):
        assert body["Environment"][NAME] == SECRETS[rank][NAME]
    ex.collect(handles, timeout=120)
    _own_key_only(store)


@pytest.mark.slow
def test_ray_rank_secrets_travel_in_runtime_env(tmp_path):
    from _executor_helpers import private_ray_executor

    store = tmp_path / "store"
    with private_ray_executor(tmp_path / "logs", init_num_cpus=2) as ex:
        handles = ex.launch_replicas(
            2,
            PROBE,
            ["--store", str(store), "--echo-env", NAME],
            secrets={r: SECRETS[r] for r in range(2)},
        )
        ex.collect(handles, timeout=120)
    recs = probe.read_records(str(store))
    assert {r: recs[r]["env"][NAME] for r in range(2)} == {r: SECRETS[r][NAME] for r in range(2)}


def test_multi_executor_hands_each_backend_only_its_ranks_secrets(tmp_path):
    from composer_replication.executors.multi import MultiExecutor

    store = tmp_path / "store"
    a = LocalProcessExecutor(log_dir=tmp_path / "a", poll_interval=0.05)
    b = LocalProcessExecutor(log_dir=tmp_path / "b", poll_interval=0.05)
    seen: dict[str, object] = {}
    real = LocalProcessExecutor.launch_ranks

    def spy(self, ranks, *args, **kwargs):
        seen[id(self)] = kwargs.get("secrets")
        return real(self, ranks, *args, **kwargs)

    LocalProcessExecutor.launch_ranks = spy  # type: ignore[method-assign]
    try:
        multi = MultiExecutor([(a, 1), (b, 2)], poll_interval=0.05)
        handles = multi.launch_replicas(
            3, PROBE, ["--store", str(store), "--echo-env", NAME], secrets=SECRETS
        )
        multi.collect(handles, timeout=60)
    finally:
        LocalProcessExecutor.launch_ranks = real  # type: ignore[method-assign]
    assert seen[id(a)] == {0: SECRETS[0]} and seen[id(b)] == {1: SECRETS[1], 2: SECRETS[2]}
    recs = wait_for_records(str(store), 3)
    assert all(recs[r]["env"][NAME] == SECRETS[r][NAME] for r in range(3))
