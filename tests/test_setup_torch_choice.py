"""scripts/setup.sh picks the torch build on purpose (scripts/torch_build.sh, run here without
installing anything): the CPU wheel when no NVIDIA GPU answers, the CUDA build when
`nvidia-smi -L` lists one, `TORCH_BUILD=cpu|cuda` to choose. A fake `nvidia-smi` on a private
PATH stands in for the GPU; the real one, if any, is not on that PATH."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "torch_build.sh"
BASH = shutil.which("bash") or "/bin/bash"

GPUS = (
    "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-6f0c1a52-0000-0000-0000-000000000000)\n"
    "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-6f0c1a52-0000-0000-0000-000000000001)\n"
)
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
    "that the latest NVIDIA driver is installed and running.\n"
)


def _fake(bin_dir: Path, name: str, stdout: str, code: int = 0) -> None:
    """An executable that prints `stdout` and exits `code` (bash builtins only: nothing else is
    on the private PATH)."""
    data = bin_dir / f".{name}.out"
    data.write_text(stdout)
    path = bin_dir / name
    path.write_text(f"#!{BASH}\nprintf '%s\\n' \"$(< {data})\"\nexit {code}\n")
    path.chmod(0o755)


def _choose(
    tmp_path: Path,
    *,
    smi: tuple[str, int] | None,
    torch_build: str | None = None,
    system: str | None = None,
) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if system is None:
        (bin_dir / "uname").symlink_to(shutil.which("uname") or "/bin/uname")
    else:
        _fake(bin_dir, "uname", system + "\n")
    if smi is not None:
        _fake(bin_dir, "nvidia-smi", *smi)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    if torch_build is not None:
        env["TORCH_BUILD"] = torch_build
    return subprocess.run([BASH, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def _lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_no_nvidia_smi_picks_the_cpu_wheel(tmp_path: Path) -> None:
    choice, requirement, reason = _lines(_choose(tmp_path, smi=None, system="Linux"))
    assert (choice, requirement) == ("cpu", "torch==2.13.0+cpu")
    assert "nvidia-smi is not on PATH" in reason


def test_a_gpu_listed_by_nvidia_smi_picks_the_cuda_build(tmp_path: Path) -> None:
    choice, requirement, reason = _lines(_choose(tmp_path, smi=(GPUS, 0), system="Linux"))
    assert (choice, requirement) == ("cuda", "torch==2.13.0")
    assert reason == "nvidia-smi lists 2 GPU(s): GPU 0: NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("smi", "why"),
    [((NO_DRIVER, 9), "nvidia-smi -L failed"), (("", 0), "nvidia-smi -L lists none")],
    ids=["driver-missing", "no-device"],
)
def test_an_nvidia_smi_without_a_gpu_picks_the_cpu_wheel(
    tmp_path: Path, smi: tuple[str, int], why: str
) -> None:
    choice, requirement, reason = _lines(_choose(tmp_path, smi=smi, system="Linux"))
    assert (choice, requirement) == ("cpu", "torch==2.13.0+cpu")
    assert why in reason


def test_torch_build_overrides_the_detection(tmp_path: Path) -> None:
    assert _lines(_choose(tmp_path, smi=(GPUS, 0), torch_build="cpu", system="Linux")) == [
        "cpu",
        "torch==2.13.0+cpu",
        "TORCH_BUILD=cpu",
    ]
    assert _lines(_choose(tmp_path, smi=None, torch_build="cuda", system="Linux")) == [
        "cuda",
        "torch==2.13.0",
        "TORCH_BUILD=cuda",
    ]
    bad = _choose(tmp_path, smi=None, torch_build="gpu", system="Linux")
    assert bad.returncode == 2 and bad.stdout == ""
    assert "TORCH_BUILD=gpu: expected cpu, cuda or auto" in bad.stderr


def test_macos_has_no_cuda_build(tmp_path: Path) -> None:
    assert _lines(_choose(tmp_path, smi=None, system="Darwin"))[:2] == ["cpu", "torch==2.13.0"]
    cuda = _choose(tmp_path, smi=None, torch_build="cuda", system="Darwin")
    assert cuda.returncode == 2 and "no CUDA build for macOS" in cuda.stderr


def test_this_machine_detection_uses_the_real_uname(tmp_path: Path) -> None:
    """The real `uname` on this (Linux) machine; no nvidia-smi on the private PATH."""
    assert _lines(_choose(tmp_path, smi=None))[:2] == ["cpu", "torch==2.13.0+cpu"]


def test_setup_installs_the_chosen_pin_which_the_package_admits() -> None:
    """The version setup.sh installs is one pyproject's torch range admits (else the package
    install would replace it), and setup.sh installs what torch_build.sh chose."""
    version = re.search(r"^TORCH_VERSION=(\S+)$", SCRIPT.read_text(), re.M)
    assert version is not None
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_range,) = [d for d in deps if re.match(r"torch\b", d)]
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(torch_range.removeprefix("torch"))
    assert version.group(1) in spec and f"{version.group(1)}+cpu" in spec
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert ". scripts/torch_build.sh" in setup and "torch_choice" in setup
    assert 'pip install --quiet "$TORCH_REQUIREMENT"' in setup
