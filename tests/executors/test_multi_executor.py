"""MultiExecutor: one run's replicas over local processes + a real local Ray."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from composer_replication.executors.executor import ReplicaStatus, ServerlessExecutor
from composer_replication.executors.local import LocalProcessExecutor
from composer_replication.executors.multi import MultiExecutor

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parent))
from _executor_helpers import PROBE, alive, private_ray_executor, probe  # noqa: E402


@pytest.fixture(scope="module")
def ray_ex(tmp_path_factory):
    with private_ray_executor(tmp_path_factory.mktemp("ray-logs"), init_num_cpus=2) as ex:
        yield ex


@pytest.fixture
def local_ex(tmp_path):
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs", grace_period=1.0, poll_interval=0.05)
    yield ex
    ex.shutdown()


def test_local_plus_ray_unique_ranks_one_world(local_ex, ray_ex, tmp_path):
    multi = MultiExecutor({local_ex: 2, ray_ex: 1}, poll_interval=0.05)
    assert isinstance(multi, ServerlessExecutor)
    store = str(tmp_path / "store")
    args = {"store": store, "rendezvous": "file:///run/z", "rank_env": "RANK", "echo-env": "RANK"}
    handles = multi.launch_replicas(n_replicas=3, entrypoint=PROBE, entrypoint_args=args)
    assert [(h.replica_id, h.backend) for h in handles] == [(0, "local"), (1, "local"), (2, "ray")]
    result = multi.collect(handles, timeout=120)
    assert {h.replica_id: h.exit_code for h in result} == {0: 0, 1: 0, 2: 0}
    recs = probe.read_records(store)
    assert sorted(recs) == [0, 1, 2]
    for rank, rec in recs.items():
        assert rec["env"] == {
            "REPLICA_RANK": str(rank),
            "WORLD_SIZE": "3",
            "DILOCO_RENDEZVOUS": "file:///run/z",
            "RANK": str(rank),
        }
    assert multi.executor_of(handles[2]) is ray_ex
    assert multi.logs(handles[2], tail=1) == "probe rank=2 done\n"
    assert multi.logs(handles[0], tail=1) == "probe rank=0 done\n"


def test_failure_timeout_and_cancel_routed_per_backend(local_ex, ray_ex, tmp_path):
    multi = MultiExecutor([(ray_ex, 1), (local_ex, 2)], poll_interval=0.05)
    store = str(tmp_path / "store")
    # rank 0 (ray) outlives the timeout, rank 1 (local) fails at once, rank 2 (local) is cancelled
    args = {"store": store, "sleep": 30, "sleep-rank": [0, 2], "exit-code": 2, "fail-rank": 1}
    handles = multi.launch_replicas(3, PROBE, args)
    deadline = time.monotonic() + 60
    while len(probe.read_records(store)) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    multi.cancel(handles[2:])  # cancel only rank 2 mid-run
    assert handles[2].status is ReplicaStatus.CANCELLED
    assert handles[0].status is not ReplicaStatus.CANCELLED
    result = multi.collect(handles, timeout=1)
    assert [h.backend for h in result] == ["ray", "local", "local"]
    assert result[0].status is ReplicaStatus.FAILED
    assert result[0].error.startswith("timeout after 1s")
    assert result[1].status is ReplicaStatus.FAILED and result[1].exit_code == 2
    assert "failing on purpose" in result[1].error
    assert result[2].status is ReplicaStatus.CANCELLED
    pids = [r["pid"] for r in probe.read_records(store).values()]
    assert not [p for p in pids if alive(p)]


def test_placement_must_match_and_be_valid(local_ex, tmp_path):
    multi = MultiExecutor({local_ex: 2})
    with pytest.raises(ValueError, match="placement adds up to 2"):
        multi.launch_replicas(3, PROBE, {"store": str(tmp_path)})
    with pytest.raises(ValueError, match="n_replicas must be an integer >= 1"):
        multi.launch_replicas(0, PROBE)
    with pytest.raises(ValueError, match="at least one"):
        MultiExecutor({})
    with pytest.raises(ValueError, match="must be an int >= 1"):
        MultiExecutor({local_ex: 0})
    with pytest.raises(ValueError, match="not a ServerlessExecutor"):
        MultiExecutor([(object(), 1)])
    with pytest.raises(ValueError, match="only once"):
        MultiExecutor([(local_ex, 1), (local_ex, 1)])
    other = LocalProcessExecutor()
    with pytest.raises(ValueError, match="not launched by this MultiExecutor"):
        MultiExecutor({other: 1}).logs(
            other.launch_replicas(1, PROBE, {"store": str(tmp_path / "s")})[0]
        )
    other.shutdown()


def test_bad_entrypoint_launches_nothing_anywhere(tmp_path):
    a = LocalProcessExecutor(log_dir=tmp_path / "a")
    b = LocalProcessExecutor(log_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="cannot be found"):
        MultiExecutor({a: 1, b: 1}).launch_replicas(2, "no_such_module_xyz")
    assert not a._replicas and not b._replicas


def test_partial_launch_failure_cancels_other_backends(tmp_path, monkeypatch):
    a = LocalProcessExecutor(log_dir=tmp_path / "a", grace_period=1.0)
    b = LocalProcessExecutor(log_dir=tmp_path / "b")

    def broken(*args, **kwargs):
        raise RuntimeError("backend b is down")

    monkeypatch.setattr(b, "launch_ranks", broken)
    store = str(tmp_path / "store")
    with pytest.raises(RuntimeError, match="backend b is down"):
        MultiExecutor({a: 2, b: 1}).launch_replicas(3, PROBE, {"store": store, "sleep": 120})
    procs = [r.proc for r in a._replicas.values()]
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)
