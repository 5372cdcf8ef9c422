"""Tiny models and local tokenizers for the embedded default and the tests (no download).

`build_tokenizer()` is character-level; `build_bpe_tokenizer(texts)` trains a BPE vocabulary on a
task's own text (deterministic, cached on disk); `build_tiny_model(tokenizer)` is a randomly
initialised Qwen2-architecture model sized to either.
"""

from composer_replication.models.tiny import build_tiny_model, tiny_model_config
from composer_replication.models.tokenizers import (
    BPE_VOCAB_SIZE,
    DEFAULT_CHARSET,
    TOKENIZER_KINDS,
    build_bpe_tokenizer,
    build_tokenizer,
    default_cache_dir,
)

__all__ = [
    "BPE_VOCAB_SIZE",
    "DEFAULT_CHARSET",
    "TOKENIZER_KINDS",
    "build_bpe_tokenizer",
    "build_tiny_model",
    "build_tokenizer",
    "default_cache_dir",
    "tiny_model_config",
]
