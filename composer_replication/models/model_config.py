"""The `[model]` section: which policy a replica trains, and the tiny model's shape.

The models' own config, beside the builders that read it (`tiny.build_tiny_model`,
`tokenizers.build_tokenizer` / `build_bpe_tokenizer`); the run schema (`config.schema.RunConfig`)
composes it. Each key's default and help are written once, here (`fields.setting`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from composer_replication.fields import require, setting

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """The policy: 'tiny' (built locally, no download), a hub id, or a local folder."""

    name: str = setting("tiny", "'tiny', a Hugging Face hub id (org/name) or a local model folder")
    hidden_size: int = setting(64, "tiny model only: hidden size")
    num_layers: int = setting(2, "tiny model only: number of transformer layers")
    num_heads: int = setting(4, "tiny model only: attention heads")
    num_kv_heads: int = setting(2, "tiny model only: key/value heads")
    tokenizer: Literal["char", "bpe"] = setting(
        "char",
        "tiny model only: 'char' (one token per character) or 'bpe' (trained locally on "
        "the task's training text, cached)",
    )
    vocab_size: int = setting(512, "tiny model with tokenizer 'bpe': the largest vocabulary")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = setting(
        "float32", "parameter dtype for hub/local models"
    )
    trust_remote_code: bool = setting(False, "passed to from_pretrained for hub/local models")

    def __post_init__(self) -> None:
        require(bool(self.name.strip()), "model.name", "must not be empty (use 'tiny')")
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
            require(getattr(self, key) >= 1, f"model.{key}", "must be >= 1")

    @property
    def is_tiny(self) -> bool:
        return self.name == "tiny"
