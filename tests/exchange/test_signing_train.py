"""`[security] sign = true` through the run: the driver's keys and signatures (run/security.py),
what a replica accepts, and `composer-replication train` end to end with signing on, robust
aggregation and token weighting (2 local replicas, file://)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from composer_replication.config import from_dict
from composer_replication.config.schema import RunConfig
from composer_replication.exchange.signing import (
    DRIVER_KEY_ENV,
    KEY_ENV,
    KEYS_KEY,
    SignatureError,
    rank_identity,
)
from composer_replication.exchange.store import ObjectStore
from composer_replication.run.folder import RunFolder
from composer_replication.run.security import (
    CONFIG_SIGNATURE_KEY,
    KEYS_FILE,
    participant_keys,
    prepare_signing,
)


def _signed_run(tmp_path: Path):
    config = from_dict(RunConfig, {"security": {"sign": True}, "backend": {"n_replicas": 3}})
    folder = RunFolder.at(tmp_path / "run")
    folder.root.mkdir()
    store = ObjectStore(str(tmp_path / "store"))
    doc = json.loads(json.dumps({"some": "config", "n": 3}))
    store.put_json("run_config.json", doc)
    return config, folder, store, doc, prepare_signing(config, folder, store, doc)


def test_driver_keeps_keys_private_and_hands_each_rank_only_its_own(tmp_path):
    config, folder, store, doc, secrets = _signed_run(tmp_path)
    path = folder.root / KEYS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not any("private" in n for n in os.listdir(tmp_path / "store"))
    per_rank = secrets.per_rank(3)
    assert len({v[KEY_ENV] for v in per_rank.values()}) == 3
    assert set(secrets.env) == {DRIVER_KEY_ENV}  # the shared env holds no private key
    manifest = store.get_json(KEYS_KEY)
    assert set(manifest["public_keys"]) == {"driver", "synchronizer", "rank-0", "rank-1", "rank-2"}
    assert all(v[KEY_ENV] not in json.dumps(manifest) for v in per_rank.values())
    # a resumed driver reuses the keys and the manifest
    again = prepare_signing(config, folder, store, doc)
    assert again.run_id == secrets.run_id and again.per_rank(3) == per_rank


def test_replica_accepts_only_the_configuration_the_driver_signed(tmp_path):
    _, _, store, doc, secrets = _signed_run(tmp_path)
    env = {**secrets.env, **secrets.per_rank(3)[1]}
    keys = participant_keys(store, rank_identity(1), doc, required=True, environ=env)
    assert keys.identity == "rank-1" and keys.run_id == secrets.run_id
    tampered = {**doc, "n": 1}  # e.g. someone rewrote run_config.json to switch signing off
    with pytest.raises(SignatureError, match="not the configuration the driver signed"):
        participant_keys(store, rank_identity(1), tampered, required=False, environ=env)
    with pytest.raises(ValueError, match="does not match its public key"):  # rank 2's key
        participant_keys(
            store,
            rank_identity(1),
            doc,
            required=True,
            environ={**secrets.env, **secrets.per_rank(3)[2]},
        )
    with pytest.raises(ValueError, match="got no private key"):
        participant_keys(store, rank_identity(1), doc, required=True, environ=secrets.env)
    with pytest.raises(ValueError, match="sign = true but"):
        participant_keys(store, rank_identity(1), doc, required=True, environ={})
    assert participant_keys(store, rank_identity(1), doc, required=False, environ={}) is None
    store.put_json(CONFIG_SIGNATURE_KEY, {"kind": "run_config", "sha256": "0" * 64})
    with pytest.raises(SignatureError, match="run configuration signature is not signed"):
        participant_keys(store, rank_identity(1), doc, required=True, environ=env)


@pytest.mark.long
@pytest.mark.slow
def test_train_with_signing_robust_aggregation_and_token_weighting(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(Path(__file__).parents[1] / "run"))
    from test_run_train_e2e import SMALL

    from composer_replication.cli import main
    from composer_replication.run.metrics import read_metrics

    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "train",
            *SMALL,
            "train.max_steps=4",
            "diloco.sync_every_h=2",
            "security.sign=true",
            "diloco.aggregate=norm_clip",
            "diloco.weighting=tokens",
            "--name",
            "signed",
        ]
    )
    run = tmp_path / "runs" / "signed"
    out = capsys.readouterr().out
    assert code == 0, out + "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    store = ObjectStore(str(run / "store"))
    commit = store.get_json("steps/0000000002/commit.json")
    assert commit["signer"].startswith("rank-") and commit["aggregate"] == "norm_clip"
    assert commit["weighting"] == "tokens" and commit["included_ranks"] == [0, 1]
    assert all(t > 0 for t in commit["tokens"].values())  # real claims, within the bounds
    records = read_metrics(run / "metrics.jsonl")
    rounds = [r for r in records if r["kind"] == "round"]
    assert len(rounds) == 4 and all(r["round/rejected"] == 0 for r in rounds)
    assert all(r["round/requests_list"] == 0 for r in rounds)  # no LIST in a sync round
    assert all(r["round/requests_put"] >= 1 for r in rounds)  # signed: no owner record
    # each replica's per-round resume states are signed by its own rank (diloco/replica_state.py)
    from composer_replication.diloco.replica_state import replica_state_rounds

    for rank in (0, 1):
        rounds_saved = replica_state_rounds(store, rank)
        assert rounds_saved, f"rank {rank} saved no resume state"
        for rnd in rounds_saved:
            manifest = store.get_json(f"resume/rank-{rank}/{rnd:010d}.json")
            assert manifest["signer"] == f"rank-{rank}" and manifest["signature"], manifest
    keys = (run / KEYS_FILE).read_text()
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    private = json.loads(keys)["private"]
    assert not any(v in logs or v in json.dumps(records) for v in private.values())
