"""Helpers shared by the executor tests (local, Ray, Multi, and the cloud stand-ins).

The probe (replica_probe.py) is loaded from its file under its own name, without going through
sys.modules, so the module-entrypoint tests still import it fresh in their replicas.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROBE = str(HERE / "replica_probe.py")
_spec = importlib.util.spec_from_file_location("replica_probe", PROBE)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


# The replica the cloud-executor tests launch (standins/replica_script.py), as diloco_replica.py.
REPLICA_SCRIPT = HERE / "standins" / "replica_script.py"


def install_replica_script(workdir: Path) -> None:
    """Put the stand-in replica script in workdir as diloco_replica.py (the seed's name)."""
    shutil.copy(REPLICA_SCRIPT, workdir / "diloco_replica.py")


def replica_args(store: Path, **extra: Any) -> dict[str, Any]:
    """entrypoint_args for diloco_replica.py: rendezvous in store, rank in REPLICA_RANK."""
    return {"rendezvous": f"file://{store}", "rank_env": "REPLICA_RANK", **extra}


def alive(pid: int) -> bool:
    """True if pid is a live process (a zombie counts as dead: PID 1 here may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_for_records(store: str, n: int, timeout: float = 30.0) -> dict[int, dict]:
    """The probe records in store once at least n replicas wrote theirs (AssertionError after
    timeout seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = probe.read_records(store)
        if len(recs) >= n:
            return recs
        time.sleep(0.05)
    raise AssertionError(f"only {len(probe.read_records(store))} of {n} replicas wrote a record")


@contextmanager
def private_ray_executor(log_dir: Path, init_num_cpus: int) -> Iterator[Any]:
    """A RayExecutor that starts a private local Ray (no auth token file in ~) and stops it."""
    import ray

    from composer_replication.executors.ray import RayExecutor

    started_here = not ray.is_initialized()
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a private local Ray needs no token file in ~
    ex = RayExecutor(
        init_num_cpus=init_num_cpus, grace_period=1.0, poll_interval=0.05, log_dir=log_dir
    )
    ex._ensure_ray()
    yield ex
    ex.shutdown()
    if started_here:
        assert not ray.is_initialized()  # the executor started it, so it stopped it
    if old is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = old


def run_seed_driver_snippet(executor: Any, store_dir: Path, capsys: Any) -> None:
    """Run the seed docs' driver code unchanged on executor (4 replicas of diloco_replica.py,
    which the caller put in the executor's working directory) and check what it prints."""
    from composer_replication.executors.executor import ServerlessExecutor

    assert isinstance(executor, ServerlessExecutor)
    uri = f"file://{store_dir}"
    handles = executor.launch_replicas(
        n_replicas=4,
        entrypoint="diloco_replica.py",
        entrypoint_args={"rendezvous": uri, "rank_env": "REPLICA_RANK"},
    )
    result = executor.collect(handles, timeout=3600)
    print({h.replica_id: h.exit_code for h in result})
    assert capsys.readouterr().out.strip() == "{0: 0, 1: 0, 2: 0, 3: 0}"
