"""The chaos harness against real decoupled runs: learner processes under LocalProcessExecutor
(restarted after a kill), the real synchronizer module in its own process, faults injected with
signals and bytes (run/chaos.py), on file:// and on SeaweedFS (S3). After every run the store
must show: the run finished, no committed merge lost or applied twice, restarted learners
rejoined from the newest global, every learner holds the same final global fragments."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from composer_replication.config import from_dict, to_dict
from composer_replication.config.schema import (
    BackendConfig,
    ChaosEventConfig,
    DilocoConfig,
    RunConfig,
    StoreConfig,
    TrainConfig,
)
from composer_replication.exchange.store import ObjectStore
from composer_replication.models.model_config import ModelConfig
from composer_replication.run.chaos import (
    ChaosInjector,
    ThrottleProxy,
    check_decoupled_run,
    corrupt_object,
    run_local,
)

WORKER = str(Path(__file__).with_name("_chaos_learner.py"))
ROOT = str(Path(__file__).resolve().parents[2])


def _run_config(n: int, steps: int, h: int, p: int, quorum: int) -> RunConfig:
    return RunConfig(
        train=TrainConfig(max_steps=steps),
        model=ModelConfig(num_layers=p),  # the toy learner has one block per fragment
        diloco=from_dict(
            DilocoConfig,
            dict(
                sync_every_h=h,
                mode="decoupled",
                fragments=p,
                quorum=quorum,
                lease_ttl_s=2.0,
                late="carry",
            ),
        ),
        backend=BackendConfig(n_replicas=n),
        store=StoreConfig(keep_rounds=10_000),
    )


def run_chaos(
    tmp: Path,
    uri: str,
    options: dict[str, Any],
    events: list[ChaosEventConfig],
    *,
    n: int = 3,
    steps: int = 160,
    h: int = 8,
    p: int = 4,
    width: int = 8,
    step_s: float = 0.05,
    quorum: int = 2,
    proxy: ThrottleProxy | None = None,
) -> dict[str, Any]:
    """Run n learners + the synchronizer with ``events`` (times after every learner pushed)."""
    store = ObjectStore(uri, options)
    store.put_json("run_config.json", to_dict(_run_config(n, steps, h, p, quorum)))
    out = tmp / "out"
    out.mkdir(parents=True, exist_ok=True)
    learner_options = dict(options)
    if proxy is not None:
        learner_options["endpoint_url"] = proxy.endpoint
    env = {"PYTHONPATH": ROOT, "COMPOSER_STORAGE_OPTIONS": json.dumps(learner_options)}
    args = [
        "--uri",
        uri,
        "--storage-options",
        json.dumps(learner_options),
        "--n",
        n,
        "--steps",
        steps,
        "--h",
        h,
        "--p",
        p,
        "--width",
        width,
        "--step-s",
        step_s,
        "--out",
        out,
    ]
    # the schedule starts once every learner trains (has pushed at least once)
    result = run_local(
        n=n,
        entrypoint=WORKER,
        args=args,
        env=env,
        store=store,
        events=events,
        log_dir=tmp / "logs",
        synchronizer=True,
        proxy=proxy,
        timeout_s=480,
        ready=lambda: all(store.exists(f"decoupled/learners/{r:05d}.json") for r in range(n)),
    )
    assert result.exit_codes == [0] * n, result.logs
    assert result.synchronizer_exit == 0, result.logs
    reports = {r: json.loads((out / f"learner{r}.json").read_text()) for r in range(n)}
    kills = [e for e in result.log if e["action"] == "kill"]
    check = check_decoupled_run(store, reports, kills)
    final = store.get_json("decoupled/final.json")
    return {
        "check": check,
        "log": result.log,
        "reports": reports,
        "final": final,
        "restarts": result.restarts,
        "sync_restarts": result.synchronizer_restarts,
    }


def _entries(result: dict, action: str) -> list[dict]:
    return [e for e in result["log"] if e["action"] == action]


@pytest.fixture(params=["file", pytest.param("seaweedfs_server", marks=pytest.mark.server)])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "file":
        return (tmp_path / "store").as_uri(), {}
    _, bucket, options = request.getfixturevalue(request.param)
    return f"s3://{bucket}/chaos-{uuid.uuid4().hex}", dict(options)


@pytest.mark.slow
@pytest.mark.heavy
def test_kill_mid_step_stop_and_slow_learners(tmp_path: Path, where: tuple[str, dict]) -> None:
    """kill -9 mid inner step (restarted by the executor), SIGSTOP for 2x the round time
    (H = 8 steps of 0.05 s), a learner 3x slower for 3 s."""
    round_s = 8 * 0.05
    events = [
        ChaosEventConfig(at_s=0.5, action="kill", target="0"),
        ChaosEventConfig(at_s=1.0, action="stop", target="1", duration_s=2 * round_s),
        ChaosEventConfig(at_s=2.0, action="slow", target="2", factor=3.0, duration_s=3.0),
    ]
    r = run_chaos(tmp_path, *where, events)
    assert r["check"]["ok"], r["check"]
    assert r["restarts"][0] >= 1  # the killed learner came back and rejoined
    assert r["check"]["rejoined"] and r["check"]["applied_twice"] == 0
    assert {e["outcome"] for e in _entries(r, "stop")} == {"stopped", "continued"}
    assert {e["outcome"] for e in _entries(r, "slow")} == {"slowed", "full speed"}
    assert r["final"]["learners"] == {"0": 160, "1": 160, "2": 160}


@pytest.mark.slow
@pytest.mark.heavy
def test_kill_mid_upload_corrupt_objects_and_restart_the_synchronizer(
    tmp_path: Path, where: tuple[str, dict]
) -> None:
    """kill -9 while a learner is frozen half-way through writing a push (wide model: 1 MiB
    per fragment), a corrupted push (refused, never merged), a corrupted global fragment
    (learners skip it; the final state is verified), kill -9 the synchronizer (restarted after
    1 s, it waits for the 2 s lease, then resumes from the store)."""
    uri, options = where
    proxy = None
    if not uri.startswith("file:"):
        proxy = ThrottleProxy(options["endpoint_url"])  # how an S3 upload is caught mid-way
    events = [
        ChaosEventConfig(at_s=0.5, action="kill", target="1", during="upload"),
        ChaosEventConfig(at_s=1.0, action="corrupt", target="push:2"),
        ChaosEventConfig(at_s=2.0, action="corrupt", target="global"),
        ChaosEventConfig(at_s=3.0, action="kill_synchronizer", restart_after_s=1.0),
    ]
    try:
        r = run_chaos(tmp_path, uri, options, events, width=512, steps=120, proxy=proxy)
    finally:
        if proxy is not None:
            proxy.close()
    assert r["check"]["ok"], r["check"]
    (kill,) = _entries(r, "kill")
    assert kill["outcome"] == "killed mid-upload", kill
    assert r["restarts"][1] >= 1 and r["sync_restarts"] == 1
    corrupt = {e["target"]: e for e in _entries(r, "corrupt")}
    assert corrupt["push:2"]["outcome"] == "corrupted"
    assert corrupt["global"]["outcome"] == "corrupted"
    # the corrupted push was refused by the synchronizer that saw it, and never merged
    name = corrupt["push:2"]["key"].rsplit("/", 1)[-1]
    store = ObjectStore(uri, options)
    merged = set()
    for f in range(4):
        for v in range(1, r["final"]["versions"][f] + 1):
            rec = store.get_json(f"decoupled/f{f:03d}/merge/{v:010d}.json")
            merged |= {e["push"] for e in rec["inputs"]}
    assert name not in merged
    # the damaged global snapshot was either repaired by the synchronizer (the restarted one
    # replays the records after the oldest push it finds and rewrites a snapshot that does not
    # decode; or it was the final version, verified at the end) or noticed by the check as a
    # superseded version (its merge lives on in the later versions); which one depends on
    # timing. Either way no committed round was lost.
    repaired = int((r["final"].get("stats") or {}).get("repaired_states", 0))
    noticed = any(d.startswith("fragment 0 version ") for d in r["check"]["damaged_snapshots"])
    assert repaired >= 1 or noticed, (r["final"].get("stats"), r["check"]["damaged_snapshots"])
    assert r["check"]["rounds_lost"] == 0


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.server
def test_throttled_store_and_kill_mid_upload_through_the_proxy(
    tmp_path: Path, seaweedfs_server: tuple[str, str, dict]
) -> None:
    """The S3 endpoint throttled to 200 kB/s for 4 s (learners keep training; pushes queue and
    newer ones replace older ones), then a learner killed half-way through a PUT."""
    _, bucket, options = seaweedfs_server
    proxy = ThrottleProxy(options["endpoint_url"])
    events = [
        ChaosEventConfig(at_s=0.5, action="throttle", duration_s=4.0, rate_bytes_s=2e5),
        ChaosEventConfig(at_s=1.0, action="kill", target="0", during="upload"),
    ]
    try:
        r = run_chaos(
            tmp_path,
            f"s3://{bucket}/chaos-{uuid.uuid4().hex}",
            dict(options),
            events,
            width=256,
            steps=120,
            proxy=proxy,
        )
    finally:
        proxy.close()
    assert r["check"]["ok"], r["check"]
    (kill,) = _entries(r, "kill")
    assert kill["outcome"] == "killed mid-upload" and "decoupled/push/" in kill["upload"], kill
    assert [e["outcome"] for e in _entries(r, "throttle")] == ["throttled", "full speed"]


def test_a_corrupted_push_no_longer_decodes(tmp_path: Path) -> None:
    """corrupt_object flips bytes in the middle of an object: a push then fails its checksum."""
    import torch

    from composer_replication.exchange.push_store import DecoupledStore

    store = ObjectStore(str(tmp_path / "s"))
    docs = DecoupledStore(store)
    pid, _ = docs.push(
        {"w": torch.randn(1000)},
        fragment=0,
        base=0,
        learner=0,
        seq=0,
        steps=1,
        tokens=None,
        steps_since_push=1,
        step_seconds=0.1,
        learner_step=1,
    )
    assert corrupt_object(store, pid.key)
    got, _ = docs.fetch_push(pid, {"w": ([1000], "float32")})
    assert isinstance(got, str) and "checksum mismatch" in got
    assert not corrupt_object(store, "decoupled/push/absent")


def test_the_harness_refuses_throttle_without_a_proxy(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ThrottleProxy"):
        ChaosInjector(
            [ChaosEventConfig(action="throttle", duration_s=1)],
            None,  # type: ignore[arg-type]
            ObjectStore(str(tmp_path)),
        )


def test_chaos_configuration_is_checked() -> None:
    from composer_replication.config import load_config

    kill = ["chaos.events=[{action='kill', target='1', at_s=1.0}]"]
    with pytest.raises(ValueError, match="backend.max_restarts"):
        load_config(None, [*kill, "backend.max_restarts=0", "diloco.min_replicas=2"])
    assert load_config(None, kill).chaos.events[0].target == "1"  # default: 2 restarts
    # an elastic sync run may lose the replica for good (the others go on without it)
    lost = load_config(None, [*kill, "backend.max_restarts=0", "diloco.min_replicas=1"])
    assert lost.chaos.events[0].target == "1"
    with pytest.raises(ValueError, match="min_replicas"):
        load_config(None, [*kill, "backend.max_restarts=0", "diloco.min_replicas=2"])
    assert (
        load_config(None, [*kill, "backend.max_restarts=0", "backend.options={max_restarts=1}"])
        .chaos.events[0]
        .target
        == "1"
    )
    with pytest.raises(ValueError, match="not a replica rank"):
        load_config(None, ["chaos.events=[{action='stop', target='7', duration_s=1.0}]"])
    with pytest.raises(ValueError, match="no connection to throttle"):
        load_config(None, ["chaos.events=[{action='throttle', duration_s=1.0}]"])
    with pytest.raises(ValueError, match="kill_synchronizer needs diloco.mode"):
        load_config(None, ["chaos.events=[{action='kill_synchronizer'}]"])
    with pytest.raises(ValueError, match="fault injection needs the local backend"):
        load_config(
            None, ["backend.kind=modal", "chaos.events=[{action='corrupt', target='push'}]"]
        )
