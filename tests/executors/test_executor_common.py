"""The shared executor pieces: command/env building, validation, launch.py, and the base loops.

The base-class loops (launch-all-or-cancel, collect timeout, Ctrl-C) are checked here against a
small in-memory backend whose replicas finish when the test says so; the real backends are
tested with real processes in their own modules.
"""

from __future__ import annotations

import _thread
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from composer_replication.executors import executor as ex_mod
from composer_replication.executors import launch
from composer_replication.executors.executor import (
    ExecutorBase,
    ReplicaHandle,
    ReplicaStatus,
    ServerlessExecutor,
    args_to_argv,
    build_command,
    failure_error,
    read_log_file,
    replica_env,
    tail_lines,
    validate_launch,
)

HERE = Path(__file__).resolve().parent
PROBE = str(HERE / "replica_probe.py")


# ----------------------------------------------------------------------------- helpers


def test_build_command_forms():
    args = {
        "rendezvous": "s3://b/r/",
        "rank_env": "RANK",
        "v": True,
        "q": False,
        "n": None,
        "tag": ["a", "b"],
        "lr": 0.5,
    }
    tail = [
        "--rendezvous",
        "s3://b/r/",
        "--rank_env",
        "RANK",
        "--v",
        "--tag",
        "a",
        "--tag",
        "b",
        "--lr",
        "0.5",
    ]
    assert build_command("pkg.mod", args, python="py") == ["py", "-m", "pkg.mod", *tail]
    assert build_command("pkg.mod:fn", args, python="py") == [
        "py",
        "-m",
        "composer_replication.executors.launch",
        "pkg.mod:fn",
        *tail,
    ]
    assert build_command("dir/x.py", ["--a", 1]) == ["python", "dir/x.py", "--a", "1"]
    assert build_command("x.py") == ["python", "x.py"]
    assert ex_mod.LAUNCH_MODULE == launch.__name__


def test_args_to_argv_rejects_bad_types():
    assert args_to_argv(None) == [] and args_to_argv(()) == []
    with pytest.raises(ValueError, match="not a string"):
        args_to_argv("--a 1")
    with pytest.raises(ValueError, match="dict, a list or None"):
        args_to_argv(3)
    with pytest.raises(ValueError, match="non-empty strings"):
        args_to_argv({"": 1})


def test_replica_env_rank_world_rendezvous_and_rank_env():
    env = replica_env(2, 4, {"rendezvous": "file:///r", "rank_env": "LOCAL_RANK"}, {"A": "1"})
    assert env == {
        "A": "1",
        "REPLICA_RANK": "2",
        "WORLD_SIZE": "4",
        "DILOCO_RENDEZVOUS": "file:///r",
        "LOCAL_RANK": "2",
    }
    # no rendezvous / rank_env: only the two always-set variables; list args carry none
    assert replica_env(0, 1, ["--x"]) == {"REPLICA_RANK": "0", "WORLD_SIZE": "1"}
    # the per-replica values win over a user env that tries to set them
    assert replica_env(1, 2, None, {"REPLICA_RANK": "9", "WORLD_SIZE": "9"})["REPLICA_RANK"] == "1"
    with pytest.raises(ValueError, match="rank_env must be an environment variable name"):
        replica_env(0, 1, {"rank_env": "not a name"})


def test_validate_launch():
    validate_launch(1, PROBE)
    validate_launch(3, "composer_replication.executors.launch")
    validate_launch(3, "composer_replication.executors.launch:main")
    validate_launch(2, "replica_probe.py", cwd=HERE)
    for n in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="n_replicas must be an integer >= 1"):
            validate_launch(n, PROBE)
    with pytest.raises(ValueError, match="entrypoint script .* not found"):
        validate_launch(1, "nope/train.py")
    with pytest.raises(ValueError, match="entrypoint module 'no_such_pkg_xyz.sub' cannot be found"):
        validate_launch(1, "no_such_pkg_xyz.sub:main")
    for bad in ("", "  ", "a b", "pkg.mod:", "pkg.mod:1x", None):
        with pytest.raises(ValueError, match="entrypoint"):
            validate_launch(1, bad)
    # code that lives only in a container image: syntax is still checked, existence is not
    validate_launch(1, "/app/train.py", check_local=False)
    validate_launch(1, "their_pkg.train", check_local=False)
    with pytest.raises(ValueError):
        validate_launch(1, "bad name", check_local=False)


def test_status_and_tails():
    assert [s for s in ReplicaStatus if s.done] == [
        ReplicaStatus.SUCCEEDED,
        ReplicaStatus.FAILED,
        ReplicaStatus.CANCELLED,
    ]
    assert ReplicaStatus("running") is ReplicaStatus.RUNNING and ReplicaStatus.FAILED == "failed"
    assert tail_lines("a\nb\nc\n", 2) == "b\nc\n" and tail_lines("a\nb", None) == "a\nb"
    assert tail_lines("a\n", 0) == ""
    with pytest.raises(ValueError):
        tail_lines("a", -1)
    assert failure_error("exit code 1", "x\ny\n") == "exit code 1; last log lines:\nx\ny"
    assert failure_error("exit code 1", "") == "exit code 1 (log is empty)"


def test_read_log_file(tmp_path):
    log = tmp_path / "replica-0.log"
    assert read_log_file(log, 5) == ""  # not written yet
    log.write_bytes(b"a\nb\xff\nc\n")
    assert read_log_file(log) == "a\nb\ufffd\nc\n"
    assert read_log_file(str(log), 2) == "b\ufffd\nc\n"


# ----------------------------------------------------------------------------- launch.py


def test_launch_trampoline_calls_function_with_argv(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("REPLICA_RANK", "0")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    store = str(tmp_path / "store")
    assert launch.main(["replica_probe:main", "--store", store, "--exit-code", "6"]) == 6
    assert (tmp_path / "store" / "rank-0.json").exists()
    assert sys.argv[0] == "replica_probe:main"
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        launch.resolve("replica_probe:nope")
    with pytest.raises(ValueError, match="is not callable"):
        launch.resolve("replica_probe:RECORDED_ENV")
    with pytest.raises(ValueError, match="expected 'pkg.mod:function'"):
        launch.resolve("replica_probe")
    assert launch.main([]) == 2


# ----------------------------------------------------------------------------- base loops


class FakeExecutor(ExecutorBase):
    """Replicas are dict entries; the test finishes them by setting `codes[rank]`."""

    backend = "fake"

    def __init__(self, fail_on_rank: int | None = None) -> None:
        self.poll_interval = 0.01
        self.codes: dict[int, int | None] = {}
        self.terminated: list[int] = []
        self.started: list[tuple[int, int, list[str], dict[str, str]]] = []
        self.fail_on_rank = fail_on_rank

    def check_launch(self, n_replicas: int, entrypoint: str) -> None:
        validate_launch(n_replicas, entrypoint, check_local=False)

    def _start(self, rank, world_size, command, env, resources, secrets) -> ReplicaHandle:
        if rank == self.fail_on_rank:
            raise RuntimeError(f"quota exceeded at rank {rank}")
        self.started.append((rank, world_size, command, env))
        self.codes[rank] = None
        return ReplicaHandle(rank, self.backend, f"job-{rank}", ReplicaStatus.RUNNING)

    def _refresh(self, handle: ReplicaHandle) -> None:
        code = self.codes[handle.replica_id]
        if code is None:
            return
        handle.exit_code = code
        if code == 0:
            handle.status = ReplicaStatus.SUCCEEDED
        else:
            self._fail(handle, f"exit code {code}")

    def _terminate(self, handle: ReplicaHandle) -> None:
        self.terminated.append(handle.replica_id)

    def logs(self, handle: ReplicaHandle, tail: int | None = None) -> str:
        return tail_lines("".join(f"line {i}\n" for i in range(30)), tail)


def test_base_launch_builds_same_command_and_env_for_every_rank():
    fake = FakeExecutor()
    assert isinstance(fake, ServerlessExecutor)
    handles = fake.launch_replicas(3, "pkg.train", {"rendezvous": "s3://b/", "rank_env": "RANK"})
    assert [h.replica_id for h in handles] == [0, 1, 2]
    assert [s[2] for s in fake.started] == [
        ["python", "-m", "pkg.train", "--rendezvous", "s3://b/", "--rank_env", "RANK"]
    ] * 3
    assert [(s[3]["REPLICA_RANK"], s[3]["RANK"], s[3]["WORLD_SIZE"]) for s in fake.started] == [
        ("0", "0", "3"),
        ("1", "1", "3"),
        ("2", "2", "3"),
    ]
    sub = fake.launch_ranks([5, 6], 8, "pkg.train")
    assert [h.replica_id for h in sub] == [5, 6] and fake.started[-1][3]["WORLD_SIZE"] == "8"
    for ranks in ([], [8], [1, 1], [-1]):
        with pytest.raises(ValueError):
            fake.launch_ranks(ranks, 8, "pkg.train")
    with pytest.raises(ValueError, match="resources must be a dict"):
        fake.launch_replicas(1, "pkg.train", resources=["gpu"])


def test_base_partial_launch_failure_cancels_launched():
    fake = FakeExecutor(fail_on_rank=2)
    with pytest.raises(RuntimeError, match="quota exceeded at rank 2"):
        fake.launch_replicas(4, "pkg.train")
    assert fake.terminated == [0, 1]


def test_base_collect_reports_failures_and_timeouts_without_raising():
    fake = FakeExecutor()
    handles = fake.launch_replicas(3, "pkg.train")
    fake.codes[0], fake.codes[1] = 0, 4  # rank 2 never finishes
    t0 = time.monotonic()
    result = fake.collect(handles, timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5
    assert result is handles
    assert [h.status for h in result] == [
        ReplicaStatus.SUCCEEDED,
        ReplicaStatus.FAILED,
        ReplicaStatus.FAILED,
    ]
    assert result[1].error == "exit code 4; last log lines:\n" + "".join(
        f"line {i}\n" for i in range(10, 30)
    ).rstrip("\n")
    assert result[2].error.startswith("timeout after 0.3s; last log lines:\nline 10")
    assert fake.terminated == [2]
    assert all(h.end_time is not None for h in result[1:])
    with pytest.raises(ValueError, match="timeout"):
        fake.collect(handles, timeout=-1)


def test_base_collect_ctrl_c_cancels_then_reraises(ctrl_c: None) -> None:
    fake = FakeExecutor()
    handles = fake.launch_replicas(2, "pkg.train")
    fake.codes[0] = 0
    timer = threading.Timer(0.1, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        fake.collect(handles, timeout=30)
    timer.join()
    assert [h.status for h in handles] == [ReplicaStatus.SUCCEEDED, ReplicaStatus.CANCELLED]
    assert fake.terminated == [1]


def test_every_executor_in_this_package_satisfies_the_protocol():
    from composer_replication.executors.local import LocalProcessExecutor
    from composer_replication.executors.multi import MultiExecutor

    local = LocalProcessExecutor()
    for obj in (local, MultiExecutor({local: 1}), FakeExecutor()):
        assert isinstance(obj, ServerlessExecutor)
        assert isinstance(obj.backend, str)


def test_handle_fields_match_the_contract():
    h = ReplicaHandle(replica_id=0, backend="x", job_id="j", status=ReplicaStatus.PENDING)
    expected: dict[str, Any] = {
        "replica_id": 0,
        "backend": "x",
        "job_id": "j",
        "status": ReplicaStatus.PENDING,
        "exit_code": None,
        "start_time": None,
        "end_time": None,
        "log_location": None,
        "restarts": 0,
        "error": None,
    }
    assert vars(h) == expected
