"""What the sampled-token recipes (verl, PRIME-RL) share: which ``compose_loss`` keywords apply.

Both frameworks hand a custom loss the log-probs of the SAMPLED tokens only, never the logits. So
of ``ComposeConfig``'s keywords, the loss library's ``SampledTokenSettings`` apply (the channel-2/3
weights and the preference-loss settings; ``SAMPLED_TOKEN_KEYS``, their names, derived from that
one declaration with its defaults, checks and help); the full-vocabulary divergence settings
(``sdpo_*``, ``taid_*``, ``entropy_opd_h_max``) have nothing to act on, and channel 1 is the
framework's own policy loss, configured where the framework configures it. PRIME-RL's
``PrimeRLLossConfig`` inherits ``SampledTokenSettings``; verl's policy loss validates its
keywords with `sampled_token_config` and forwards them with `sampled_token_kwargs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from composer_replication.loss import ComposeConfig, SampledTokenSettings, setting_names

SAMPLED_TOKEN_KEYS: tuple[str, ...] = setting_names(SampledTokenSettings)


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


def sampled_token_config(kwargs: Mapping[str, object]) -> ComposeConfig:
    """``ComposeConfig`` from the ``SAMPLED_TOKEN_KEYS`` in ``kwargs`` (validated there)."""
    return ComposeConfig.from_kwargs({k: kwargs[k] for k in SAMPLED_TOKEN_KEYS if k in kwargs})


def sampled_token_kwargs(cfg: SampledTokenSettings) -> dict[str, Any]:
    """The ``SAMPLED_TOKEN_KEYS`` values of ``cfg``, as ``combine`` / ``assemble`` keywords
    (``Any``: their types are the fields', which a ``**`` argument cannot tell mypy)."""
    return {k: getattr(cfg, k) for k in SAMPLED_TOKEN_KEYS}
