"""Values and places a run cannot use are refused before anything starts (issue 22, item 5):
every float setting refuses inf, -inf and nan with its key named (`train`, `config validate`,
`--resume` alike); `config validate` checks a backend's required options (SageMaker's image);
`--resume` into a read-only run folder is one line and exit 2, not a traceback."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from composer_replication.cli import main
from composer_replication.config import ConfigError, RunConfig, load_config, to_dict
from composer_replication.config.loader import section_keys


def _float_keys() -> list[tuple[str, bool]]:
    """(section.key, is a list) of every float setting of the schema's sections."""
    out = []
    for section in dataclasses.fields(RunConfig):
        cls = typing.get_type_hints(RunConfig)[section.name]
        for name, key in section_keys(cls).items():  # a component's keys, flat
            tp = typing.get_type_hints(key.owner)[name]
            args = typing.get_args(tp)
            if tp is float or (float in args and typing.get_origin(tp) is not list):
                out.append((f"{section.name}.{name}", False))
            elif typing.get_origin(tp) is list and args == (float,):
                out.append((f"{section.name}.{name}", True))
    return out


FLOAT_KEYS = _float_keys()


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
@pytest.mark.parametrize(("key", "is_list"), FLOAT_KEYS, ids=[k for k, _ in FLOAT_KEYS])
def test_every_float_setting_refuses_non_finite_values(key: str, is_list: bool, bad: str) -> None:
    value = f"[0.9, {bad}]" if is_list else bad
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{key}={value}"])
    where = f"{key}[1]" if is_list else key
    assert str(info.value).startswith(f"{where}: {float(bad)!r} is not a finite number"), info.value


@pytest.mark.parametrize(
    "key",
    [
        "train.learning_rate",
        "diloco.outer_lr",
        "train.temperature",
        "diloco.timeout_s",
        "backend.timeout_s",
    ],
)
def test_train_and_config_validate_refuse_inf_alike(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["config", "validate", f"{key}=inf"]) == 2
    validate_err = capsys.readouterr().err
    assert main(["train", f"{key}=inf"]) == 2
    train_err = capsys.readouterr().err
    assert validate_err == train_err
    assert train_err == (
        f"composer-replication: error: {key}: inf is not a finite number (inf, "
        "-inf and nan are refused); give a finite value\n"
    )
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_toml_file_with_inf_is_refused_too(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    names = {k for k, _ in FLOAT_KEYS}  # the parametrization above covers the keys
    for key in (
        "train.learning_rate",
        "train.temperature",
        "diloco.outer_lr",
        "diloco.timeout_s",
        "backend.timeout_s",
        "loss.alpha_sdpo",
    ):
        assert key in names
    path = tmp_path / "bad.toml"
    path.write_text("[diloco]\nouter_lr = inf\n")
    assert main(["config", "validate", str(path)]) == 2
    assert "diloco.outer_lr: inf is not a finite number" in capsys.readouterr().err


def test_resume_refuses_a_stored_config_with_inf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    run = _stopped_run(tmp_path, "edited")
    tree = json.loads((run / "config.json").read_text())
    tree["train"]["learning_rate"] = float("inf")  # json.dumps writes Infinity
    (run / "config.json").write_text(json.dumps(tree))
    assert main(["train", "--resume", "edited"]) == 2
    assert "train.learning_rate: inf is not a finite number" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "diloco.outer_lr=nan"]) == 2


def test_config_validate_needs_the_sagemaker_image(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("boto3")
    base = ["backend.kind=sagemaker", "store.uri=s3://bucket/runs/x/"]
    assert main(["config", "validate", *base]) == 2
    err = capsys.readouterr().err
    assert "backend.options.image: the sagemaker backend needs it" in err, err
    assert main(["config", "validate", *base, 'backend.options.image=""']) == 2
    assert "backend.options.image" in capsys.readouterr().err
    image = "backend.options.image=1.dkr.ecr.us-east-1.amazonaws.com/cr:1"
    assert main(["config", "validate", *base, image]) == 0, capsys.readouterr().err
    assert main(["config", "validate", *base, image, "backend.options.imagee=x"]) == 2
    err = capsys.readouterr().err
    assert "backend.options.imagee: not an option of the sagemaker backend (did you mean " in err


def test_config_validate_refuses_unknown_local_options(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "validate", "backend.options.max_restart=3"]) == 2
    err = capsys.readouterr().err
    assert (
        "backend.options.max_restart: not an option of the local backend (did you mean "
        "'max_restarts'?)" in err
    )


# ----------------------------------------------------------------------------- read-only resume


def _stopped_run(tmp_path: Path, name: str) -> Path:
    """A run folder as a killed driver leaves it: config, driver.json, a store folder."""
    run = tmp_path / "runs" / name
    (run / "store").mkdir(parents=True)
    config = load_config(
        overrides=[
            f"run.name={name}",
            f"store.uri={(run / 'store').as_uri()}/",
            "logging.tensorboard=false",
            "logging.report=false",
        ]
    )
    (run / "config.json").write_text(json.dumps(to_dict(config)))
    (run / "driver.json").write_text(json.dumps({"status": "failed", "attempt": 1}))
    (run / "metrics.jsonl").write_text("")
    return run


def _read_only_command(run: Path, argv: list[str]) -> list[str] | None:
    """`argv` run with `run` read-only: a private read-only bind mount (root, as on this CI),
    else None (the caller falls back to permissions)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return None
    probe = subprocess.run(
        [unshare, "-m", "sh", "-c", f"mount --bind -o ro '{run}' '{run}'"], capture_output=True
    )
    if probe.returncode != 0:
        return None
    inner = " ".join(f"'{a}'" for a in argv)
    return [unshare, "-m", "sh", "-c", f"mount --bind -o ro '{run}' '{run}' && exec {inner}"]


def test_resume_into_a_read_only_run_folder_is_one_line_and_exit_2(tmp_path: Path) -> None:
    run = _stopped_run(tmp_path, "frozen")
    argv = [sys.executable, "-m", "composer_replication", "train", "--resume", str(run)]
    command = _read_only_command(run, argv)
    restore: list[Path] = []
    if command is None:
        if os.geteuid() == 0:
            pytest.skip("no way to make a folder read-only for root here (no unshare)")
        for path in [run, *run.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
            restore.append(path)
        command = argv
    before = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*"))
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    finally:
        for path in restore:
            path.chmod(path.stat().st_mode | 0o200)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(
        f"composer-replication: error: --resume: cannot write the run folder {run}"
    )
    assert "read-only file system" in lines[0] or "no write permission" in lines[0]
    assert sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*")) == before
