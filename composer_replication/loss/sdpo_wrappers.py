"""Channel 2's divergence, by name: the `SdpoWrapperImpl` seam and its registry.

The ``sdpo_wrapper`` setting names one entry of ``_REGISTRY`` (name -> ``"module:Class"``,
imported on first use): ``"none"`` (the generalized JSD, `distill.generalized_jsd`), ``"taid"``
(`distill.taid_loss`, t fixed or on a linear schedule) and ``"entropy_opd"``
(`distill.entropy_opd_loss`). Callers ask the wrapper instead of comparing its name:

- ``check(s)``: its rules across settings (``ComposeConfig.__post_init__`` calls it; a
  ``ValueError``);
- ``needs_schedule(s)``: whether a setting of it is driven at run time (TAID without ``taid_t``
  nor ``taid_schedule_step``: the trainer adds its ``TAIDCallback``);
- ``divergence(s, student, teacher, token_mask)``: the loss over ``(b, T, V)`` student and
  teacher logits with a ``(b, T)`` token mask, the token mean over the mask, and its metrics;
- ``step_metrics(s)``: the metrics it reports on every step channel 2 is on (TAID's ``taid/t``);
- ``fused_ok``: whether ``compose.fused_sdpo_term`` (the generalized JSD fused with the output
  layer) computes it; only ``"none"`` today.

A wrapper reads the settings through `WrapperSettings` (the channel-2 fields of
``ComposeConfig``; structural, so this module imports no config). Adding one: its class (here
or in a module of its own), one line in ``_REGISTRY``, its tests and its row in docs/channels.md
(ARCHITECTURE.md, "Where to add"); the ``sdpo_wrapper`` setting accepts every registered name.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from torch import Tensor

from composer_replication.loss._checks import check_choice
from composer_replication.loss.distill import (
    TAID_T_END,
    TAID_T_START,
    entropy_opd_loss,
    generalized_jsd,
    taid_loss,
)

__all__ = [
    "EntropyOpdWrapper",
    "JsdWrapper",
    "PlainWrapper",
    "SdpoWrapperImpl",
    "TaidWrapper",
    "WrapperSettings",
    "check_wrapper",
    "get",
    "names",
    "taid_t_for",
]

Result = tuple[Tensor, dict[str, float]]


class WrapperSettings(Protocol):
    """The settings a wrapper reads (``ComposeConfig`` has them all)."""

    @property
    def sdpo_jsd_beta(self) -> float: ...
    @property
    def sdpo_temperature(self) -> float: ...
    @property
    def sdpo_token_clip(self) -> float | None: ...
    @property
    def sdpo_top_k(self) -> int | None: ...
    @property
    def sdpo_add_tail(self) -> bool: ...
    @property
    def taid_t(self) -> float | None: ...
    @property
    def taid_total_steps(self) -> int | None: ...
    @property
    def taid_schedule_step(self) -> int | None: ...
    @property
    def entropy_opd_h_max(self) -> float: ...


class SdpoWrapperImpl(Protocol):
    """One channel-2 divergence (see the module docstring for each member)."""

    fused_ok: bool

    def check(self, s: WrapperSettings) -> None: ...

    def needs_schedule(self, s: WrapperSettings) -> bool: ...

    def divergence(
        self, s: WrapperSettings, student: Tensor, teacher: Tensor, token_mask: Tensor
    ) -> Result: ...

    def step_metrics(self, s: WrapperSettings) -> dict[str, float]: ...


class PlainWrapper:
    """The members of a wrapper with no rule of its own, no schedule and no per-step metric."""

    fused_ok = False

    def check(self, s: WrapperSettings) -> None:
        return None

    def needs_schedule(self, s: WrapperSettings) -> bool:
        return False

    def step_metrics(self, s: WrapperSettings) -> dict[str, float]:
        return {}


class JsdWrapper(PlainWrapper):
    """``"none"``: the generalized JSD (its top-k and token clip included); the fused one."""

    fused_ok = True

    def divergence(
        self, s: WrapperSettings, student: Tensor, teacher: Tensor, token_mask: Tensor
    ) -> Result:
        return generalized_jsd(
            student,
            teacher,
            beta=s.sdpo_jsd_beta,
            temperature=s.sdpo_temperature,
            mask=token_mask,
            token_clip=s.sdpo_token_clip,
            top_k=s.sdpo_top_k,
            add_tail=s.sdpo_add_tail,
        )


def taid_t_for(s: WrapperSettings) -> float:
    """TAID t: ``taid_t`` if given, else linear ``TAID_T_START -> TAID_T_END`` over
    ``taid_schedule_step / taid_total_steps``."""
    if s.taid_t is not None:
        return float(s.taid_t)
    assert s.taid_schedule_step is not None and s.taid_total_steps is not None
    progress = min(float(s.taid_schedule_step) / float(s.taid_total_steps), 1.0)
    return TAID_T_START + (TAID_T_END - TAID_T_START) * progress


class TaidWrapper(PlainWrapper):
    """``"taid"``: `distill.taid_loss` at `taid_t_for`; reports ``taid/t`` every step."""

    def check(self, s: WrapperSettings) -> None:
        if s.taid_t is None and s.taid_schedule_step is None:
            raise ValueError(
                "sdpo_wrapper='taid' needs taid_t (the interpolation coefficient in [0, 1]) or "
                "taid_schedule_step with taid_total_steps (linear "
                f"{TAID_T_START} -> {TAID_T_END} schedule)"
            )
        if s.taid_t is None and s.taid_total_steps is None:
            raise ValueError("taid_schedule_step is given without taid_total_steps; pass both")

    def needs_schedule(self, s: WrapperSettings) -> bool:
        return s.taid_t is None and s.taid_schedule_step is None

    def divergence(
        self, s: WrapperSettings, student: Tensor, teacher: Tensor, token_mask: Tensor
    ) -> Result:
        t = taid_t_for(s)
        return taid_loss(student, teacher, t, mask=token_mask, temperature=s.sdpo_temperature)

    def step_metrics(self, s: WrapperSettings) -> dict[str, float]:
        return {"taid/t": taid_t_for(s)}


class EntropyOpdWrapper(PlainWrapper):
    """``"entropy_opd"``: `distill.entropy_opd_loss` gated at ``entropy_opd_h_max``."""

    def divergence(
        self, s: WrapperSettings, student: Tensor, teacher: Tensor, token_mask: Tensor
    ) -> Result:
        return entropy_opd_loss(
            student,
            teacher,
            h_max=s.entropy_opd_h_max,
            mask=token_mask,
            temperature=s.sdpo_temperature,
        )


_REGISTRY: dict[str, str] = {
    "none": "composer_replication.loss.sdpo_wrappers:JsdWrapper",
    "taid": "composer_replication.loss.sdpo_wrappers:TaidWrapper",
    "entropy_opd": "composer_replication.loss.sdpo_wrappers:EntropyOpdWrapper",
}
_BUILT: dict[str, SdpoWrapperImpl] = {}


def names() -> tuple[str, ...]:
    """Every registered wrapper's name, in registration order."""
    return tuple(_REGISTRY)


def check_wrapper(name: str) -> str:
    """Return ``name`` if it is a registered wrapper, else raise ValueError listing them."""
    return check_choice("sdpo_wrapper", name, names())


def get(name: str) -> SdpoWrapperImpl:
    """The wrapper ``name`` (ValueError for an unknown name), imported on first use."""
    path = _REGISTRY[check_wrapper(name)]
    built = _BUILT.get(path)
    if built is None:
        module, _, cls = path.partition(":")
        built = _BUILT[path] = getattr(importlib.import_module(module), cls)()
    return built
