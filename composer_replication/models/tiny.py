"""A tiny Qwen2-architecture causal LM and a character-level tokenizer, built locally.

The embedded default run and the test suite must work with no network, so nothing here touches a
model hub: the tokenizer is a `PreTrainedTokenizerFast` over a fixed character set (one token per
character, plus special tokens) with a Qwen-style chat template, and the model is a randomly
initialised `Qwen2ForCausalLM` from a small config. Real runs load a hub model instead
(`AutoModelForCausalLM.from_pretrained`); everything downstream treats both the same way.
"""

from __future__ import annotations

import string
from typing import Any

DEFAULT_CHARSET: str = string.ascii_letters + string.digits + string.punctuation + " \n"

SPECIAL_TOKENS: dict[str, str] = {
    "pad_token": "<|pad|>",
    "eos_token": "<|endoftext|>",
    "bos_token": "<|im_start|>",
    "unk_token": "<|unk|>",
}
IM_END = "<|im_end|>"

# Qwen2.5's template shape (role headers, <|im_end|> after each turn) so prompts built for the tiny
# model look like the ones a real Qwen model sees.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _require_transformers() -> Any:
    try:
        import tokenizers
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "The tiny model factory needs transformers; "
            "install it with `pip install composer-replication[train]`."
        ) from exc
    return transformers, tokenizers


def build_tokenizer(charset: str = DEFAULT_CHARSET) -> Any:
    """Return a character-level `PreTrainedTokenizerFast` with left padding and a chat template.

    Token ids: the four special tokens and `<|im_end|>` first (ids 0-4), then one id per character
    of `charset` in order. Characters outside `charset` map to `<|unk|>`.
    """
    if len(set(charset)) != len(charset):
        raise ValueError("charset has repeated characters; each character must appear once")
    transformers, tokenizers = _require_transformers()
    from tokenizers import decoders, models, pre_tokenizers

    specials = [*SPECIAL_TOKENS.values(), IM_END]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in charset:
        vocab[ch] = len(vocab)
    backend = tokenizers.Tokenizer(
        models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"])
    )
    # Split into single characters so WordLevel sees one "word" per character.
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    # Fuse joins decoded characters with no separator (WordLevel would insert spaces).
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        padding_side="left",
        additional_special_tokens=[IM_END],
        clean_up_tokenization_spaces=False,
        **SPECIAL_TOKENS,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    bos_token_id: int = 2,
) -> Any:
    """A `Qwen2Config` for a model small enough to train on two CPU cores."""
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    transformers, _ = _require_transformers()
    return transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        use_cache=True,
    )


def build_tiny_model(
    tokenizer: Any | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Any:
    """A randomly initialised `Qwen2ForCausalLM` (float32) sized to `tokenizer`'s vocabulary.

    The same `seed` gives bit-identical weights in every process, which the multi-replica tests
    and the embedded default rely on.
    """
    import torch

    transformers, _ = _require_transformers()
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    config = tiny_model_config(
        len(tok),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model
