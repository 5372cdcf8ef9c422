"""Pure-tensor losses of the composer recipe (no trainer, data or distributed imports).

- ``policy``: GRPO family (``grpo_loss``) and PRIME-RL-style ``dppo_mask`` (channel 1)
- ``distill``: ``generalized_jsd``, ``taid_loss`` + ``TAIDScheduler``, ``entropy_opd_loss`` (channel 2)
- ``preference``: ``dpo_loss``, ``simpo_loss`` (channel 3)
- ``compose``: ``compose_loss(model, inputs, **kw)`` on the one composer batch (docs/api.md), its
  per-channel terms ``sdpo_term`` / ``replay_term`` (for trainers that compute channel 1
  themselves) and the tensor-level ``combine``
- log-probs: ``selective_log_softmax`` (from logits), ``completion_logps`` (from a causal LM)
- ``ComposeConfig``: every keyword and its default; ``TAID_T_START``/``TAID_T_END`` and the
  choice tuples ``LOSS_TYPES``, ``SDPO_WRAPPERS``, ``DPO_VARIANTS`` (and their ``Literal``
  types ``LossType``, ``SdpoWrapper``, ``DpoVariant``)

Every loss returns ``(loss, metrics)``: a 0-dim tensor and a dict of python floats.
"""

from composer_replication.loss._config import (
    DPO_VARIANTS,
    SDPO_WRAPPERS,
    TAID_T_END,
    TAID_T_START,
    DpoVariant,
    SdpoWrapper,
)
from composer_replication.loss._logprobs import CausalLM, completion_logps, selective_log_softmax
from composer_replication.loss.compose import (
    ComposeConfig,
    combine,
    compose_loss,
    replay_term,
    sdpo_term,
)
from composer_replication.loss.distill import (
    TAID_ALPHA,
    TAID_BETA,
    TAIDScheduler,
    entropy_opd_loss,
    generalized_jsd,
    taid_loss,
)
from composer_replication.loss.policy import LOSS_TYPES, LossType, dppo_mask, grpo_loss
from composer_replication.loss.preference import dpo_loss, simpo_loss

__all__ = [
    "DPO_VARIANTS",
    "LOSS_TYPES",
    "SDPO_WRAPPERS",
    "TAID_ALPHA",
    "TAID_BETA",
    "TAID_T_END",
    "TAID_T_START",
    "CausalLM",
    "ComposeConfig",
    "DpoVariant",
    "LossType",
    "SdpoWrapper",
    "TAIDScheduler",
    "combine",
    "completion_logps",
    "compose_loss",
    "dpo_loss",
    "dppo_mask",
    "entropy_opd_loss",
    "generalized_jsd",
    "grpo_loss",
    "replay_term",
    "sdpo_term",
    "selective_log_softmax",
    "simpo_loss",
    "taid_loss",
]
