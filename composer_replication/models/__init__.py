"""Tiny models and a local tokenizer for the embedded default and the tests (no download)."""

from composer_replication.models.tiny import (
    DEFAULT_CHARSET,
    build_tiny_model,
    build_tokenizer,
    tiny_model_config,
)

__all__ = ["DEFAULT_CHARSET", "build_tiny_model", "build_tokenizer", "tiny_model_config"]
