"""Per-rank writer secrets of unsigned runs (run/security.py): created once per run folder,
reused on resume, one per rank, read back by the replica from its environment."""

from __future__ import annotations

import stat

import pytest

from composer_replication.run.folder import RunFolder
from composer_replication.run.security import (
    SLOT_SECRET_ENV,
    WRITER_SECRET_ENV,
    WRITER_SECRETS_FILE,
    slot_secret,
    slot_secret_from_env,
    writer_secret_from_env,
    writer_secrets,
)


def test_secrets_are_per_rank_private_and_reused_on_resume(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.create(overwrite=False)
    first = writer_secrets(folder, 2)
    assert sorted(first) == [0, 1] and first[0] != first[1]
    assert all(len(bytes.fromhex(s[WRITER_SECRET_ENV])) == 32 for s in first.values())
    path = folder.root / WRITER_SECRETS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = writer_secrets(folder, 3)  # a resumed run (one more rank) keeps ranks 0 and 1's
    assert again[0] == first[0] and again[1] == first[1] and again[2] not in first.values()
    secret = writer_secret_from_env({WRITER_SECRET_ENV: first[1][WRITER_SECRET_ENV]})
    assert secret == bytes.fromhex(first[1][WRITER_SECRET_ENV])


def test_env_without_a_secret_or_with_a_bad_one(tmp_path):
    assert writer_secret_from_env({}) is None
    with pytest.raises(ValueError, match=WRITER_SECRET_ENV):
        writer_secret_from_env({WRITER_SECRET_ENV: "not-hex"})
    with pytest.raises(ValueError, match="32 hex digits"):
        writer_secret_from_env({WRITER_SECRET_ENV: "abcd"})


def test_the_slot_secret_is_one_per_run_reused_on_resume_and_kept_with_the_writer_secrets(
    tmp_path,
):
    folder = RunFolder(tmp_path / "run")
    folder.create(overwrite=False)
    ranks = writer_secrets(folder, 2)
    slot = slot_secret(folder)
    assert set(slot) == {SLOT_SECRET_ENV} and len(bytes.fromhex(slot[SLOT_SECRET_ENV])) == 32
    assert slot_secret(folder) == slot and writer_secrets(folder, 2) == ranks  # reused
    assert slot[SLOT_SECRET_ENV] not in {s[WRITER_SECRET_ENV] for s in ranks.values()}
    assert slot_secret_from_env(slot) == bytes.fromhex(slot[SLOT_SECRET_ENV])
    assert slot_secret_from_env({}) is None
    with pytest.raises(ValueError, match=SLOT_SECRET_ENV):
        slot_secret_from_env({SLOT_SECRET_ENV: "abcd"})
