"""The driver's messages say what the settings make true (issue 22, item 7): "the others go on
without waiting for it" only when `diloco.min_replicas` lets them; a failed replica's reason
without an empty "last log lines:"; `--resume runs/NAME` names runs/NAME; a resume whose every
global state is damaged says it starts over, and does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.assembly.outer import outer_loop_mode
from composer_replication.cli import main
from composer_replication.config import RunConfig, load_config
from composer_replication.exchange.store import ObjectStore
from composer_replication.executors.executor import ReplicaHandle, ReplicaStatus
from composer_replication.run import supervision
from composer_replication.run.driver import ENTRYPOINT


class _NoRestarts:
    def will_restart(self, rank: int) -> bool:
        return False


def _failed(rank: int, error: str) -> ReplicaHandle:
    return ReplicaHandle(
        replica_id=rank,
        backend="local",
        job_id=f"job-{rank}",
        status=ReplicaStatus.FAILED,
        exit_code=-9,
        error=error,
    )


def _lost_messages(tmp_path: Path, config: RunConfig) -> list[str]:
    store = ObjectStore((tmp_path / "store").as_uri() + "/")
    departures = supervision.Departures(config, outer_loop_mode(config), store)
    restarter: supervision.Restarter = _NoRestarts()  # type: ignore[assignment]
    return departures.note([_failed(1, "exit code -9; last log lines:\n")], restarter)


def test_a_lost_replica_with_every_replica_required_says_the_others_cannot_go_on(
    tmp_path: Path,
) -> None:
    required = ["backend.n_replicas=2", "diloco.min_replicas=2"]
    (message,) = _lost_messages(tmp_path, load_config(overrides=required))
    assert message.startswith(
        "replica 1 is lost (exit code -9); the others cannot go on "
        "without it: diloco.min_replicas = 2 of 2 replicas"
    )
    assert "without waiting" not in message and "last log lines" not in message
    # below the quorum the others do go on
    config = load_config(overrides=["backend.n_replicas=3", "diloco.min_replicas=2"])
    (message,) = _lost_messages(tmp_path / "q2", config)
    assert message == "replica 1 is lost (exit code -9); the others go on without waiting for it"
    # the default quorum (max(1, n - 1)) tolerates one lost replica, and says so
    (message,) = _lost_messages(
        tmp_path / "default", load_config(overrides=["backend.n_replicas=2"])
    )
    assert message == "replica 1 is lost (exit code -9); the others go on without waiting for it"


class _Relauncher:
    """A RankLauncher whose relaunched rank runs (the restart message is what is tested)."""

    backend = "local"

    def check_launch(self, n_replicas, entrypoint):  # noqa: ANN001, ANN201
        return None

    def launch_ranks(self, ranks, world_size, entrypoint, args, **kwargs):  # noqa: ANN001, ANN201
        return [
            ReplicaHandle(
                replica_id=r, backend="local", job_id=f"again-{r}", status=ReplicaStatus.RUNNING
            )
            for r in ranks
        ]

    def launch_replicas(self, *a, **k):  # noqa: ANN002, ANN003, ANN201
        raise NotImplementedError

    def poll(self, handles):  # noqa: ANN001, ANN201
        return handles

    def cancel(self, handles):  # noqa: ANN001, ANN201
        return None

    def logs(self, handle, tail=None):  # noqa: ANN001, ANN201
        return ""

    def collect(self, handles):  # noqa: ANN001, ANN201
        return handles


def test_the_restart_line_has_no_empty_log_tail() -> None:
    from composer_replication.executors.executor import RankLauncher

    executor = _Relauncher()
    assert isinstance(executor, RankLauncher)
    restarter = supervision.Restarter(load_config(), executor, ENTRYPOINT, {}, None)  # type: ignore[arg-type]
    handles = [_failed(0, "exit code -9; last log lines:\n")]
    (message,) = restarter.restart_failed(handles)
    assert (
        message == "replica 0 failed (exit code -9); restarted (1 of 2), it rejoins from the store"
    )


def test_resume_of_a_missing_run_path_names_that_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert main(["train", "--resume", "runs/nosuchrun"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: no run folder {tmp_path / 'runs' / 'nosuchrun'} " in err, err
    assert "runs/runs" not in err
    assert main(["train", "--resume", "nosuchrun"]) == 2  # a bare name: under runs/
    assert f"no run folder {tmp_path / 'runs' / 'nosuchrun'} " in capsys.readouterr().err
    assert main(["status", "runs/nosuchrun"]) == 2
    assert "runs/runs" not in capsys.readouterr().err


@pytest.mark.long
@pytest.mark.slow
def test_resume_with_every_global_state_damaged_starts_over(tmp_path: Path) -> None:
    args = [*TINY_RUN, "logging.tensorboard=false", "logging.report=false", "diloco.sync_every_h=3"]
    cli = [sys.executable, "-m", "composer_replication", "train"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.run(
        [*cli, *args, "train.max_steps=6", "--name", "wrecked"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    states = sorted((tmp_path / "runs" / "wrecked" / "store" / "states" / "global").glob("*"))
    assert [p.name for p in states] == [f"{r:010d}.safetensors" for r in range(3)]
    for path in states:  # every global state truncated, the initial weights included
        path.write_bytes(path.read_bytes()[:1000])
    again = subprocess.run(
        [*cli, "--resume", "wrecked", "train.max_steps=9"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert (
        "Starting over from outer round 0 (no later round has a usable global state" in again.stdout
    )
    assert "Resuming at outer round 0" not in again.stdout
    for r in (0, 1, 2):
        assert f"global state of round {r} is unusable" in again.stderr
