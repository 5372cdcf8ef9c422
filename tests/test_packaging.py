"""What a user installing the package expects: a LICENSE matching the metadata, classifiers, a
`train` extra that runs `composer-replication train` as it is, every extra named in the README,
and scripts/setup.sh installing the demo's extras by default and every extra with `--all`
(which the test command and CI ask for, since the suite needs them all)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
SETUP = (ROOT / "scripts" / "setup.sh").read_text()
README = (ROOT / "README.md").read_text()
BASH = shutil.which("bash") or "/bin/bash"


def test_license_file_matches_the_metadata() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_classifiers_name_the_python_the_package_requires() -> None:
    classifiers = PROJECT["classifiers"]
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert PROJECT["requires-python"] == ">=3.11"
    # PEP 639: with a license expression, license classifiers are refused by the build
    assert not [c for c in classifiers if c.startswith("License ::")]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_train_extra_holds_what_train_needs_by_default() -> None:
    """`pip install "composer-replication[train]"` then `composer-replication train`: the
    outer loop (torchft) and the report, TensorBoard files and live view are on by default."""
    train = _names(EXTRAS["train"])
    assert _names(EXTRAS["diloco"]) <= train
    assert _names(EXTRAS["report"]) <= train
    assert {"trl", "transformers"} <= train
    # the same pins: the extras must not drift apart
    pinned = {r for r in EXTRAS["diloco"] + EXTRAS["report"]}
    assert pinned <= set(EXTRAS["train"])


def test_the_readme_lists_every_extra_and_the_pip_install_path() -> None:
    table = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    shown = set(re.findall(r"`([a-z0-9-]+)`", table))
    missing = set(EXTRAS) - shown
    assert not missing, f"README's Install section does not list the extras {sorted(missing)}"
    assert 'pip install "composer-replication[train]"' in table
    assert 'pip install -e ".[train]"' in table


def _setup_list(name: str) -> set[str]:
    m = re.search(rf"^{name}=(\S+)$", SETUP, re.M)
    assert m is not None, f"scripts/setup.sh sets no {name}"
    return set(m.group(1).split(","))


def test_setup_all_installs_every_extra() -> None:
    everything = _setup_list("ALL_EXTRAS") | _setup_list("ALL_FRAMEWORK_EXTRAS") | {"gpu"}
    # `all` is the others together; `gpu` goes in by its own step (no-deps liger-kernel)
    assert everything == set(EXTRAS) - {"all"}
    assert "GPU_EXTRA=${GPU_EXTRA:-1}" in SETUP.split('if [ "$SETUP_ALL" = 1 ]')[1]


def test_setup_by_default_installs_the_demos_extra_only() -> None:
    default = SETUP.split('if [ "$SETUP_ALL" = 1 ]')[1].split("else", 1)[1].split("fi", 1)[0]
    assert "EXTRAS=${EXTRAS:-train}" in default
    assert "FRAMEWORK_EXTRAS=${FRAMEWORK_EXTRAS-}" in default
    assert "GPU_EXTRA=${GPU_EXTRA:-0}" in default


def test_the_test_command_and_ci_ask_for_every_extra() -> None:
    assert re.search(
        r"^bash scripts/setup\.sh --all\b", (ROOT / "scripts" / "test.sh").read_text(), re.M
    )
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^step .* bash scripts/setup\.sh --all$", ci, re.M)
    assert not re.search(r"bash scripts/setup\.sh\s*$", ci, re.M)


def test_setup_scripts_parse_and_refuse_unknown_arguments(tmp_path: Path) -> None:
    for script in ("scripts/setup.sh", "scripts/test.sh", ".ci/run"):
        proc = subprocess.run([BASH, "-n", str(ROOT / script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"
    # Both answer before anything is installed (no venv, no pip): run from an empty folder.
    proc = subprocess.run(
        [BASH, str(ROOT / "scripts" / "setup.sh"), "--everything"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=30,
    )
    assert proc.returncode == 2 and "unknown argument '--everything'" in proc.stderr
    assert "--all" in proc.stderr
    proc = subprocess.run(
        [BASH, str(ROOT / "scripts" / "setup.sh"), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=30,
    )
    assert proc.returncode == 0 and "bash scripts/setup.sh --all" in proc.stdout
