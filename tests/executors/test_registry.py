"""The backend registry: every entry names a real executor, extra and SDK; docs follow it."""

from __future__ import annotations

import inspect
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from composer_replication.executors import registry
from composer_replication.executors.executor import ExecutorBase, ServerlessExecutor

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_METHODS = ("launch_replicas", "poll", "collect", "cancel", "logs")


def backend_table() -> str:
    """The rows docs/backends.md must hold, rendered from the registry."""
    rows = []
    for b in registry.BACKENDS.values():
        install = f"`pip install 'composer-replication[{b.extra}]'`" if b.extra else "base package"
        rows.append(
            f"| `{b.name}` | `{b.cls}` (`{b.module}`) | {install} | "
            f"{'yes' if b.remote else 'no'} | {b.summary} |"
        )
    header = "| `backend.kind` | executor | install | remote | replicas |\n|---|---|---|---|---|"
    return header + "\n" + "\n".join(rows) + "\n"


def test_names_are_unique_and_in_the_schema_order() -> None:
    assert registry.BACKEND_NAMES == ("local", "modal", "hf-jobs", "k8s", "ray", "sagemaker")
    assert all(registry.BACKENDS[n].name == n for n in registry.BACKEND_NAMES)


@pytest.mark.parametrize("name", registry.BACKEND_NAMES)
def test_entry_names_an_executor_class(name: str) -> None:
    spec = registry.backend(name)
    cls = registry.executor_class(name)
    assert isinstance(cls, type) and cls.__name__ == spec.cls and cls.__module__ == spec.module
    assert issubclass(cls, ExecutorBase)  # and so a RankLauncher
    for method in PROTOCOL_METHODS:
        assert callable(getattr(cls, method)), method
    params = inspect.signature(cls.__init__).parameters
    assert ("log_dir" in params) == spec.takes_log_dir
    if spec.forward_env_as_secrets:
        assert "secrets" in params


def test_local_executor_satisfies_the_protocol() -> None:
    executor = registry.executor_class("local")()
    assert isinstance(executor, ServerlessExecutor)
    assert executor.backend == "local"


def test_extras_exist_in_pyproject() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for spec in registry.BACKENDS.values():
        if spec.extra is None:
            assert spec.sdk is None
            continue
        assert spec.extra in extras, spec.name
        assert spec.extra in extras["all"][0], f"{spec.extra} missing from the 'all' extra"


def test_importing_the_registry_and_adapters_imports_no_sdk() -> None:
    sdks = sorted({s.sdk for s in registry.BACKENDS.values() if s.sdk})
    modules = [s.module for s in registry.BACKENDS.values()]
    code = (
        "import importlib, sys\n"
        "import composer_replication.executors.registry\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print([s for s in {sdks!r} if s in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    ).stdout
    assert out.strip() == "[]"


def test_unknown_name_suggests_the_nearest() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'modall' \(did you mean 'modal'\?\)"):
        registry.backend("modall")
    with pytest.raises(ValueError, match="needs no extra"):
        registry.pip_extra("local")


def test_missing_sdk_message_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    assert registry.missing_sdk_message("local") is None
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # find_spec then reports it missing
    message = registry.missing_sdk_message("k8s")
    assert message is not None
    assert "'kubernetes'" in message and "pip install 'composer-replication[k8s]'" in message


def test_docs_table_is_the_registry() -> None:
    doc = (ROOT / "docs" / "backends.md").read_text()
    assert backend_table() in doc, "docs/backends.md's backend table differs from:\n" + (
        backend_table()
    )


if __name__ == "__main__":  # print the table for docs/backends.md
    sys.stdout.write(backend_table())
