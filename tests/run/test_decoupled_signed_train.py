"""`composer-replication train` with ``diloco.mode = "decoupled"`` and ``security.sign = true`` on
the S3 stand-in, attacked by a forger process that holds no key (tests/run/_decoupled_forger.py):
a forged push, a push re-uploaded under a later name, a forged merge record, an old merge record
replayed at a later version and a forged global state. Every one is refused with the reason as a
"rejected" event in metrics.jsonl, none is applied: the run finishes with every merge record and
state signed by the synchronizer, the store's chain intact (run/chaos.py check_decoupled_run) and
both learners on the same final weights."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_chaos_train import SMALL

from composer_replication.cli import main
from composer_replication.exchange.push_store import DecoupledStore
from composer_replication.exchange.signing import KEYS_KEY, SYNCHRONIZER, parse_key_manifest
from composer_replication.exchange.signing import public_key_of as public
from composer_replication.exchange.store import ObjectStore
from composer_replication.run.chaos import check_decoupled_run
from composer_replication.run.metrics import read_metrics
from composer_replication.run.security import KEYS_FILE

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.server]

FORGER = Path(__file__).with_name("_decoupled_forger.py")


def test_signed_decoupled_run_refuses_forged_and_replayed_objects_on_s3(
    seaweedfs_server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,  # noqa: ANN001
) -> None:
    _, bucket, options = seaweedfs_server
    monkeypatch.chdir(tmp_path)
    uri = f"s3://{bucket}/{uuid.uuid4().hex}/"
    inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    planted_path = tmp_path / "planted.json"
    forger = subprocess.Popen(
        [sys.executable, str(FORGER), uri, json.dumps(options), str(planted_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        code = main(
            [
                "train",
                *SMALL,
                "train.max_steps=80",
                "diloco.sync_every_h=4",
                "security.sign=true",
                "logging.tensorboard=false",
                f"store.uri={uri}",
                f"store.storage_options={{{inner}}}",
                "--name",
                "signed",
            ]
        )
        forger_out = forger.communicate(timeout=120)[0].decode()
    finally:
        if forger.poll() is None:
            forger.kill()
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "signed"
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((run / "logs").glob("*.log")))
    assert code == 0, out + logs
    assert forger.returncode == 0, forger_out
    planted = json.loads(planted_path.read_text())
    assert set(planted) >= {"forged_push", "forged_merge", "replayed_merge", "forged_global"}

    records = read_metrics(run / "metrics.jsonl")
    rejected = {r["object"]: r for r in records if r.get("event") == "rejected"}
    why = {what: rejected[key]["reason"] for what, key in planted.items() if key in rejected}
    assert set(why) == set(planted), (planted, rejected)
    assert "is not signed" in why["forged_push"] and rejected[planted["forged_push"]]["rank"] == 1
    if "replayed_push" in why:
        assert "do not describe this push" in why["replayed_push"]
    assert "does not verify" in why["forged_merge"]
    assert "replayed from another key" in why["replayed_merge"]
    assert "is not signed" in why["forged_global"]

    # nothing forged was applied: every record and state is the synchronizer's, the chain holds
    store = ObjectStore(uri, options)
    private = json.loads((run / KEYS_FILE).read_text())["private"]
    keys = parse_key_manifest(store.get(KEYS_KEY), public(private["driver"]))
    signed = DecoupledStore(store, keys=keys)
    for p in (0, 1):
        merges = signed.versions(p, "merge")
        assert len(merges) >= 2
        for v in merges:
            assert signed.read_merge(p, v)["signer"] == SYNCHRONIZER
    final = signed.read_final(2)
    assert final is not None
    for p, v in enumerate(final["versions"]):
        assert signed.fetch_global(p, v, None) is not None  # signed by the synchronizer
    check = check_decoupled_run(store)
    assert check["ok"], check["problems"]
    digests = {r["replica"]: r["sha256"] for r in records if r.get("event") == "global_weights"}
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1
    assert not any(v in logs or v in json.dumps(records) for v in private.values())
