"""Suite-wide fixtures, hooks and the GPU rules. ``seaweedfs_server`` / ``moto_server`` live in
tests/s3_servers.py, ``gcs_server`` in tests/gcs_server.py, ``openenv_server`` (an OpenEnv
environment server) in tests/openenv_server.py.

pytest puts this directory (tests/ has no __init__.py) on sys.path before importing this file,
so the plugin modules (and ``tolerances``, the derived numeric tolerances) are importable by name
from any test.

On a CUDA machine:

* tests marked ``gpu`` run (elsewhere they are skipped, with the reason); ``pytest -m gpu`` selects
  them, ``scripts/gpu-check.sh`` runs them with tests/loss and tests/trainer;
* every test runs under `deterministic_cuda`: TF32 off (fp32 matmuls and convolutions in fp32),
  no reduced-precision reductions for bf16/fp16 matmuls, ``torch.use_deterministic_algorithms``
  (``warn_only``: an op without a deterministic kernel warns, naming itself, instead of failing),
  cuDNN deterministic without autotuning, and scaled-dot-product attention on its math kernel
  (the flash / memory-efficient kernels' backward accumulates in a run-dependent order). So a
  CUDA test compares arithmetic, as the CPU tests do; tolerances (tests/tolerances.py) cover only
  the order of summation, never TF32 or atomics. On CPU the fixture does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from gcs_server import gcs_server  # noqa: F401  (a fixture, by name)
from openenv_server import openenv_server  # noqa: F401  (a fixture, by name)
from s3_servers import moto_server, seaweedfs_server  # noqa: F401  (fixtures, by name)

# How much of a failure's traceback is printed the moment it fails (the summary has it all).
LIVE_FAILURE_LINES = 40
# A heavy test (several training processes end to end) may take minutes on a quiet 2-core machine
# and several times that beside other work; its timeout catches a hang, not a slow machine.
HEAVY_TIMEOUT_S = 1200
_SESSION: dict[str, pytest.Config] = {}


def pytest_configure(config: pytest.Config) -> None:
    _SESSION["config"] = config


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Print a failing test's reason the moment it fails, not only in the final summary.

    A long run cut off by a time limit (CI's, or `timeout` around pytest) would otherwise show
    only `F` marks. Under pytest-xdist this runs in the controller, which receives every worker's
    reports; workers skip it (their output is not shown).
    """
    config = _SESSION.get("config")
    if not report.failed or config is None or hasattr(config, "workerinput"):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    shown = report.longreprtext.splitlines()[-LIVE_FAILURE_LINES:]
    reporter.write_line("")
    reporter.write_line(f"FAILED {report.nodeid} ({report.when}); its last {len(shown)} lines:")
    for line in shown:
        reporter.write_line("    " + line)


# cuBLAS reads this once, when the process creates its first handle: deterministic cuBLAS
# reductions need it set before any test touches CUDA (subprocesses inherit it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

GPU_SKIP_REASON = (
    "needs a CUDA device: run `pytest -m gpu` (or scripts/gpu-check.sh) on a GPU machine"
)


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False without torch, never importing it for that)."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests are skipped without CUDA (with the reason). `heavy` tests are `long` too (the
    separate step, `bash scripts/test.sh --long`), get the longer timeout and one xdist group, so
    that under `pytest -n N --dist loadgroup` they run one after another on one worker (each
    already keeps several processes busy) while the other workers take the other long tests."""
    for item in items:
        if item.get_closest_marker("heavy") is None:
            continue
        item.add_marker(pytest.mark.long)
        item.add_marker(pytest.mark.xdist_group("heavy"))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(HEAVY_TIMEOUT_S))
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not cuda_available():
        skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """For a test that presses Ctrl-C with `_thread.interrupt_main()`: SIGINT raises
    KeyboardInterrupt in the main thread for the test's duration, then the previous handler is
    back. Without it such a test fails wherever the suite was started with SIGINT ignored
    (`nohup bash .ci/run &` from a script, some CI runners): Python then installs no
    KeyboardInterrupt handler, and `interrupt_main` does nothing for an ignored signal."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def deterministic_cuda() -> Iterator[None]:
    """Deterministic, full-precision CUDA arithmetic for the test (module docstring); restores
    every setting afterwards. A no-op where torch was never imported or there is no CUDA."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        yield
        return
    backends = torch.backends
    matmul = backends.cuda.matmul
    saved = {
        "matmul_tf32": matmul.allow_tf32,
        "bf16_reduction": matmul.allow_bf16_reduced_precision_reduction,
        "fp16_reduction": matmul.allow_fp16_reduced_precision_reduction,
        "cudnn_tf32": backends.cudnn.allow_tf32,
        "cudnn_deterministic": backends.cudnn.deterministic,
        "cudnn_benchmark": backends.cudnn.benchmark,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "flash": backends.cuda.flash_sdp_enabled(),
        "mem_efficient": backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn_sdp": backends.cuda.cudnn_sdp_enabled(),
        "math": backends.cuda.math_sdp_enabled(),
    }
    matmul.allow_tf32 = False
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    backends.cudnn.allow_tf32 = False
    backends.cudnn.deterministic = True
    backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    backends.cuda.enable_flash_sdp(False)
    backends.cuda.enable_mem_efficient_sdp(False)
    backends.cuda.enable_cudnn_sdp(False)
    backends.cuda.enable_math_sdp(True)
    try:
        yield
    finally:
        matmul.allow_tf32 = saved["matmul_tf32"]
        matmul.allow_bf16_reduced_precision_reduction = saved["bf16_reduction"]
        matmul.allow_fp16_reduced_precision_reduction = saved["fp16_reduction"]
        backends.cudnn.allow_tf32 = saved["cudnn_tf32"]
        backends.cudnn.deterministic = saved["cudnn_deterministic"]
        backends.cudnn.benchmark = saved["cudnn_benchmark"]
        torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["warn_only"])
        backends.cuda.enable_flash_sdp(saved["flash"])
        backends.cuda.enable_mem_efficient_sdp(saved["mem_efficient"])
        backends.cuda.enable_cudnn_sdp(saved["cudnn_sdp"])
        backends.cuda.enable_math_sdp(saved["math"])
