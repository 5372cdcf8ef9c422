"""PRIME-RL recipe: the composer loss as a PRIME-RL 0.8 custom loss (docs/recipes/prime_rl.md).

- ``composer_loss``: ``loss_fn(inputs, **kwargs)``, the function ``[trainer.loss] import_path``
  names, and ``PrimeRLLossConfig``, its validated ``[trainer.loss.kwargs]`` (the loss library's
  ``SampledTokenSettings``, inherited, and PRIME-RL's channel-1 settings).
- ``contract``: PRIME-RL's ``LossInputs`` / ``LossOutputs`` / ``CustomLossConfig`` mirrored field
  for field (prime-rl itself needs Python 3.12 and vLLM, so it is not a dependency).
"""

from composer_replication.recipes.prime_rl.composer_loss import PrimeRLLossConfig, loss_fn
from composer_replication.recipes.prime_rl.contract import (
    CustomLossConfig,
    LossInputs,
    LossOutputs,
)

__all__ = ["CustomLossConfig", "LossInputs", "LossOutputs", "PrimeRLLossConfig", "loss_fn"]
