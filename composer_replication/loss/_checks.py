"""Input validation shared by the loss modules.

Every loss validates at its edge and raises ``ValueError`` naming the offending argument, so a
wrong shape or a NaN coming out of a rollout worker fails loudly instead of turning into a silent
NaN loss several steps later.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor


def check_tensor(name: str, x: object, *, ndim: int | None = None) -> Tensor:
    """Return ``x`` if it is a tensor (of rank ``ndim`` when given), else raise ValueError."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_same_shape(name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    """Raise ValueError unless ``x`` has exactly the shape of ``ref``."""
    if x.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
            "they must match"
        )


def check_finite(name: str, x: Tensor, mask: Tensor | None = None) -> None:
    """Raise ValueError if ``x`` holds NaN/Inf (only where ``mask`` is true, when given).

    Positions outside the mask (padding) are allowed to hold anything: they never reach the loss.
    """
    bad = ~torch.isfinite(x.detach())
    if mask is not None:
        bad = bad & mask.bool()
    if bool(bad.any()):
        raise ValueError(
            f"{name} contains NaN or Inf values{' at unmasked positions' if mask is not None else ''}; "
            "check the upstream computation (e.g. log-probs of -inf logits, overflow in fp16)"
        )


def check_scalar(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Validate a finite python scalar lies in [low, high] (open ends when ``*_open``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars welcome
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (v < low or (low_open and v == low)):
        bracket = "(" if low_open else "["
        raise ValueError(
            f"{name} must be in {bracket}{low}, {high}{')' if high_open else ']'}, got {v}"
        )
    if high is not None and (v > high or (high_open and v == high)):
        bracket = ")" if high_open else "]"
        raise ValueError(
            f"{name} must be in {'(' if low_open else '['}{low}, {high}{bracket}, got {v}"
        )
    return v


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(
            f"unknown {name}={value!r}; expected one of {', '.join(map(repr, choices))}"
        )
    return str(value)


def as_bool_mask(name: str, mask: Tensor | None, shape: torch.Size, device: torch.device) -> Tensor:
    """Turn an optional 0/1 (bool/int/float) mask of ``shape`` into a bool tensor (None = all true)."""
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    check_tensor(name, mask)
    if mask.shape != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    return mask.bool()
