"""Suite-wide fixtures and hooks. ``seaweedfs_server`` / ``moto_server`` live in
tests/s3_servers.py, ``gcs_server`` in tests/gcs_server.py, ``openenv_server`` (an OpenEnv
environment server) in tests/openenv_server.py.

pytest puts this directory (tests/ has no __init__.py) on sys.path before importing this file,
so the plugin module is importable as ``s3_servers`` from any working directory.
"""

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`heavy` tests: the longer timeout, and one xdist group, so that under
    `pytest -n N --dist loadgroup` they run one after another on one worker (each already keeps
    several processes busy) while the other workers take the light tests."""
    for item in items:
        if item.get_closest_marker("heavy") is None:
            continue
        item.add_marker(pytest.mark.xdist_group("heavy"))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(HEAVY_TIMEOUT_S))
