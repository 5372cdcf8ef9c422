"""LocalProcessExecutor with real replica processes (tests/executors/replica_probe.py)."""

from __future__ import annotations

import _thread
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from composer_replication.executors import local as local_mod
from composer_replication.executors.executor import ReplicaStatus, ServerlessExecutor
from composer_replication.executors.local import LocalProcessExecutor

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parent))
from _executor_helpers import HERE, PROBE, alive, probe, wait_for_records  # noqa: E402


@pytest.fixture
def ex(tmp_path):
    executor = LocalProcessExecutor(log_dir=tmp_path / "logs", grace_period=1.0, poll_interval=0.05)
    yield executor
    executor.shutdown()


def test_three_replicas_write_rank_and_env_poll_to_completion(ex, tmp_path):
    store = (tmp_path / "store").as_uri()
    args = {"store": store, "rendezvous": "file:///run/x", "rank_env": "RANK", "echo-env": "RANK"}
    handles = ex.launch_replicas(3, PROBE, args, env={"EXTRA": "1"})
    assert isinstance(ex, ServerlessExecutor)
    assert [h.replica_id for h in handles] == [0, 1, 2]
    assert all(h.backend == "local" and h.status is ReplicaStatus.RUNNING for h in handles)
    assert len({h.job_id for h in handles}) == 3
    deadline = time.monotonic() + 30
    while not all(h.status.done for h in ex.poll(handles)):
        assert time.monotonic() < deadline, handles
        time.sleep(0.05)
    assert [(h.status, h.exit_code) for h in handles] == [(ReplicaStatus.SUCCEEDED, 0)] * 3
    assert all(h.end_time >= h.start_time for h in handles)
    recs = probe.read_records(store)
    for rank in range(3):
        env = recs[rank]["env"]
        assert env == {
            "REPLICA_RANK": str(rank),
            "WORLD_SIZE": "3",
            "DILOCO_RENDEZVOUS": "file:///run/x",
            "RANK": str(rank),
        }
        assert recs[rank]["pgid"] == recs[rank]["pid"]  # its own process group
        log = ex.logs(handles[rank])
        assert f"probe rank={rank} attempt=0" in log and log.endswith("done\n")
        assert ex.logs(handles[rank], tail=1) == f"probe rank={rank} done\n"
        assert Path(handles[rank].log_location).read_text() == log
        assert handles[rank].log_location.startswith(str(tmp_path / "logs"))


def test_seed_driver_snippet_unchanged(tmp_path, monkeypatch):
    # The seed's replica script reads only the environment; the driver code below is the seed's.
    (tmp_path / "diloco_replica.py").write_text(
        textwrap.dedent(
            """
            import os, pathlib
            root = pathlib.Path(os.environ["DILOCO_RENDEZVOUS"].removeprefix("file://"))
            rank = int(os.environ["REPLICA_RANK"])
            (root / f"replica-{rank}").write_text(os.environ["WORLD_SIZE"])
            """
        )
    )
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(tmp_path)
    uri = run.as_uri()
    executor = LocalProcessExecutor()
    handles = executor.launch_replicas(
        n_replicas=4,
        entrypoint="diloco_replica.py",
        entrypoint_args={"rendezvous": uri, "rank_env": "REPLICA_RANK"},
    )
    result = executor.collect(handles, timeout=3600)
    assert {h.replica_id: h.exit_code for h in result} == {0: 0, 1: 0, 2: 0, 3: 0}
    assert sorted(p.name for p in run.iterdir()) == [f"replica-{r}" for r in range(4)]
    assert (run / "replica-3").read_text() == "4"


@pytest.mark.parametrize("entrypoint", ["replica_probe", "replica_probe:main"])
def test_module_and_function_entrypoints(ex, tmp_path, entrypoint, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # validate_launch finds the module here ...
    env = {"PYTHONPATH": str(HERE)}  # ... and the replicas find it there
    store = str(tmp_path / "store")
    handles = ex.launch_replicas(2, entrypoint, ["--store", store, "--exit-code", "4"], env=env)
    ex.collect(handles, timeout=60)
    assert [h.exit_code for h in handles] == [4, 4]  # the function's return value is the code
    assert sorted(probe.read_records(store)) == [0, 1]


def test_failed_replica_reported_with_log_tail(ex, tmp_path):
    store = str(tmp_path / "store")
    args = {"store": store, "exit-code": 3, "fail-rank": 1}
    result = ex.collect(ex.launch_replicas(3, PROBE, args), timeout=60)
    assert [h.status for h in result] == [
        ReplicaStatus.SUCCEEDED,
        ReplicaStatus.FAILED,
        ReplicaStatus.SUCCEEDED,
    ]
    assert {h.replica_id: h.exit_code for h in result} == {0: 0, 1: 3, 2: 0}
    err = result[1].error
    assert err.startswith("exit code 3; last log lines:")
    assert "probe rank=1 failing on purpose with exit code 3" in err
    assert result[0].error is None


def test_cancel_mid_run_ends_whole_tree(ex, tmp_path):
    store = str(tmp_path / "store")
    handles = ex.launch_replicas(2, PROBE, {"store": store, "sleep": 120, "grandchild": True})
    recs = wait_for_records(store, 2)
    pids = [r["pid"] for r in recs.values()] + [r["grandchild_pid"] for r in recs.values()]
    assert all(alive(p) for p in pids)
    t0 = time.monotonic()
    ex.cancel(handles)
    assert time.monotonic() - t0 < 10  # grace is 1 s; SIGTERM ends the probe at once
    assert [h.status for h in handles] == [ReplicaStatus.CANCELLED] * 2
    assert all(h.exit_code is not None and h.exit_code < 0 for h in handles)  # by a signal
    assert not [p for p in pids if alive(p)], "orphans left behind"
    ex.cancel(handles)  # idempotent
    assert [h.status for h in handles] == [ReplicaStatus.CANCELLED] * 2


def test_sigterm_ignored_then_sigkill_after_grace(tmp_path):
    ex = LocalProcessExecutor(log_dir=tmp_path, grace_period=0.5, poll_interval=0.05)
    store = str(tmp_path / "store")
    args = {"store": store, "sleep": 120, "ignore-sigterm": True, "grandchild": True}
    handles = ex.launch_replicas(1, PROBE, args)
    rec = wait_for_records(store, 1)[0]
    ex.cancel(handles)
    assert handles[0].exit_code == -9
    assert not alive(rec["pid"]) and not alive(rec["grandchild_pid"])


def test_collect_timeout_marks_failed_and_kills(ex, tmp_path):
    store = str(tmp_path / "store")
    args = {"store": store, "sleep": 120, "grandchild": True}
    fast = {"store": str(tmp_path / "fast")}
    handles = ex.launch_ranks([0], 2, PROBE, args) + ex.launch_ranks([1], 2, PROBE, fast)
    recs = wait_for_records(store, 1)
    t0 = time.monotonic()
    result = ex.collect(handles, timeout=3)
    assert 2.5 < time.monotonic() - t0 < 15
    assert result[1].status is ReplicaStatus.SUCCEEDED and result[1].exit_code == 0
    assert result[0].status is ReplicaStatus.FAILED
    assert result[0].error.startswith("timeout after 3s; last log lines:")
    assert "probe rank=0 attempt=0" in result[0].error
    assert not alive(recs[0]["pid"]) and not alive(recs[0]["grandchild_pid"])


def test_ctrl_c_during_collect_cancels_every_replica(ex, tmp_path, ctrl_c):
    store = str(tmp_path / "store")
    handles = ex.launch_replicas(2, PROBE, {"store": store, "sleep": 120, "grandchild": True})
    recs = wait_for_records(store, 2)
    timer = threading.Timer(0.3, _thread.interrupt_main)  # what Ctrl-C does to the main thread
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        ex.collect(handles, timeout=60)
    timer.join()
    assert [h.status for h in handles] == [ReplicaStatus.CANCELLED] * 2
    pids = [r[k] for r in recs.values() for k in ("pid", "grandchild_pid")]
    assert not [p for p in pids if alive(p)]


def test_restart_policy_restarts_crashed_replica_others_keep_running(tmp_path):
    ex = LocalProcessExecutor(log_dir=tmp_path, max_restarts=2, poll_interval=0.05)
    store = str(tmp_path / "store")
    # rank 1 crashes on its first attempt only; the others run through once
    args = {"store": store, "exit-code": 5, "fail-rank": 1, "fail-attempts": 1, "sleep": 1.0}
    result = ex.collect(ex.launch_replicas(3, PROBE, args), timeout=60)
    assert [(h.status, h.exit_code, h.restarts) for h in result] == [
        (ReplicaStatus.SUCCEEDED, 0, 0),
        (ReplicaStatus.SUCCEEDED, 0, 1),
        (ReplicaStatus.SUCCEEDED, 0, 0),
    ]
    names = sorted(os.listdir(tmp_path / "store"))
    assert "rank-1-attempt-1.json" in names
    assert not any(n.startswith(("rank-0-attempt", "rank-2-attempt")) for n in names)
    log = ex.logs(result[1])
    assert "replica 1 exit code 5; restart 1 of 2" in log
    assert log.count("started") == 2


def test_restart_policy_gives_up_after_max_restarts(tmp_path):
    ex = LocalProcessExecutor(log_dir=tmp_path, max_restarts=1, poll_interval=0.05)
    args = {"store": str(tmp_path / "store"), "exit-code": 7}
    (h,) = ex.collect(ex.launch_replicas(1, PROBE, args), timeout=60)
    assert (h.status, h.exit_code, h.restarts) == (ReplicaStatus.FAILED, 7, 1)
    assert "restart 1 of 1" in h.error and h.error.startswith("exit code 7")


def test_grandchild_left_after_success_is_ended(ex, tmp_path):
    store = str(tmp_path / "store")
    (h,) = ex.collect(ex.launch_replicas(1, PROBE, {"store": store, "grandchild": True}), 60)
    assert h.status is ReplicaStatus.SUCCEEDED
    assert not alive(probe.read_records(store)[0]["grandchild_pid"])


def test_bad_launches_raise_before_anything_starts(ex, tmp_path):
    with pytest.raises(ValueError, match="n_replicas must be an integer >= 1"):
        ex.launch_replicas(0, PROBE)
    with pytest.raises(ValueError, match="not found"):
        ex.launch_replicas(2, str(tmp_path / "nope.py"))
    with pytest.raises(ValueError, match="cannot be found"):
        ex.launch_replicas(2, "no_such_module_xyz.train")
    with pytest.raises(ValueError, match="takes no resources"):
        ex.launch_replicas(2, PROBE, {"store": str(tmp_path)}, resources={"num_gpus": 1})
    with pytest.raises(ValueError, match="max_restarts"):
        LocalProcessExecutor(max_restarts=-1)
    assert not (tmp_path / "logs").exists() or not os.listdir(tmp_path / "logs")


def test_partial_launch_failure_cancels_launched(ex, tmp_path, monkeypatch):
    store = str(tmp_path / "store")
    real_spawn = local_mod.spawn_in_group
    calls = []

    def flaky_spawn(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("no more processes")
        return real_spawn(*args, **kwargs)

    monkeypatch.setattr(local_mod, "spawn_in_group", flaky_spawn)
    with pytest.raises(OSError, match="no more processes"):
        ex.launch_replicas(3, PROBE, {"store": store, "sleep": 120})
    procs = [r.proc for r in ex._replicas.values()]
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)


def test_replicas_end_when_driver_exits_without_collect(tmp_path):
    store = str(tmp_path / "store")
    driver = textwrap.dedent(
        f"""
        from composer_replication.executors.local import LocalProcessExecutor
        import sys, time
        sys.path.insert(0, {str(HERE)!r})
        import replica_probe
        ex = LocalProcessExecutor(grace_period=1.0)
        ex.launch_replicas(1, {PROBE!r}, {{"store": {store!r}, "sleep": 120, "grandchild": True}})
        while not replica_probe.read_records({store!r}):
            time.sleep(0.05)
        """
    )
    subprocess.run([sys.executable, "-c", driver], check=True, timeout=600)
    rec = probe.read_records(store)[0]
    assert not alive(rec["pid"]) and not alive(rec["grandchild_pid"])


@pytest.mark.parametrize("die_with_driver", [True, False])
def test_replicas_die_with_a_sigkilled_driver(tmp_path, die_with_driver):
    """kill -9 of the driver: no atexit runs, only the parent-death signal ends the replicas
    (with die_with_driver=False they survive it, reparented, as before)."""
    import signal

    store = str(tmp_path / "store")
    driver = textwrap.dedent(
        f"""
        from composer_replication.executors.local import LocalProcessExecutor
        import sys, time
        sys.path.insert(0, {str(HERE)!r})
        ex = LocalProcessExecutor(grace_period=1.0, die_with_driver={die_with_driver!r})
        ex.launch_replicas(2, {PROBE!r}, {{"store": {store!r}, "sleep": 120}})
        time.sleep(120)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver])
    try:
        recs = wait_for_records(store, 2, timeout=60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        pids = [r["pid"] for r in recs.values()]
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [alive(p) for p in pids] == [not die_with_driver] * 2
    finally:
        for r in probe.read_records(store).values():
            if alive(r["pid"]):
                os.killpg(r["pid"], signal.SIGKILL)
