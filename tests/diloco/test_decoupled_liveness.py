"""Heartbeats and the run-level health state (exchange/liveness.py): the format, the
alive/stale/dead/done judgement against the reader's clock, invalid documents, the
healthy/degraded/critical rules, and a real process that is stopped (SIGSTOP), resumed and
killed while it heartbeats."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from composer_replication.exchange.liveness import (
    MemberLiveness,
    heartbeat_key,
    read_liveness,
    run_health,
    write_heartbeat,
)
from composer_replication.exchange.store import ObjectStore


@pytest.fixture(
    params=["file", pytest.param("seaweedfs_server", marks=[pytest.mark.server, pytest.mark.slow])]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return ObjectStore(str(tmp_path / "store"))
    _, bucket, options = request.getfixturevalue(request.param)
    return ObjectStore(f"s3://{bucket}/live-{uuid.uuid4().hex}", options)


def test_heartbeat_document_and_ages_against_the_readers_clock(store: ObjectStore) -> None:
    hb = write_heartbeat(store, "learner", 0, now=1000.0, step=12, versions=[3, 4])
    doc = store.get_json("health/learner/0.json")
    assert doc["format"] == 1 and doc["kind"] == "heartbeat" and doc["state"] == "running"
    assert doc["fields"] == {"step": 12, "versions": [3, 4]} and doc["pid"] == os.getpid()
    assert hb.fields["step"] == 12 and hb.time == 1000.0
    write_heartbeat(store, "learner", 1, now=980.0)
    write_heartbeat(store, "learner", 2, now=800.0)
    write_heartbeat(store, "learner", 3, now=100.0, state="done")  # finished long ago
    write_heartbeat(store, "synchronizer", "main", now=1010.0)  # clock ahead of the reader's
    live = read_liveness(store, now=1005.0, stale_after_s=10, dead_after_s=100)
    got = {k: (m.status, m.age_s) for k, m in live.items()}
    assert got == {
        "learner/0": ("alive", 5.0),
        "learner/1": ("stale", 25.0),
        "learner/2": ("dead", 205.0),
        "learner/3": ("done", 905.0),
        "synchronizer/main": ("alive", 0.0),
    }
    only = read_liveness(store, now=1005.0, roles=["synchronizer"])
    assert list(only) == ["synchronizer/main"]


def test_invalid_heartbeats_make_their_member_dead_with_the_reason(store: ObjectStore) -> None:
    store.put("health/learner/0.json", b"\x80 not json")
    store.put_json(
        "health/learner/1.json",
        {
            "format": 1,
            "kind": "heartbeat",
            "role": "learner",
            "id": "7",
            "time": 1.0,
            "state": "running",
        },
    )
    store.put_json(
        "health/learner/2.json",
        {
            "format": 1,
            "kind": "heartbeat",
            "role": "learner",
            "id": "2",
            "time": float("nan"),
            "state": "x",
        },
    )
    live = read_liveness(store, now=10.0)
    assert {k: m.status for k, m in live.items()} == dict.fromkeys(
        ["learner/0", "learner/1", "learner/2"], "dead"
    )
    assert "is not a JSON document" in (live["learner/0"].error or "")
    assert "not its key's" in (live["learner/1"].error or "")
    assert "not a finite number" in (live["learner/2"].error or "")


def test_bad_arguments_are_refused_with_the_reason(store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="role '../x'"):
        heartbeat_key("../x", 0)
    with pytest.raises(ValueError, match="state must be one of"):
        write_heartbeat(store, "learner", 0, state="sleeping")
    with pytest.raises(ValueError, match="JSON-serialisable"):
        write_heartbeat(store, "learner", 0, thing=object())
    with pytest.raises(ValueError, match="stale_after_s < dead_after_s"):
        read_liveness(store, stale_after_s=10, dead_after_s=5)


def _m(role: str, i: str, status: str) -> MemberLiveness:
    return MemberLiveness(role, i, status, 0.0, None)  # type: ignore[arg-type]


def _health(statuses: dict[str, str], sync: str | None = "alive", **kw: int):
    members = {f"learner/{i}": _m("learner", i, s) for i, s in statuses.items()}
    if sync is not None:
        members["synchronizer/main"] = _m("synchronizer", "main", sync)
    return run_health(members, worker_role="learner", synchronizer_role="synchronizer", **kw)


def test_run_health_rules() -> None:
    four = {"0": "alive", "1": "alive", "2": "alive", "3": "alive"}
    assert _health(four, n_workers=4, quorum=2).state == "healthy"
    h = _health({**four, "3": "stale"}, n_workers=4, quorum=2)
    assert h.state == "degraded" and h.reasons == ["learner 3 is stale"]
    h = _health({"0": "alive", "1": "dead", "2": "stale"}, n_workers=4, quorum=2)
    assert h.state == "critical" and h.alive_workers == 1
    assert h.reasons[0].startswith("1 of 4 unfinished learners alive, fewer than the quorum of 2")
    assert "learner 3 is missing" in h.reasons  # never wrote a heartbeat
    # finished workers are not expected any more: the quorum shrinks to what is left
    h = _health({"0": "done", "1": "done", "2": "done", "3": "alive"}, n_workers=4, quorum=2)
    assert h.state == "healthy"
    assert _health(dict.fromkeys("0123", "done"), sync="dead", n_workers=4, quorum=4).state == (
        "healthy"
    )
    # the synchronizer: stale = degraded, dead or never started = critical
    assert _health(four, sync="stale", n_workers=4, quorum=2).state == "degraded"
    h = _health(four, sync="dead", n_workers=4, quorum=2)
    assert h.state == "critical" and "no synchronizer alive (main: dead)" in h.reasons[0]
    h = _health(four, sync=None, n_workers=4, quorum=2)
    assert h.state == "critical" and "none ever started" in h.reasons[0]
    h = _health(four, n_workers=4, quorum=2, rejections=2)
    assert h.state == "degraded" and h.reasons == ["2 contribution(s) rejected"]
    with pytest.raises(ValueError, match="quorum"):
        _health(four, n_workers=4, quorum=5)


def test_members_not_heard_from_yet_are_starting_during_start_up() -> None:
    """In the caller's start-up window a member with no heartbeat yet is starting: the run is
    'starting', not 'critical'; a member that did beat and died still counts, and after the
    window (starting=False) the same store reads critical as before."""
    two_up = {"0": "alive", "1": "alive"}
    h = _health({}, sync=None, n_workers=2, quorum=2, starting=True)
    assert h.state == "starting" and h.alive_workers == 0
    assert h.reasons == [
        "0 of 2 learners up; waiting for the first heartbeat of learner 0, 1 and the synchronizer"
    ]
    h = _health({"0": "alive"}, n_workers=2, quorum=2, starting=True)
    assert h.state == "starting" and "waiting for the first heartbeat of learner 1" in h.reasons[0]
    assert _health(two_up, sync=None, n_workers=2, quorum=2, starting=True).state == "starting"
    assert _health(two_up, n_workers=2, quorum=2, starting=True).state == "healthy"
    h = _health({"0": "dead"}, n_workers=2, quorum=2, starting=True)  # beat once, then died
    assert h.state == "critical" and "learner 0 is dead" in h.reasons
    h = _health({"0": "alive", "1": "stale"}, n_workers=2, quorum=1, starting=True)
    assert h.state == "degraded" and h.reasons == ["learner 1 is stale"]
    assert _health({"0": "alive"}, n_workers=2, quorum=2).state == "critical"
    assert _health({}, sync=None, n_workers=2, quorum=2).state == "critical"


_BEATER = textwrap.dedent(
    """
    import sys, time
    from composer_replication.exchange.store import ObjectStore
    from composer_replication.exchange.liveness import write_heartbeat
    store = ObjectStore(sys.argv[1])
    i = 0
    while True:
        write_heartbeat(store, "learner", 0, step=i)
        i += 1
        time.sleep(0.1)
    """
)


def _status(store: ObjectStore) -> str:
    member = read_liveness(store, stale_after_s=1.0, dead_after_s=4.0).get("learner/0")
    return "missing" if member is None else member.status


def _wait_for(store: ObjectStore, want: str, timeout: float) -> float:
    t0 = time.monotonic()
    while _status(store) != want:
        assert time.monotonic() - t0 < timeout, f"never became {want} (is {_status(store)})"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_stopped_process_goes_stale_then_dead_and_comes_back(tmp_path: Path) -> None:
    """SIGSTOP / SIGCONT / SIGKILL a real heartbeating process."""
    store = ObjectStore(str(tmp_path / "store"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _BEATER, store.uri], env=env)
    try:
        _wait_for(store, "alive", 60)
        os.kill(proc.pid, signal.SIGSTOP)
        assert _wait_for(store, "stale", 10) < 10
        _wait_for(store, "dead", 15)
        os.kill(proc.pid, signal.SIGCONT)
        _wait_for(store, "alive", 10)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        _wait_for(store, "dead", 15)
    finally:
        proc.kill()
        proc.wait(10)
