"""Channel 2 fused with the output layer inside the trainer: when it applies, and the capture.

The fused path (``loss.fused_sdpo_term``) needs, per side, the model's body (the layers before the
output layer, whose output is the last hidden states) and an output layer that is a plain
``nn.Linear`` whose result *is* the logits. `hidden_state_source` says whether a Hugging Face
causal LM is such a model, and why not when it is not:

- ``model.base_model`` (the backbone Hugging Face and TRL's own fused LM head call) is a module
  other than the model, and ``model.get_output_embeddings()`` is an ``nn.Linear`` (a PEFT adapter
  on the output layer is not);
- the config applies nothing after the output layer: no ``final_logit_softcapping`` and no logit
  scale (``logit_scale``, ``output_multiplier``, ``lm_head_multiplier``, ``logits_scaling``: the
  attributes TRL 1.16's fused LM head reads for the same reason).

`capture_hidden` records the body's ``last_hidden_state`` during the student forward (a forward
hook: it works whatever calls the body, TRL's fused LM head or the model's own forward, and
through accelerate's wrappers), with its autograd graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

# Config attributes after which the logits are not the output layer's result (TRL's list).
_LOGIT_POSTPROCESSING = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


@dataclass(frozen=True)
class HiddenStateSource:
    """A causal LM's body and its plain linear output layer."""

    body: nn.Module
    head: nn.Linear


def hidden_state_source(model: nn.Module) -> tuple[HiddenStateSource | None, str]:
    """``(source, "")`` when channel 2 can run fused on ``model``, else ``(None, why not)``."""
    config: object = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    text_config = get_text_config() if callable(get_text_config) else config
    if getattr(text_config, "final_logit_softcapping", None) is not None:
        return None, "the model soft-caps its logits (final_logit_softcapping)"
    for attr in _LOGIT_POSTPROCESSING:
        value = getattr(text_config, attr, None)
        if value is not None and float(value) != 1.0:
            return None, f"the model scales its logits ({attr}={value})"
    body = getattr(model, "base_model", None)
    if not isinstance(body, nn.Module) or body is model:
        return None, "the model exposes no body (base_model) separate from its output layer"
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:
        return None, f"its output layer is {type(head).__name__}, not a plain nn.Linear"
    return HiddenStateSource(body=body, head=head), ""


@contextlib.contextmanager
def capture_hidden(body: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect ``body``'s ``last_hidden_state`` of every forward inside the block (in order)."""
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: object, output: object) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None and isinstance(output, tuple) and output:
            hidden = output[0]
        if isinstance(hidden, torch.Tensor):
            captured.append(hidden)

    handle = body.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()
