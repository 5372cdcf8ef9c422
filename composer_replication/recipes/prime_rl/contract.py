"""PRIME-RL 0.8's custom-loss contract, mirrored field for field (prime-rl is not installable here).

PRIME-RL needs Python 3.12 and vLLM, so this package cannot depend on it. The three types below
repeat, in name, order, optionality and default, the ones a PRIME-RL 0.8 trainer uses
(``prime_rl.trainer.rl.loss.LossInputs`` / ``LossOutputs`` and
``prime_rl.configs.trainer.CustomLossConfig``, prime-rl 0.8.0 at commit 559b447);
``tests/recipes/test_prime_rl_contract.py`` compares them with the real ones whenever prime-rl is
importable. Inside a PRIME-RL trainer ``loss_fn`` receives PRIME-RL's own ``LossInputs``: the
recipe reads it by attribute (duck typing), never by type, so either class works.

- ``LossInputs``: ONE sample, every tensor 1-D ``(seq,)``: ``trainer_logprobs`` (current policy,
  differentiable), ``inference_logprobs`` (the policy that sampled), ``ref_logprobs`` (reference
  or teacher log-probs of the sampled tokens, None unless the run's algorithm scores a reference),
  ``advantages`` (per token), ``loss_mask`` (bool, the tokens of this loss component),
  ``loss_weights`` (per-token weights, None = 1.0).
- ``LossOutputs``: ``loss`` is the 0-dim SUM over the sample's tokens (PRIME-RL divides by the
  global token count itself); ``metrics`` maps names to 0-dim tensors (averaged over samples).
- ``CustomLossConfig``: ``[trainer.loss] type = "custom"``, ``import_path`` (a DOTTED path; PRIME-RL
  splits it at the last ``.``), ``kwargs`` (forwarded to the function on every call). PRIME-RL's
  class is a pydantic model; this mirror is a dataclass with the same fields and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor


@dataclass
class LossInputs:
    """Inputs of one sample (mirror of ``prime_rl.trainer.rl.loss.LossInputs``)."""

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor
    loss_weights: Tensor | None = field(default=None)


@dataclass
class LossOutputs:
    """Output of one sample (mirror of ``prime_rl.trainer.rl.loss.LossOutputs``)."""

    loss: Tensor
    metrics: dict[str, Tensor]


@dataclass(kw_only=True)
class CustomLossConfig:
    """``[trainer.loss]`` of a custom loss (mirror of ``prime_rl.configs.trainer.CustomLossConfig``)."""

    type: Literal["custom"] = "custom"
    import_path: str
    kwargs: dict[str, object] = field(default_factory=dict)


# PRIME-RL's own default loss knobs (``prime_rl.configs.trainer.DefaultLossConfig``): the recipe's
# channel 1 reproduces that loss with these values, and the contract test checks them.
PRIME_RL_DEFAULT_LOSS = {
    "dppo_mask_low": 0.2,
    "dppo_mask_high": 0.2,
    "adv_tau": 1.0,
    "kl_tau": 1e-3,
}
