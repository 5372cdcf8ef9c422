"""Every snippet of docs/recipes/prime_rl.md runs or is checked against what it names."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest
from docblocks import exec_doc_block

from composer_replication.recipes.prime_rl import PrimeRLLossConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "recipes" / "prime_rl.md").read_text()
EXAMPLE = tomllib.loads((ROOT / "examples" / "prime_rl" / "composer_rl.toml").read_text())


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, flags=re.S)


def test_seven_part_template():
    headings = re.findall(r"^## (\d)\. (.+)$", DOC, flags=re.M)
    assert [title for _, title in headings] == [
        "What it is",
        "Install",
        "Minimal example",
        "Config keys (`[trainer.loss.kwargs]`)",
        "How the channels map",
        "Limits",
        "Troubleshooting",
    ]


def test_python_snippets_run_in_order(capsys):
    namespace = exec_doc_block("docs/recipes/prime_rl.md", "trainer_lp = torch.tensor(")
    exec_doc_block("docs/recipes/prime_rl.md", "rl_fn = functools.partial", namespace)
    assert "sdpo/active 1.0" in capsys.readouterr().out
    assert namespace["trainer_lp"].grad is not None


def test_toml_snippet_is_the_example_files_loss_section():
    (snippet,) = blocks("toml")
    loss = tomllib.loads(snippet)["trainer"]["loss"]
    example = EXAMPLE["trainer"]["loss"]
    assert loss["type"] == example["type"] and loss["import_path"] == example["import_path"]
    for key, value in loss["kwargs"].items():
        assert example["kwargs"][key] == value, key
    PrimeRLLossConfig.from_kwargs(loss["kwargs"])


def test_install_snippet_and_colon_path_troubleshooting():
    (bash,) = blocks("bash")
    assert bash.strip() == "pip install -e ."
    module, _, name = (
        EXAMPLE["trainer"]["loss"]["import_path"].replace(".loss_fn", ":loss_fn").rpartition(".")
    )
    with pytest.raises(AttributeError, match="has no attribute 'composer_loss:loss_fn'"):
        getattr(importlib.import_module(module), name)
    assert "has no attribute 'composer_loss:loss_fn'" in DOC


def test_config_table_lists_every_key_with_its_default():
    table = DOC.split("## 4.")[1].split("## 5.")[0]
    cfg = PrimeRLLossConfig()
    for field in cfg.__dataclass_fields__:
        assert f"`{field}`" in table, field
    for key in ("mask", "alpha_sdpo", "beta_replay", "dpo_variant", "kl_tau"):
        row = next(line for line in table.splitlines() if line.startswith(f"| `{key}`"))
        default = getattr(cfg, key)
        assert (f'"{default}"' if isinstance(default, str) else repr(default)) in row, key
