"""ModalExecutor with an injected fake of the modal client surface (no token, no network).

The fake runs the real `run_replica` body in local processes; a separate test binds every call
the adapter made to the installed modal package's real signatures.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import time
from pathlib import Path

import pytest

modal = pytest.importorskip("modal")

sys.path.insert(0, str(Path(__file__).parent))
from _executor_helpers import install_replica_script, run_seed_driver_snippet  # noqa: E402
from _executor_helpers import replica_args as _args  # noqa: E402
from standins.fake_modal import FakeModal  # noqa: E402

from composer_replication.executors.executor import ReplicaStatus  # noqa: E402
from composer_replication.executors.modal import (  # noqa: E402
    ModalExecutor,
    modal_credentials,
    run_replica,
)
from composer_replication.executors.redact import (  # noqa: E402
    CloudExecutorError,
    MissingCredentialsError,
)


@pytest.fixture
def fake(tmp_path: Path):
    install_replica_script(tmp_path)
    f = FakeModal(tmp_path, secrets={"wandb": {"WANDB_API_KEY": "wandb-secret-abc"}})
    yield f
    f.close()


def _make(fake: FakeModal, **kw) -> ModalExecutor:
    kw.setdefault("python", sys.executable)
    kw.setdefault("poll_interval", 0.1)
    return ModalExecutor("nvcr.io/nvidia/pytorch:24.08-py3", modal_module=fake, **kw)


def _real(name: str):
    from modal._logs_manager import FunctionCallLogsManager

    return {
        "App": modal.App.__init__,
        "App.function": modal.App.function,
        "App.run": modal.App.run,
        "Image.from_registry": modal.Image.from_registry,
        "Secret.from_name": modal.Secret.from_name,
        "CloudBucketMount": modal.CloudBucketMount.__init__,
        "Function.spawn": modal.Function.spawn,
        "Function.with_options": modal.Function.with_options,
        "FunctionCall.get": modal.FunctionCall.get,
        "FunctionCall.cancel": modal.FunctionCall.cancel,
        "FunctionCall.from_id": modal.FunctionCall.from_id,
        "FunctionCallLogsManager.tail": FunctionCallLogsManager.tail,
        "FunctionCallLogsManager.fetch": FunctionCallLogsManager.fetch,
    }[name]


def test_run_replica_body_streams_and_returns_exit_code(capsys):
    out = run_replica([sys.executable, "-c", "print('a'); import sys; sys.exit(4)"], {"X": "1"})
    assert out == {"exit_code": 4, "log_tail": "a\n"}
    assert capsys.readouterr().out == "a\n"


def test_launch_poll_collect_logs(fake, tmp_path):
    ex = _make(
        fake,
        gpu="H100:2",
        secrets=["wandb"],
        env={"STATIC": "s"},
        timeout=600,
        bucket_mount={
            "bucket": "my-bucket",
            "mount_path": "/store",
            "endpoint_url": "https://r2.example",
            "secret": "r2-creds",
        },
    )
    store = tmp_path / "store"
    handles = ex.launch_replicas(
        3,
        "diloco_replica.py",
        _args(store, **{"show-env": ["WANDB_API_KEY", "STATIC", "U"]}),
        env={"U": "u"},
    )
    assert [h.replica_id for h in handles] == [0, 1, 2]
    assert all(h.status is ReplicaStatus.RUNNING and h.backend == "modal" for h in handles)
    opts = dict(next(kw for name, _, kw in fake.calls if name == "App.function"))
    assert opts["gpu"] == "H100:2" and opts["timeout"] == 600 and opts["env"] == {"STATIC": "s"}
    assert [s.name for s in opts["secrets"]] == ["wandb"]
    assert opts["image"].tag == "nvcr.io/nvidia/pytorch:24.08-py3"
    mount = opts["volumes"]["/store"]
    assert mount.bucket_name == "my-bucket" and mount.secret.name == "r2-creds"
    assert fake.app_runs == ["enter"]
    spawns = [args for name, args, _ in fake.calls if name == "Function.spawn"]
    assert [a[1]["REPLICA_RANK"] for a in spawns] == ["0", "1", "2"]
    assert spawns[0][0][:2] == [sys.executable, "diloco_replica.py"]
    result = ex.collect(handles, timeout=60)
    assert {h.replica_id: h.exit_code for h in result} == {0: 0, 1: 0, 2: 0}
    assert fake.app_runs == ["enter", "exit"]  # app stopped once every replica was done
    assert all(kw == {"timeout": 0} for name, _, kw in fake.calls if name == "FunctionCall.get")
    for rank in range(3):
        rec = json.loads((store / f"rank-{rank}.json").read_text())
        assert rec["rank"] == rank and rec["world_size"] == 3
        assert rec["env"] == {"WANDB_API_KEY": "wandb-secret-abc", "STATIC": "s", "U": "u"}
    assert ex.logs(handles[2]) == "replica 2 of 3 starting\nreplica 2 done\n"
    assert ex.logs(handles[2], tail=1) == "replica 2 done\n"


def test_failing_replica_reported_with_log_tail(fake, tmp_path):
    ex = _make(fake)
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp_path / "s", **{"fail-rank": 1}))
    result = ex.collect(handles, timeout=60)
    assert result[0].status is ReplicaStatus.SUCCEEDED and result[0].exit_code == 0
    assert result[1].status is ReplicaStatus.FAILED and result[1].exit_code == 3
    assert "exited with code 3" in result[1].error and "boom: replica 1" in result[1].error


def test_cancel_mid_run_and_function_timeout(fake, tmp_path):
    ex = _make(fake)
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp_path / "s", sleep=60))
    deadline = time.monotonic() + 20
    while "starting" not in ex.logs(handles[1]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ex.cancel(handles)
    assert all(h.status is ReplicaStatus.CANCELLED for h in handles)
    cancels = [kw for name, _, kw in fake.calls if name == "FunctionCall.cancel"]
    assert cancels == [{"terminate_containers": True}] * 2
    for call in fake.spawned:
        call.container.wait(5)
        assert call.container.exit_code == 137  # the container was killed outright
    assert fake.app_runs == ["enter", "exit"]
    # Modal's own function timeout (1 s) ends a replica: FAILED with the reason.
    ex2 = _make(fake, timeout=1)
    [h] = ex2.launch_replicas(1, "diloco_replica.py", _args(tmp_path / "s2", sleep=60))
    [h] = ex2.collect([h], timeout=30)
    assert h.status is ReplicaStatus.FAILED and "1s function timeout" in h.error


def test_collect_timeout(fake, tmp_path):
    ex = _make(fake)
    handles = ex.launch_replicas(2, "diloco_replica.py", _args(tmp_path / "s", sleep=60))
    result = ex.collect(handles, timeout=1.0)
    assert all(h.status is ReplicaStatus.FAILED for h in result)
    assert all(h.error.startswith("timeout after 1s") for h in result)
    assert len([c for c in fake.calls if c[0] == "FunctionCall.cancel"]) == 2


def test_seed_driver_snippet_unchanged(fake, tmp_path, capsys):
    executor = _make(fake, gpu="A100")
    run_seed_driver_snippet(executor, tmp_path / "seed-store", capsys)


def test_partial_launch_failure_cancels_spawned_calls(fake, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    ex = _make(fake)
    fake.fail_spawn_after = 2
    with pytest.raises(CloudExecutorError, match="spawning replica 2") as info:
        ex.launch_replicas(3, "diloco_replica.py", _args(tmp_path / "s", sleep=60))
    assert len(fake.spawned) == 2 and all(c.cancelled for c in fake.spawned)
    text = f"{info.value!r}{caplog.text}"
    assert "as-fakeTokenSecret456" not in text and "ak-fakeTokenId123" not in text


def test_bad_input_and_missing_credentials(fake, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown Modal GPU 'A200'"):
        _make(fake, gpu="A200")
    with pytest.raises(ValueError, match="image"):
        ModalExecutor(None, modal_module=fake)
    ex = _make(fake)
    with pytest.raises(ValueError, match="n_replicas"):
        ex.launch_replicas(0, "diloco_replica.py")
    with pytest.raises(ValueError, match="unknown Modal GPU"):
        ex.launch_replicas(1, "diloco_replica.py", resources={"gpu": "H100:x"})
    assert fake.spawned == [] and fake.app_runs == []
    with pytest.raises(MissingCredentialsError, match="modal token new"):
        ModalExecutor("img", modal_module=FakeModal(tmp_path, token=(None, None)))
    # The same check reads Modal's real configuration: env vars are one standard place.
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fromEnvironment1")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fromEnvironment2")
    assert modal_credentials(modal) == ("ak-fromEnvironment1", "as-fromEnvironment2")


def test_every_modal_call_matches_the_installed_signatures(fake, tmp_path):
    """Bind each recorded call to the real modal callable: wrong names or arity fail here."""
    ex = _make(
        fake,
        gpu="A10G",
        secrets=["wandb"],
        add_python="3.11",
        bucket_mount={"bucket": "b", "mount_path": "/store", "secret": "wandb"},
    )
    handles = ex.launch_replicas(
        2, "diloco_replica.py", _args(tmp_path / "s"), resources={"gpu": "L4", "memory": 2048}
    )
    ex.collect(handles, timeout=60)
    ex.logs(handles[0], tail=5)
    ex.logs(handles[0])
    ex._calls.clear()  # force the reattach path (FunctionCall.from_id) once
    h = handles[0]
    h.status = ReplicaStatus.RUNNING
    ex.poll([h])
    names = {name for name, _, _ in fake.calls}
    assert names == {
        "App",
        "App.function",
        "App.run",
        "Image.from_registry",
        "Secret.from_name",
        "CloudBucketMount",
        "Function.with_options",
        "Function.spawn",
        "FunctionCall.get",
        "FunctionCall.from_id",
        "FunctionCallLogsManager.tail",
        "FunctionCallLogsManager.fetch",
    }
    ex2 = _make(fake)
    [h2] = ex2.launch_replicas(1, "diloco_replica.py", _args(tmp_path / "s3", sleep=30))
    ex2.cancel([h2])
    for name, args, kwargs in fake.calls:
        sig = inspect.signature(_real(name))
        params = list(sig.parameters)
        lead = [None] if params and params[0] in ("self", "cls") else []
        if name in ("Function.spawn",):  # spawn(*args, **kwargs) forwards to run_replica
            sig = inspect.signature(run_replica)
            lead = []
        sig.bind(*lead, *args, **kwargs)  # raises TypeError on a mismatch


def test_missing_sdk_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "modal", None)  # as if not installed
    with pytest.raises(ImportError, match=r"composer-replication\[modal\]"):
        ModalExecutor("python:3.12")
