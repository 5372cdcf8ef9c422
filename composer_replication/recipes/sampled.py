"""What the sampled-token recipes (verl, PRIME-RL) share: which ``compose_loss`` keywords apply.

Both frameworks hand a custom loss the log-probs of the SAMPLED tokens only, never the logits. So
of ``ComposeConfig``'s keywords, the channel-2/3 weights and the preference-loss settings apply
(``SAMPLED_TOKEN_KEYS``, defaults from ``ComposeConfig``); the full-vocabulary divergence settings
(``sdpo_*``, ``taid_*``, ``entropy_opd_h_max``) have nothing to act on, and channel 1 is the
framework's own policy loss, configured where the framework configures it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from composer_replication.loss import ComposeConfig

SAMPLED_TOKEN_KEYS = (
    "alpha_sdpo",
    "beta_replay",
    "dpo_variant",
    "replay_dpo_beta",
    "simpo_beta",
    "simpo_gamma",
    "label_smoothing",
)


def reject_logit_keywords(kwargs: Mapping[str, object], recipe: str, channel1_hint: str) -> None:
    """ValueError naming every ``compose_loss`` keyword in ``kwargs`` that needs logits or names
    a channel-1 setting the framework owns; ``channel1_hint`` says where those are set instead."""
    compose_only = {f.name for f in dataclasses.fields(ComposeConfig)} - set(SAMPLED_TOKEN_KEYS)
    bad = sorted(k for k in kwargs if k in compose_only)
    if bad:
        raise ValueError(
            f"{', '.join(bad)}: compose_loss keyword(s) that do not apply to the {recipe} recipe. "
            f"Channel 1 is {channel1_hint}; channel 2 sees only sampled-token log-probs, not "
            "logits, so the full-vocabulary divergence settings (sdpo_*, taid_*, "
            "entropy_opd_h_max) have nothing to act on"
        )


def sampled_token_config(kwargs: Mapping[str, Any]) -> ComposeConfig:
    """``ComposeConfig`` from the ``SAMPLED_TOKEN_KEYS`` in ``kwargs`` (validated there)."""
    return ComposeConfig(**{k: kwargs[k] for k in SAMPLED_TOKEN_KEYS if k in kwargs})
