"""Run folders own their store. A run whose store is its folder's ``store/`` records
``store.uri = ""`` in config.toml/config.json (not the absolute path), so a copied or moved
folder resumes its own store and `train runs/OLD/config.toml --name NEW` starts NEW in NEW's
own store; `--overwrite` never clears a store another run owns (the store's run_owner.json, or
an older store's run_config.json, says whose it is); the read-only `--resume` message's advice
("copy the folder somewhere writable and resume the copy") does what it says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _run_small import TINY_RUN

from composer_replication.cli import main
from composer_replication.config import ConfigError, load_config
from composer_replication.exchange.store import ObjectStore
from composer_replication.run import driver
from composer_replication.run.folder import RunFolder, claim_store


def _fake_old_run(root: Path, *, owner_record: bool = True) -> RunFolder:
    """A run folder OLD whose store holds a run (its config and, now, its owner record)."""
    folder = RunFolder.at(root / "runs" / "OLD")
    folder.create()
    store = ObjectStore(str(folder.store))
    config = load_config(overrides=["run.name=OLD"])
    folder.config_json.write_text(json.dumps({"run": {"name": "OLD"}}))
    store.put_json("run_config.json", {"run": {"name": config.run.name}})
    store.put_json("steps/0000000001/commit.json", {"kind": "commit"})
    if owner_record:
        claim_store(store, folder)
    return folder


@pytest.mark.parametrize("owner_record", [True, False], ids=["owner-record", "older-store"])
def test_overwrite_never_clears_another_runs_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, owner_record: bool
) -> None:
    monkeypatch.chdir(tmp_path)
    old = _fake_old_run(tmp_path, owner_record=owner_record)
    before = sorted(p.relative_to(old.store) for p in old.store.rglob("*"))
    config = load_config(overrides=[f"store.uri={old.store}"])
    with pytest.raises(ConfigError, match="--overwrite clears only this run's own store") as err:
        driver.prepare(config, overwrite=True, name="NEW")
    assert "OLD" in str(err.value) and "Give run NEW its own store.uri" in str(err.value)
    assert sorted(p.relative_to(old.store) for p in old.store.rglob("*")) == before
    # the run that owns it may still overwrite it
    same = load_config(overrides=[f"store.uri={old.store}"])
    driver.prepare(same, overwrite=True, name="OLD")


def test_a_store_whose_run_folder_is_gone_may_be_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store_dir = tmp_path / "shared-store"
    gone = RunFolder.at(tmp_path / "runs" / "GONE")  # claimed it, then deleted
    store = ObjectStore(str(store_dir))
    store.put_json("run_config.json", {"run": {"name": "GONE"}})
    claim_store(store, gone)
    driver.prepare(load_config(overrides=[f"store.uri={store_dir}"]), overwrite=True, name="NEW")


def test_a_copy_of_an_older_folder_resumes_its_own_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder saved by an older release names its store by absolute path: its copy resumes
    the copy's store (with a note), not the original's."""
    monkeypatch.chdir(tmp_path)
    old = _fake_old_run(tmp_path)
    tree = {"run": {"name": "OLD"}, "store": {"uri": old.store.as_uri() + "/"}}
    old.config_json.write_text(json.dumps(tree))
    copy = tmp_path / "runs" / "COPY"
    shutil.copytree(old.root, copy)
    config, folder = driver.prepare_resume(str(copy), [])
    assert ObjectStore(config.store.uri).local_path == copy.resolve() / "store"
    assert folder.root == copy.resolve()


ARGS = [
    *TINY_RUN,
    "logging.tensorboard=false",
    "logging.report=false",
    "train.max_steps=4",
    "diloco.sync_every_h=4",
]


def _snapshot(path: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(path)), p.stat().st_mtime_ns) for p in path.rglob("*"))


@pytest.mark.slow
@pytest.mark.heavy
def test_copies_and_reused_configs_use_their_own_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *ARGS, "--name", "OLD"]) == 0
    old = RunFolder.at(tmp_path / "runs" / "OLD")
    assert json.loads(old.config_json.read_text())["store"]["uri"] == ""
    assert 'uri = ""' in old.config_toml.read_text()
    frozen = _snapshot(old.store)
    # the read-only message's advice, as written: copy the folder and resume the copy
    shutil.copytree(old.root, tmp_path / "elsewhere" / "COPY")
    copy = RunFolder.at(tmp_path / "elsewhere" / "COPY")
    assert main(["train", "--resume", str(copy.root), "train.max_steps=8"]) == 0
    assert ObjectStore(str(copy.store)).get_json("run_owner.json")["folder"] == str(copy.root)
    assert (copy.store / "states" / "global" / f"{2:010d}.safetensors").is_file()
    # a config.toml loaded for a new run starts that run in its own store, even --overwrite
    assert main(["train", str(old.config_toml), *ARGS[:0], "--name", "NEW", "--overwrite"]) == 0
    new = RunFolder.at(tmp_path / "runs" / "NEW")
    assert (new.store / "run_config.json").is_file()
    assert _snapshot(old.store) == frozen  # OLD's store untouched by both
    assert main(["status", str(old.root)]) == 0
    out = capsys.readouterr().out
    assert "outer round 1 " in out, out
