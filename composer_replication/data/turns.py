"""Where an assistant turn ends: the chat template's end-of-turn token and the stop tokens of
generation.

A chat model ends its answer with the template's end-of-turn token (`<|im_end|>` for Qwen2.5's
template), not with the tokenizer's EOS: Qwen2.5-Instruct's `generation_config.eos_token_id` lists
both (151645 `<|im_end|>`, 151643 `<|endoftext|>`). Rollouts, evaluation and channel 3's chosen
traces must agree on it, or a model taught to end with `<|im_end|>` (SFT, the chat template)
generates past its answer during RL while evaluation cuts at the marker:

* `end_of_turn_id(tokenizer)`: the token the tokenizer's chat template writes right after an
  assistant message (read off a rendered conversation, so any template works), or None;
* `stop_token_ids(tokenizer, eos)`: the ids that end a completion, in order: the model's
  `generation_config.eos_token_id` (int or list), the tokenizer's EOS, the end-of-turn token;
* `align_generation_stops(model, tokenizer)`: writes that list into the model's
  `generation_config.eos_token_id` (what `generate`, TRL's `GRPOTrainer` and our evaluation read),
  and returns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

__all__ = ["align_generation_stops", "end_of_turn_id", "stop_token_ids"]

# A reply no template rewrites: the end-of-turn token is whatever the template puts after it.
_SENTINEL = "QZXJ7"


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template writes right after an assistant reply (None when the
    tokenizer has no chat template or the template ends a reply with plain text)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "1"}, {"role": "assistant", "content": _SENTINEL}],
            tokenize=False,
        )
    except Exception:  # noqa: BLE001 - a template that cannot render this: no end token known
        return None
    if not isinstance(text, str) or _SENTINEL not in text:
        return None
    after = text[text.rindex(_SENTINEL) + len(_SENTINEL) :]
    # The longest special token the rest starts with (a template may add "\n" after it).
    specials = sorted(getattr(tokenizer, "all_special_tokens", []), key=len, reverse=True)
    for special in specials:
        if isinstance(special, str) and special and after.startswith(special):
            token_id = tokenizer.convert_tokens_to_ids(special)
            return token_id if isinstance(token_id, int) else None
    return None


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, eos: int | Sequence[int] | None
) -> list[int]:
    """The ids that end a completion: `eos` (a `generation_config.eos_token_id`), then the
    tokenizer's EOS and the template's end-of-turn token where not already listed."""
    ids: list[int] = []
    listed = [eos] if isinstance(eos, int) else list(eos or [])
    for token_id in (*listed, getattr(tokenizer, "eos_token_id", None), end_of_turn_id(tokenizer)):
        if isinstance(token_id, int) and token_id not in ids:
            ids.append(token_id)
    return ids


def align_generation_stops(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Make the model's generation stop at every id of `stop_token_ids` (its
    `generation_config.eos_token_id` becomes that list) and return the list; a model without a
    generation config is left as it is."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return stop_token_ids(tokenizer, None)
    ids = stop_token_ids(tokenizer, getattr(config, "eos_token_id", None))
    if ids:
        config.eos_token_id = ids if len(ids) > 1 else ids[0]
    return ids
