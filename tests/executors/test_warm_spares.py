"""LocalProcessExecutor's warm spares (executors/spare.py) with real processes: a spare takes a
restart as the replica itself (its pid, group, log), faults and cancel act on it as on a cold
launch, a bad assignment is refused, no spare outlives its executor or its driver, and
``warm_spares=0`` starts none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from composer_replication.executors import spare as spare_mod
from composer_replication.executors.executor import ReplicaHandle, ReplicaStatus
from composer_replication.executors.local import LocalProcessExecutor

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parent))
from _executor_helpers import HERE, PROBE, alive  # noqa: E402

ROOT = HERE.parents[1]

# A preload module that leaves a marker (its pid, the time it was imported) beside itself.
MARKER_MODULE = """
import os, pathlib, time
pathlib.Path(__file__).with_name(f"marker-{os.getpid()}").write_text(repr(time.time()))
"""


@pytest.fixture
def preload_dir(tmp_path: Path) -> Path:
    d = tmp_path / "preload"
    d.mkdir()
    (d / "spare_marker.py").write_text(MARKER_MODULE)
    return d


def _env(preload_dir: Path) -> dict[str, str]:
    # the package, the marker module and the probe (module entrypoint) for every process
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(preload_dir), str(HERE)])}


def _executor(tmp_path: Path, **kw: object) -> LocalProcessExecutor:
    kw = {"max_restarts": 2, "warm_spares": 1, "preload": ["spare_marker"], **kw}
    return LocalProcessExecutor(
        log_dir=tmp_path / "logs",
        grace_period=1.0,
        poll_interval=0.05,
        **kw,  # type: ignore[arg-type]
    )


def _until(what: str, cond: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _ready_spare(ex: LocalProcessExecutor) -> int:
    _until("a ready spare", lambda: ex.spare_pids(ready=True))
    return ex.spare_pids(ready=True)[0]


def _attempt(store: Path, k: int) -> dict:
    path = store / ("rank-0.json" if k == 0 else f"rank-0-attempt-{k}.json")
    _until(f"attempt {k}'s record", path.exists)
    return json.loads(path.read_text())


def _restarted(ex: LocalProcessExecutor, handle: ReplicaHandle, n: int) -> None:
    _until(f"restart {n}", lambda: ex.poll([handle]) and handle.restarts >= n)


@pytest.mark.parametrize("entrypoint", [PROBE, "replica_probe"])
def test_a_ready_spare_takes_the_restart_as_the_replica_itself(
    tmp_path: Path, preload_dir: Path, entrypoint: str
) -> None:
    """kill -9 of a replica: the restart runs in the spare (its pid, its own process group),
    whose preload was imported before the kill; the replica's log gets its output; a new spare
    replaces it."""
    ex = _executor(tmp_path)
    store = tmp_path / "store"
    try:
        args = ["--store", str(store), "--sleep", "120", "--echo-env", "EXTRA"]
        (h,) = ex.launch_replicas(1, entrypoint, args, env={**_env(preload_dir), "EXTRA": "x"})
        cold = _attempt(store, 0)
        spare = _ready_spare(ex)
        assert spare != cold["pid"] and not (preload_dir / f"marker-{cold['pid']}").exists()
        t_kill = time.time()
        os.killpg(cold["pid"], signal.SIGKILL)
        _restarted(ex, h, 1)
        warm = _attempt(store, 1)
        assert warm["pid"] == spare == ex.pid(h) and warm["pgid"] == spare
        assert h.status is ReplicaStatus.RUNNING and ex.spare_takeovers == 1
        # the spare had imported its preload before the replica it became was even killed
        assert float((preload_dir / f"marker-{spare}").read_text()) < t_kill
        # what a cold launch gives: the replica's environment, argv, log
        assert warm["env"] == {**cold["env"]} and warm["env"]["EXTRA"] == "x"
        assert warm["argv"] == cold["argv"]
        started = f"probe rank=0 attempt=1 pid={spare} started"  # printed after the record
        _until("the replica's output in its log", lambda: started in ex.logs(h))
        assert f"restart 1 of 2 (warm spare pid {spare}) ===" in ex.logs(h)
        _until("a new spare", lambda: ex.spare_pids() and spare not in ex.spare_pids())
    finally:
        ex.shutdown()


def test_sigstop_sigkill_and_cancel_act_on_a_spare_launched_replica_as_on_a_cold_one(
    tmp_path: Path, preload_dir: Path
) -> None:
    """SIGSTOP leaves it running; SIGKILL is a death the restart policy counts (and, past
    max_restarts, a failure saying so); cancel ends its whole group, grandchild included."""
    ex = _executor(tmp_path, max_restarts=1)
    store = tmp_path / "store"
    try:
        args: dict[str, Any] = {"store": str(store), "sleep": 120, "grandchild": True}
        (h,) = ex.launch_replicas(1, PROBE, args, env=_env(preload_dir))
        cold = _attempt(store, 0)
        spare = _ready_spare(ex)
        os.killpg(cold["pid"], signal.SIGKILL)
        _restarted(ex, h, 1)
        warm = _attempt(store, 1)
        assert warm["pid"] == spare
        os.killpg(spare, signal.SIGSTOP)
        for _ in range(5):
            assert ex.poll([h])[0].status is ReplicaStatus.RUNNING
            time.sleep(0.05)
        os.killpg(spare, signal.SIGCONT)
        os.kill(spare, signal.SIGKILL)
        _until("the failure", lambda: ex.poll([h])[0].status.done)
        assert (h.status, h.exit_code, h.restarts) == (ReplicaStatus.FAILED, -9, 1)
        assert h.error is not None and h.error.startswith("killed by signal SIGKILL")
        assert not alive(warm["grandchild_pid"])  # its group was ended with it

        # cancel, on a fresh launch taken by the new spare
        spare2 = _ready_spare(ex)
        store2 = tmp_path / "store2"
        (h2,) = ex.launch_replicas(1, PROBE, {**args, "store": str(store2)}, env=_env(preload_dir))
        rec = _attempt(store2, 0)
        assert rec["pid"] == spare2 and ex.spare_takeovers == 2
        ex.cancel([h2])
        assert h2.status is ReplicaStatus.CANCELLED and h2.exit_code is not None
        assert not alive(rec["pid"]) and not alive(rec["grandchild_pid"])
    finally:
        ex.shutdown()


def test_spares_end_with_shutdown(tmp_path: Path, preload_dir: Path) -> None:
    ex = _executor(tmp_path, warm_spares=2)
    (h,) = ex.launch_replicas(1, PROBE, {"store": str(tmp_path / "s")}, env=_env(preload_dir))
    ex.collect([h], timeout=60)
    _until("two spares", lambda: len(ex.spare_pids()) == 2)
    spares = ex.spare_pids()
    ex.shutdown()
    assert not [p for p in spares if alive(p)] and ex.spare_pids() == []
    ex.shutdown()  # idempotent


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_spare_outlives_its_driver(tmp_path: Path, preload_dir: Path, how: str) -> None:
    """The driver's interpreter exits (atexit) or is SIGKILLed (parent-death signal, and the
    spare's stdin reaches its end): its spares are gone either way."""
    pids = tmp_path / "spares.json"
    driver = textwrap.dedent(
        f"""
        import json, os, time
        from composer_replication.executors.local import LocalProcessExecutor
        logs = {str(tmp_path / "logs")!r}
        ex = LocalProcessExecutor(warm_spares=2, preload=["spare_marker"], log_dir=logs)
        ex.collect(ex.launch_replicas(1, {PROBE!r}, {{"store": {str(tmp_path / "s")!r}}},
                                      env={_env(preload_dir)!r}), timeout=60)
        while len(ex.spare_pids(ready=True)) < 2:
            time.sleep(0.02)
        open({str(pids)!r} + ".tmp", "w").write(json.dumps(ex.spare_pids()))
        os.rename({str(pids)!r} + ".tmp", {str(pids)!r})
        while not os.path.exists({str(tmp_path / "exit")!r}):  # the test says when
            time.sleep(0.02)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", driver], env=env)
    spares: list[int] = []
    try:
        _until("the driver's spares", pids.exists)
        spares = json.loads(pids.read_text())
        assert len(spares) == 2 and all(alive(p) for p in spares)
        if how == "sigkill":
            proc.send_signal(signal.SIGKILL)
        else:
            (tmp_path / "exit").touch()
        assert proc.wait(timeout=60) == (-9 if how == "sigkill" else 0)
        _until("the spares gone", lambda: not [p for p in spares if alive(p)], timeout=10)
    finally:
        proc.kill()
        for p in spares:
            if alive(p):
                os.killpg(p, signal.SIGKILL)


def test_a_spare_that_cannot_preload_leaves_restarts_cold(tmp_path: Path) -> None:
    """A preload that does not import: the spare ends before it is ready (its log says why),
    no other is started, and the restart is a cold launch."""
    ex = _executor(tmp_path, preload=["no_such_module_for_a_spare"], max_restarts=1)
    store = tmp_path / "store"
    try:
        args: dict[str, Any] = {"store": str(store), "sleep": 120}
        (h,) = ex.launch_replicas(1, PROBE, args, env={"PYTHONPATH": str(ROOT)})
        cold = _attempt(store, 0)
        _until("the spare's end", lambda: not ex.spare_pids())
        assert ex._spares is not None and "before it was ready" in str(ex._spares.failed)
        logs = list((tmp_path / "logs").glob("spare-*.log"))
        assert len(logs) == 1 and "no_such_module_for_a_spare" in logs[0].read_text()
        os.killpg(cold["pid"], signal.SIGKILL)
        _restarted(ex, h, 1)
        assert _attempt(store, 1)["pid"] == ex.pid(h) != cold["pid"]
        assert ex.spare_takeovers == 0 and ex.spare_pids() == []
        assert "warm spare" not in ex.logs(h)
    finally:
        ex.shutdown()


def test_without_warm_spares_nothing_changes(tmp_path: Path) -> None:
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs", max_restarts=1, poll_interval=0.05)
    args: dict[str, Any] = {"store": str(tmp_path / "store"), "exit-code": 5, "fail-attempts": 1}
    (h,) = ex.collect(ex.launch_replicas(1, PROBE, args), timeout=60)
    assert (h.status, h.restarts) == (ReplicaStatus.SUCCEEDED, 1)
    assert "replica 0 exit code 5; restart 1 of 1 ===\n" in ex.logs(h)
    assert ex.spare_pids() == [] and ex.spare_takeovers == 0
    assert h.log_location is not None
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [Path(h.log_location).name]


def test_bad_options_raise() -> None:
    with pytest.raises(ValueError, match="warm_spares must be an integer >= 0"):
        LocalProcessExecutor(warm_spares=-1)
    with pytest.raises(ValueError, match="preload must be a list of module names"):
        LocalProcessExecutor(warm_spares=1, preload="torch")
    with pytest.raises(ValueError, match="preload must be a list of module names"):
        LocalProcessExecutor(warm_spares=1, preload=["not a module"])


# ------------------------------------------------------------------ the spare's own side


def _good(tmp_path: Path) -> dict:
    return {
        "argv": [PROBE, "--store", str(tmp_path)],
        "env": {"A": "1"},
        "cwd": None,
        "log": str(tmp_path / "r.log"),
    }


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"argv": []}, "'argv' must be a non-empty list"),
        ({"argv": ["-c", "print(1)"]}, "interpreter options are not taken"),
        ({"argv": ["-m", "not a module"]}, "'-m' needs a module name"),
        ({"env": {"A": 1}}, "'env' entry 'A'"),
        ({"env": {"A=B": "1"}}, "'env' entry 'A=B'"),
        ({"log": "relative.log"}, "'log' must be an absolute path"),
        ({"cwd": "/no/such/dir"}, "'cwd' must be null or a directory"),
        ({"pickle": "gASVAAAAAAAAAAA="}, "expected an object with keys"),
        ({"env": {"PYTHONPATH": "/elsewhere"}}, r"startup variables \['PYTHONPATH'\] differ"),
    ],
)
def test_parse_assignment_refuses_what_is_not_an_assignment(
    tmp_path: Path, change: dict, why: str
) -> None:
    line = json.dumps({**_good(tmp_path), **change}).encode()
    with pytest.raises(ValueError, match=f"spare assignment refused: {why}"):
        spare_mod.parse_assignment(line, spare_env={"PYTHONPATH": str(ROOT)})
    assert spare_mod.parse_assignment(json.dumps(_good(tmp_path)).encode()).env == {"A": "1"}
    with pytest.raises(ValueError, match="not JSON"):
        spare_mod.parse_assignment(b"\x80\x04K\x01.")  # a pickle is not read as one


def test_a_spare_refuses_a_bad_assignment_in_the_replicas_log(tmp_path: Path) -> None:
    """A real spare: ready on its fd, then a bad assignment (a startup variable it cannot take
    any more): exit code 2, the reason in the log the assignment named."""
    read_fd, write_fd = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = spare_mod.spare_command(sys.executable, write_fd, ["json"])
    proc = subprocess.Popen(
        cmd, env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write_fd,)
    )
    os.close(write_fd)
    try:
        assert os.read(read_fd, 64) == b"ready\n"
        doc = {**_good(tmp_path), "env": {**env, "PYTHONPATH": "/elsewhere"}}
        _, err = proc.communicate(json.dumps(doc).encode() + b"\n", timeout=30)
        assert proc.returncode == spare_mod.REFUSED_EXIT
        assert "startup variables ['PYTHONPATH'] differ" in (tmp_path / "r.log").read_text()
        assert err == b""
    finally:
        os.close(read_fd)
        proc.kill()


def test_runnable_argv_only_python_entrypoints() -> None:
    py = sys.executable
    assert spare_mod.runnable_argv([py, "x.py", "--a"], py) == ["x.py", "--a"]
    assert spare_mod.runnable_argv([py, "-m", "pkg.mod", "1"], py) == ["-m", "pkg.mod", "1"]
    assert spare_mod.runnable_argv(["/bin/sh", "x.sh"], py) is None
    assert spare_mod.runnable_argv([py, "-c", "pass"], py) is None
