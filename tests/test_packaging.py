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

import pytest

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
    # `all` is the others together; `gpu` goes in by its own step (no-deps liger-kernel); vLLM
    # runs on CUDA only (its tests skip elsewhere), so --all leaves it out and says so
    assert everything == set(EXTRAS) - {"all", "vllm"}
    assert "EXTRAS=train,vllm bash scripts/setup.sh" in SETUP
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


# ----------------------------------------------------------------------------- the train extra runs the demo

SITECUSTOMIZE = '''\
"""Hide BLOCKED top-level modules and their distributions from this interpreter and the
replicas it starts (they inherit PYTHONPATH): find_spec says "not installed", import fails."""
import json
import sys
from importlib.machinery import PathFinder

BLOCKED = set(json.loads({blocked!r}))


class _Filtered:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        return PathFinder.find_spec(name, path, target)

    @classmethod
    def invalidate_caches(cls):
        PathFinder.invalidate_caches()

    @staticmethod
    def find_distributions(*args, **kwargs):
        for dist in PathFinder.find_distributions(*args, **kwargs):
            if (dist.metadata["Name"] or "").lower().replace("-", "_") not in BLOCKED:
                yield dist


sys.meta_path[:] = [_Filtered if f is PathFinder else f for f in sys.meta_path]
'''


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """The installed distributions `requirements` need, transitively (no extras of theirs)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _canonical(req.name)
        if name in seen or name == "composer_replication":
            continue
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in requires]
    return seen


def _not_in_the_train_extra() -> set[str]:
    """Top-level modules of the distributions that only extras other than `train` bring."""
    import importlib.metadata as md

    keep = _closure([*PROJECT["dependencies"], *EXTRAS["train"]])
    others = {
        _canonical(re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0])
        for extra, requirements in EXTRAS.items()
        if extra not in ("train", "all")
        for r in requirements
    }
    blocked_dists = others - keep
    return {
        module
        for module, dists in md.packages_distributions().items()
        if {_canonical(d) for d in dists} <= blocked_dists and not module.startswith("_")
    } | blocked_dists


@pytest.mark.slow
@pytest.mark.long
def test_the_train_extra_alone_runs_the_demo(tmp_path: Path) -> None:
    """`pip install "composer-replication[train]"` (or `bash scripts/setup.sh`) then `train`:
    a short run of the demo with every module only another extra brings hidden (the backends'
    SDKs, s3fs/gcsfs, verl, Monarch, OpenEnv, reasoning-gym, Triton, Liger-Kernel, the test
    tools) trains, reports and checkpoints."""
    import importlib.util
    import json
    import os
    import sys

    spec = importlib.util.spec_from_file_location("_run_small", ROOT / "tests/run/_run_small.py")
    assert spec is not None and spec.loader is not None
    small = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(small)

    blocked = _not_in_the_train_extra()
    assert {"ray", "modal", "kubernetes", "boto3"} & blocked, blocked
    assert not {"torch", "transformers", "trl", "torchft", "matplotlib", "rich"} & blocked
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(blocked=json.dumps(sorted(blocked)))
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('ray'))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "None", probe.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer_replication",
            "train",
            *small.TINY_RUN,
            "train.max_steps=4",
            "diloco.sync_every_h=2",
            "--name",
            "train-extra",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    logs = "".join(p.read_text() for p in (tmp_path / "runs").rglob("replica-*.log"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + logs[-3000:]
    run = tmp_path / "runs" / "train-extra"
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()
    assert (run / "summary.md").is_file() and list((run / "plots").glob("*.png"))
