"""The `[loss]` section: the loss library's settings as the run's TOML keys.

`LossConfig` is `loss_settings.LossSettings` (each key's type, default, help and check, declared
once there) made immutable by `WriteOnce`, with the rules across settings checked by
`ComposeConfig` and reworded to name the TOML key (``loss.<name>: ...``). Like all of loss/, it
imports nothing of ours outside loss/ (so not `fields.require`: its two checks raise directly).
The run schema (`config.schema.RunConfig`) composes it; the run sets the two `ComposeConfig`
keywords that are not `[loss]` keys (`config.schema.LOSS_KEYS_SET_BY_THE_RUN`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer_replication.loss._config import ComposeConfig
from composer_replication.loss.loss_settings import LossSettings, WriteOnce

__all__ = ["LossConfig"]


@dataclass(kw_only=True)
class LossConfig(LossSettings, WriteOnce):
    """The composer loss: the loss library's `LossSettings` (see docs/api.md).

    Each key's type, default, help and check is declared once, in loss/loss_settings.py; this
    class inherits them. Immutable as the other sections, through `WriteOnce` (a frozen
    dataclass cannot inherit the settings, mutable because TRL's `GRPOConfig` shares them)."""

    def __post_init__(self) -> None:
        # fields.require's message, written out: loss/ imports nothing of ours outside itself
        # (tests/loss/test_loss_architecture.py), not even the floor's helpers.
        if self.alpha_sdpo < 0:
            raise ValueError("loss.alpha_sdpo: must be >= 0")
        if self.beta_replay < 0:
            raise ValueError("loss.beta_replay: must be >= 0")
        scheduled = self.sdpo_wrapper == "taid" and self.taid_t is None
        if scheduled and self.taid_total_steps is None:
            raise ValueError(
                "loss.sdpo_wrapper: 'taid' needs loss.taid_t or loss.taid_total_steps "
                "(a fixed t or a schedule length)"
            )
        # Every other rule is the loss library's: each setting's own check (LossSettings) and the
        # rules across them (ComposeConfig; a scheduled TAID starts at step 0).
        kwargs = self.compose_kwargs()
        if scheduled:
            kwargs["taid_schedule_step"] = 0
        try:
            ComposeConfig(**kwargs)
        except ValueError as exc:  # "<key> must be ...": name it as the TOML key
            key, _, rest = str(exc).partition(" ")
            where = f"loss.{key}: {rest}" if key in self.__dataclass_fields__ else f"loss: {exc}"
            raise ValueError(where) from None

    def compose_kwargs(self) -> dict[str, Any]:
        """The compose_loss keyword arguments (unset optionals omitted)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {k: v for k, v in out.items() if v is not None}
