"""Pure-tensor losses of the composer recipe (no trainer, data or distributed imports).

- ``policy``: GRPO family (``grpo_loss``) and PRIME-RL-style ``dppo_mask`` (channel 1)
- ``distill``: ``generalized_jsd``, ``taid_loss`` + ``TAIDScheduler``, ``entropy_opd_loss`` (channel 2)
- ``preference``: ``dpo_loss``, ``simpo_loss`` (channel 3)
- ``compose``: ``compose_loss(model, inputs, **kw)`` on the one composer batch (docs/api.md), its
  per-channel terms ``sdpo_term`` / ``fused_sdpo_term`` / ``replay_term`` / ``fused_replay_term`` (for trainers that
  compute channel 1 themselves), the tensor-level ``combine``, and ``assemble`` (the total from
  channel results: the one place it is formed); ``replay_preference``, channel 3's loss from
  pair log-probs and the `SampledTokenSettings` (for recipes that collect the pairs themselves)
- ``fused``: ``fused_linear_jsd``, channel 2's generalized JSD from last hidden states through the
  output layer (no ``(B, T, V)`` logits; backends ``FUSED_JSD_BACKENDS``: PyTorch, our Triton
  kernels, Liger-Kernel), and ``fused_linear_logps``, the log-probs of given tokens from last
  hidden states (channel 3's ``fused_replay_term``; no ``(B, T, V)`` logits)
- log-probs: ``selective_log_softmax`` (from logits), ``completion_logps`` (from a causal LM);
  the model protocols ``CausalLM`` and ``HiddenStateLM`` (a causal LM's body)
- ``loss_settings``: the one list of loss settings, each declared once with its type, default,
  check and help: ``Channel1Settings``, ``SampledTokenSettings`` (what works on sampled-token
  log-probs alone), ``Channel23Settings`` (those and channel 2's full-vocabulary settings) and
  ``LossSettings`` (channels 1-3); the trainer's settings, the TOML ``[loss]`` section,
  ``ComposeConfig`` and the PRIME-RL recipe's config inherit them
- ``ComposeConfig``: every keyword and its default (``LossSettings`` + the run's ``temperature``
  and ``taid_schedule_step``); ``TAID_T_START``/``TAID_T_END`` and the choice tuples
  ``LOSS_TYPES``, ``SDPO_WRAPPERS``, ``DPO_VARIANTS`` (and their types ``LossType``,
  ``SdpoWrapper``, ``DpoVariant``; ``SdpoWrapper`` is a name in ``sdpo_wrappers``' registry)
- ``sdpo_wrappers``: channel 2's divergences by name (the ``sdpo_wrapper`` setting), a seam

Every loss returns ``(loss, metrics)``: a 0-dim tensor and a dict of python floats.
"""

from composer_replication.loss import sdpo_wrappers
from composer_replication.loss._channels import replay_preference
from composer_replication.loss._logprobs import (
    CausalLM,
    HiddenStateLM,
    completion_logps,
    selective_log_softmax,
)
from composer_replication.loss.compose import (
    ComposeConfig,
    assemble,
    combine,
    compose_loss,
    fused_replay_term,
    fused_sdpo_term,
    replay_term,
    sdpo_term,
)
from composer_replication.loss.distill import (
    TAID_ALPHA,
    TAID_BETA,
    TAID_T_END,
    TAID_T_START,
    TAIDScheduler,
    entropy_opd_loss,
    generalized_jsd,
    taid_loss,
)
from composer_replication.loss.fused import FUSED_JSD_BACKENDS, fused_linear_jsd, fused_linear_logps
from composer_replication.loss.loss_settings import (
    DPO_VARIANTS,
    SDPO_WRAPPERS,
    Channel1Settings,
    Channel23Settings,
    DpoVariant,
    LossSettings,
    SampledTokenSettings,
    SdpoWrapper,
    WriteOnce,
    setting_names,
)
from composer_replication.loss.policy import LOSS_TYPES, LossType, dppo_mask, grpo_loss
from composer_replication.loss.preference import dpo_loss, simpo_loss

__all__ = [
    "DPO_VARIANTS",
    "FUSED_JSD_BACKENDS",
    "LOSS_TYPES",
    "SDPO_WRAPPERS",
    "TAID_ALPHA",
    "TAID_BETA",
    "TAID_T_END",
    "TAID_T_START",
    "CausalLM",
    "Channel1Settings",
    "Channel23Settings",
    "ComposeConfig",
    "DpoVariant",
    "HiddenStateLM",
    "LossSettings",
    "LossType",
    "SampledTokenSettings",
    "SdpoWrapper",
    "TAIDScheduler",
    "WriteOnce",
    "assemble",
    "combine",
    "completion_logps",
    "compose_loss",
    "dpo_loss",
    "dppo_mask",
    "entropy_opd_loss",
    "fused_linear_jsd",
    "fused_linear_logps",
    "fused_replay_term",
    "fused_sdpo_term",
    "generalized_jsd",
    "grpo_loss",
    "replay_preference",
    "replay_term",
    "sdpo_term",
    "sdpo_wrappers",
    "selective_log_softmax",
    "setting_names",
    "simpo_loss",
    "taid_loss",
]
