"""Architecture rule: composer_replication/loss is pure tensor math and imports nothing of ours
outside itself (no trainer, data, diloco, recipes ...) but the foundation every layer may use
(`fields`: ``OneOf`` names the ``sdpo_wrapper`` registry; ARCHITECTURE.md, "Layers"), and no
heavy training frameworks."""

from __future__ import annotations

import ast
from pathlib import Path

import composer_replication.loss as loss_pkg

LOSS_DIR = Path(loss_pkg.__file__).parent
FOUNDATION = ("composer_replication.fields",)  # imports nothing of ours, below every layer
FORBIDDEN_THIRD_PARTY = ("trl", "transformers", "accelerate", "torchft", "ray", "datasets")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against composer_replication.loss
                names.append(
                    "composer_replication.loss" + ("." + node.module if node.module else "")
                )
            elif node.module:
                names.append(node.module)
    return names


def test_loss_imports_nothing_from_trainer_data_diloco():
    files = sorted(LOSS_DIR.glob("*.py"))
    assert len(files) >= 5
    offenders = []
    for path in files:
        for name in _imports(path):
            ours = name == "composer_replication" or name.startswith("composer_replication.")
            if (
                ours
                and name not in FOUNDATION
                and not (
                    name == "composer_replication.loss"
                    or name.startswith("composer_replication.loss.")
                )
            ):
                offenders.append(f"{path.name}: {name}")
            if name.split(".")[0] in FORBIDDEN_THIRD_PARTY:
                offenders.append(f"{path.name}: {name}")
    assert offenders == []


def test_the_rule_checker_sees_violations(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from composer_replication.trainer import x\nimport trl\nfrom . import policy\n")
    assert _imports(bad) == ["composer_replication.trainer", "trl", "composer_replication.loss"]
