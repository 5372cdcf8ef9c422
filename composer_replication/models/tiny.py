"""A tiny Qwen2-architecture causal LM, built locally.

The embedded default run and the test suite must work with no network, so nothing here touches a
model hub: the model is a randomly initialised `Qwen2ForCausalLM` from a small config, sized to a
tokenizer from `models/tokenizers.py` (character-level or BPE, both local). Real runs load a hub
model instead (`AutoModelForCausalLM.from_pretrained`); everything downstream treats both alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from composer_replication.models.tokenizers import IM_END, _require_transformers, build_tokenizer


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
) -> Qwen2Config:
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
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Qwen2ForCausalLM:
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
    # Generation stops at the chat template's end of turn as well as at EOS, as Qwen2.5-Instruct's
    # generation_config lists both: an answer ends with <|im_end|> (the template, SFT).
    stops = [tok.eos_token_id]
    end_of_turn = tok.convert_tokens_to_ids(IM_END)
    if isinstance(end_of_turn, int) and end_of_turn != tok.unk_token_id:
        stops.append(end_of_turn)
    model.generation_config.eos_token_id = stops if len(stops) > 1 else stops[0]
    return model
