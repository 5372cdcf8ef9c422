"""RayExecutor on a real local Ray (started once for the module by the executor itself)."""

from __future__ import annotations

import _thread
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from composer_replication.executors.executor import ReplicaStatus, ServerlessExecutor

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parent))
from _executor_helpers import HERE, PROBE, alive, private_ray_executor, probe  # noqa: E402
from _executor_helpers import wait_for_records as _wait_for_records  # noqa: E402


def wait_for_records(store: str, n: int, timeout: float = 60.0) -> dict[int, dict]:
    return _wait_for_records(store, n, timeout)


@pytest.fixture(scope="module")
def ray_ex(tmp_path_factory):
    """The module's RayExecutor; it starts a private local Ray and shuts it down at the end."""
    with private_ray_executor(tmp_path_factory.mktemp("ray-logs"), init_num_cpus=4) as ex:
        yield ex


def test_three_replicas_write_rank_and_env(ray_ex, tmp_path):
    assert isinstance(ray_ex, ServerlessExecutor)
    store = str(tmp_path / "store")
    args = {"store": store, "rendezvous": "file:///run/y", "rank_env": "RANK", "echo-env": "RANK"}
    handles = ray_ex.launch_replicas(3, PROBE, args, env={"X": "1"})
    assert [h.replica_id for h in handles] == [0, 1, 2]
    assert all(h.backend == "ray" and h.status is ReplicaStatus.PENDING for h in handles)
    deadline = time.monotonic() + 60
    while not all(h.status.done for h in ray_ex.poll(handles)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert [(h.status, h.exit_code) for h in handles] == [(ReplicaStatus.SUCCEEDED, 0)] * 3
    recs = probe.read_records(store)
    for rank in range(3):
        assert recs[rank]["env"] == {
            "REPLICA_RANK": str(rank),
            "WORLD_SIZE": "3",
            "DILOCO_RENDEZVOUS": "file:///run/y",
            "RANK": str(rank),
        }
        assert ray_ex.logs(handles[rank], tail=1) == f"probe rank={rank} done\n"
        assert "attempt=0" in Path(handles[rank].log_location).read_text()
    # the replica is a subprocess of a Ray worker, not of this driver
    assert all(recs[r]["pid"] != os.getpid() for r in recs)


def test_seed_driver_snippet_unchanged(ray_ex, tmp_path, monkeypatch):
    from composer_replication.executors.ray import RayExecutor

    (tmp_path / "diloco_replica.py").write_text(
        textwrap.dedent(
            """
            import os, pathlib
            root = pathlib.Path(os.environ["DILOCO_RENDEZVOUS"].removeprefix("file://"))
            (root / f"replica-{os.environ['REPLICA_RANK']}").write_text("ok")
            """
        )
    )
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(tmp_path)
    uri = run.as_uri()
    executor = RayExecutor()  # joins the module's Ray
    handles = executor.launch_replicas(
        n_replicas=2,
        entrypoint="diloco_replica.py",
        entrypoint_args={"rendezvous": uri, "rank_env": "REPLICA_RANK"},
    )
    result = executor.collect(handles, timeout=3600)
    assert {h.replica_id: h.exit_code for h in result} == {0: 0, 1: 0}
    assert sorted(p.name for p in run.iterdir()) == ["replica-0", "replica-1"]


def test_module_function_entrypoint_and_failure_with_log_tail(ray_ex, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    store = str(tmp_path / "store")
    args = {"store": store, "exit-code": 3, "fail-rank": 0}
    handles = ray_ex.launch_replicas(2, "replica_probe:main", args, env={"PYTHONPATH": str(HERE)})
    result = ray_ex.collect(handles, timeout=60)
    assert {h.replica_id: h.exit_code for h in result} == {0: 3, 1: 0}
    assert [h.status for h in result] == [ReplicaStatus.FAILED, ReplicaStatus.SUCCEEDED]
    assert result[0].error.startswith("exit code 3; last log lines:")
    assert "failing on purpose with exit code 3" in result[0].error


def test_cancel_mid_run_ends_whole_tree(ray_ex, tmp_path):
    store = str(tmp_path / "store")
    handles = ray_ex.launch_replicas(2, PROBE, {"store": store, "sleep": 120, "grandchild": True})
    recs = wait_for_records(store, 2)
    ray_ex.poll(handles)
    assert [h.status for h in handles] == [ReplicaStatus.RUNNING] * 2
    pids = [r[k] for r in recs.values() for k in ("pid", "grandchild_pid")]
    assert all(alive(p) for p in pids)
    t0 = time.monotonic()
    ray_ex.cancel(handles)
    assert time.monotonic() - t0 < 15
    assert [h.status for h in handles] == [ReplicaStatus.CANCELLED] * 2
    assert not [p for p in pids if alive(p)], "orphans left behind"


def test_cluster_mode_logs_through_the_actor_then_copied(ray_ex, tmp_path):
    # What a remote cluster looks like: the replica's log is on its node, not in log_dir.
    from composer_replication.executors.ray import RayExecutor

    remote = RayExecutor(
        shared_filesystem=False,
        log_dir=tmp_path / "driver-logs",
        cwd=str(tmp_path),
        poll_interval=0.05,
        grace_period=1.0,
    )
    store = str(tmp_path / "store")
    handles = remote.launch_replicas(2, PROBE, {"store": store, "sleep": 60, "sleep-rank": 1})
    wait_for_records(store, 2)
    (h0, h1) = remote.collect(handles[:1], timeout=60) + handles[1:]
    assert h0.status is ReplicaStatus.SUCCEEDED
    assert remote.logs(h0, tail=1) == "probe rank=0 done\n"
    assert Path(h0.log_location).read_text().endswith("probe rank=0 done\n")  # copied over
    deadline = time.monotonic() + 30
    while "started" not in remote.logs(h1):  # still running: read through its actor
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not Path(h1.log_location).exists()
    remote.cancel([h1])
    assert h1.status is ReplicaStatus.CANCELLED
    assert "probe rank=1 attempt=0" in Path(h1.log_location).read_text()


def test_collect_timeout_marks_failed_and_kills(ray_ex, tmp_path):
    store = str(tmp_path / "store")
    handles = ray_ex.launch_replicas(1, PROBE, {"store": store, "sleep": 120})
    rec = wait_for_records(store, 1)[0]
    (h,) = ray_ex.collect(handles, timeout=1)
    assert h.status is ReplicaStatus.FAILED
    assert h.error.startswith("timeout after 1s; last log lines:")
    assert "probe rank=0 attempt=0" in h.error
    assert not alive(rec["pid"])


def test_unplaceable_replica_stays_pending_then_times_out(ray_ex, tmp_path):
    # No node offers this resource: the actor cannot be placed, so the replica never starts.
    store = str(tmp_path / "store")
    need = {"resources": {"no_such_accelerator": 1}}
    handles = ray_ex.launch_replicas(1, PROBE, {"store": store}, resources=need)
    assert ray_ex.poll(handles)[0].status is ReplicaStatus.PENDING
    t0 = time.monotonic()
    (h,) = ray_ex.collect(handles, timeout=1.5)
    assert time.monotonic() - t0 < 12  # not 16+: an unplaced actor is not waited for
    assert h.status is ReplicaStatus.FAILED and h.error.startswith("timeout after 1.5s")
    assert probe.read_records(store) == {}


def test_ctrl_c_during_collect_cancels_every_replica(ray_ex, tmp_path, ctrl_c):
    store = str(tmp_path / "store")
    handles = ray_ex.launch_replicas(2, PROBE, {"store": store, "sleep": 120})
    recs = wait_for_records(store, 2)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        ray_ex.collect(handles, timeout=60)
    timer.join()
    assert [h.status for h in handles] == [ReplicaStatus.CANCELLED] * 2
    assert not [r["pid"] for r in recs.values() if alive(r["pid"])]


def test_bad_input_raises_before_launch(ray_ex, tmp_path):
    from composer_replication.executors.ray import RayExecutor

    with pytest.raises(ValueError, match="unknown Ray resources"):
        ray_ex.launch_replicas(1, PROBE, {"store": str(tmp_path)}, resources={"gpu": 1})
    with pytest.raises(ValueError, match="num_cpus must be a number >= 0"):
        ray_ex.launch_replicas(1, PROBE, {"store": str(tmp_path)}, resources={"num_cpus": -1})
    with pytest.raises(ValueError, match="n_replicas"):
        ray_ex.launch_replicas(0, PROBE)
    with pytest.raises(ValueError, match="not found"):
        ray_ex.launch_replicas(1, str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="num_gpus must be a number"):
        RayExecutor(num_gpus="one")


def test_missing_ray_names_the_extra(monkeypatch):
    from composer_replication.executors.ray import RayExecutor

    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(ImportError, match=r"composer-replication\[ray\]"):
        RayExecutor()
