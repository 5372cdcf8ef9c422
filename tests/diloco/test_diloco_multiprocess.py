"""DiLoCo with real replica processes: file://, a real S3 server, a killed replica, torchft.

Every replica is a separate Python process (tests/diloco/_diloco_worker.py) that dumps its global
weights after the initial sync and after each committed round; the test compares the dumps with
each other (bit-identical) and with the independent single-process reference (1e-6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))

from _diloco_reference import named_params, reference_rounds, reference_tol  # noqa: E402

WORKER = Path(__file__).parent / "_diloco_worker.py"
pytestmark = pytest.mark.slow


def spawn(out: Path, rank: int, world: int, **kw: Any) -> subprocess.Popen:
    args = [sys.executable, str(WORKER), "--rank", str(rank), "--world-size", str(world)]
    args += ["--out", str(out)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}"] + ([str(v)] if v != "" else [])
    log = open(out / f"log_rank{rank}_{time.monotonic_ns()}.txt", "w")  # noqa: SIM115
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_all(procs: list[subprocess.Popen], out: Path, timeout: float = 150.0) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes


def logs(out: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("log_*")))


def dumped(out: Path, rank: int, k: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"rank{rank}_round{k}.safetensors"))


def check_identical_and_reference(out: Path, world: int, rounds: int, h: int) -> None:
    for k in range(rounds + 1):
        a = dumped(out, 0, k)
        for r in range(1, world):
            b = dumped(out, r, k)
            assert all(torch.equal(a[n], b[n]) for n in a), f"round {k}: rank {r} != rank 0"
    ref = reference_rounds(
        named_params(dumped(out, 0, 0)),
        ranks_per_round=[list(range(world))] * rounds,
        h=h,
        lr=0.7,
        momentum=0.9,
        nesterov=True,
    )
    init = named_params(dumped(out, 0, 0))
    for k in range(1, rounds + 1):
        got = named_params(dumped(out, 0, k))
        for name, t in got.items():
            torch.testing.assert_close(t, ref[k - 1][name], **reference_tol(init, k, world))


def test_three_replica_processes_over_file_match_reference(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    uri = "file://" + str(tmp_path / "run")
    procs = [spawn(out, r, 3, uri=uri, rounds=3, h=4) for r in range(3)]
    assert wait_all(procs, out) == [0, 0, 0], logs(out)
    check_identical_and_reference(out, 3, 3, 4)


@pytest.mark.server
def test_two_replica_processes_over_real_s3_match_reference(
    tmp_path: Path, seaweedfs_server: tuple[str, str, dict[str, Any]]
) -> None:
    _endpoint, bucket, options = seaweedfs_server
    out = tmp_path / "out"
    out.mkdir()
    uri = f"s3://{bucket}/{uuid.uuid4().hex}/"
    opts = json.dumps(options)
    procs = [spawn(out, r, 2, uri=uri, storage_options=opts, rounds=2, h=3) for r in range(2)]
    assert wait_all(procs, out) == [0, 0], logs(out)
    check_identical_and_reference(out, 2, 2, 3)


def test_killed_replica_is_left_out_then_rejoins_from_the_store(tmp_path: Path) -> None:
    """Rank 2 dies mid-round 1; ranks 0-1 commit without it; restarted, it rejoins and ends equal."""
    from composer_replication.exchange import ObjectStoreAllReduce

    out = tmp_path / "out"
    out.mkdir()
    uri = "file://" + str(tmp_path / "run")
    # Every replica stops at the first committed round >= 4 that includes all three ranks, so
    # the survivors cannot finish before the restarted replica is back in.
    common = dict(uri=uri, rounds=4, h=4, min_replicas=2, timeout=2.0, until_all_included="")
    procs = [spawn(out, r, 3, **common) for r in range(2)]
    victim = spawn(out, 2, 3, exit_at="1,2", **common)
    assert victim.wait(timeout=120) == 3, logs(out)
    observer = ObjectStoreAllReduce(uri, world_size=3)
    deadline = time.monotonic() + 90
    while (observer.latest_committed_step() or 0) < 2:  # the others went on without it
        assert time.monotonic() < deadline, logs(out)
        assert all(p.poll() is None for p in procs), logs(out)
        time.sleep(0.1)
    restarted = spawn(out, 2, 3, **common)
    assert wait_all([*procs, restarted], out) == [0, 0, 0], logs(out)

    history = json.loads((out / "rank0_history.json").read_text())
    committed = [h for h in history if h["committed"]]
    assert committed[1]["included_ranks"] == [0, 1], history  # round 2: left out
    assert committed[-1]["included_ranks"] == [0, 1, 2], history  # rejoined
    final_round = committed[-1]["round"]
    final = [dumped(out, r, final_round) for r in range(3)]
    for r in (1, 2):
        assert all(torch.equal(final[0][n], final[r][n]) for n in final[0]), f"rank {r} differs"


def test_real_torchft_manager_two_processes_identical_after_each_round(tmp_path: Path) -> None:
    from composer_replication.diloco.torchft.torchft_path import (
        TorchFTTimeouts,
        lighthouse_address,
        start_lighthouse,
    )

    timeouts = TorchFTTimeouts(
        process_group_s=20, operation_s=30, join_s=40, quorum_s=120, heartbeat_s=5
    )
    lighthouse = start_lighthouse(2, timeouts=timeouts)
    try:
        out = tmp_path / "out"
        out.mkdir()
        addr = lighthouse_address(lighthouse)
        procs = [
            spawn(out, r, 2, mode="torchft", lighthouse=addr, rounds=3, h=4, init_seed=7)
            for r in range(2)
        ]
        assert wait_all(procs, out) == [0, 0], logs(out)
    finally:
        lighthouse.shutdown()
    check_identical_and_reference(out, 2, 3, 4)
    # init_sync: the first quorum healed one replica from the other (TorchFTManager saw it and
    # ran the heal hook), and its pseudo-gradient still counted: the reference above averages
    # both replicas in every round
    history = [json.loads((out / f"rank{r}_history.json").read_text()) for r in range(2)]
    assert sorted(sum(h["healed"] for h in hist) for hist in history) == [0, 1], history
    for hist in history:
        done = [h for h in hist if not h["healed"]]
        assert [h["round"] for h in done] == [1, 2, 3] and all(h["committed"] for h in done)
        assert all(h["participants"] == 2 for h in done)
