"""Exact resume of a trainer: the state that decides how training continues, and its checks.

`ComposerReplicationTrainer.resume_state()` returns, after an optimizer step, everything a
fresh trainer of the same run needs to continue bit-exactly (`ComposerReplicationTrainer.
resume_train(state)`): a nested dict of tensors and JSON scalars (no pickle; the run layer
stores it as safetensors + a JSON skeleton)::

    format                   RESUME_FORMAT
    global_step, epoch       the trainer's optimizer step and epoch (float, as TrainerState)
    micro_step               TRL's micro-batch counter (decides when it generates)
    num_input_tokens_seen, total_flos
    model                    {name: tensor}  the policy's state dict
    optimizer                the inner optimizer's state_dict (AdamW: step, exp_avg, exp_avg_sq)
    scheduler                the LR scheduler's state_dict (None without one)
    sampler_epoch_start      the data sampler's generator state at the start of the current
                             epoch (uint8 tensor; None for an unshuffled sampler): with
                             global_step it fixes the data position (HF skips the batches
                             already trained in this epoch)
    rng                      {"python": random.getstate(), "numpy": {...}, "torch": uint8
                             tensor, "cuda": [uint8 tensor per device]}
    taid                     {"t", "pending_losses", "scheduler": TAIDScheduler.state_dict()}
                             or None
    ema                      {name: tensor}: channel 2's EMA teacher, or None
    replay                   {"traces": [TraceRecord JSON the teacher pool added], "reference_
                             cache": [[prompt_key, teacher, text, length, logp], ...]} or None
    sdpo_gate                channel 2's teacher-gate window (`gate.TeacherGate.state()`: the
                             last probed teacher-minus-student differences, floats)

Every part is checked against the trainer before anything is applied (names, shapes and dtypes
of the model, the EMA teacher and the optimizer's per-parameter state; finite values), and a
mismatch raises `ResumeStateError` naming the part.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = [
    "RESUME_FORMAT",
    "EpochSampler",
    "ResumeStateError",
    "check_tensors",
    "get_rng_state",
    "set_rng_state",
]

RESUME_FORMAT = 1


class ResumeStateError(ValueError):
    """A resume state that does not fit this trainer (or is malformed)."""


class EpochSampler(Sampler[int]):
    """Wraps the training sampler (TRL's ``RepeatSampler``) and remembers its generator's state
    at the start of each epoch, before the epoch's permutation is drawn: with the number of
    batches already trained in the epoch, that state fixes the data position exactly.
    ``restore_epoch_start(state)`` makes the next epoch start from a saved state."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.epoch_start_state: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None

    @property
    def generator(self) -> torch.Generator | None:
        gen = getattr(self.inner, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None

    def restore_epoch_start(self, state: torch.Tensor | None) -> None:
        if state is not None and self.generator is None:
            raise ResumeStateError("sampler_epoch_start is set but this sampler does not shuffle")
        self._pending = None if state is None else state.clone()

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        gen = self.generator
        if gen is not None:
            if self._pending is not None:
                try:
                    gen.set_state(self._pending)
                except RuntimeError as exc:
                    raise ResumeStateError(f"sampler_epoch_start: {exc}") from None
                self._pending = None
            self.epoch_start_state = gen.get_state()
        yield from self.inner


def get_rng_state() -> dict[str, object]:
    """python, numpy, torch (CPU) and CUDA generator states as tensors and JSON scalars."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, object] = {
        "python": [int(version), [int(x) for x in internal], gauss],
        "numpy": {
            "name": str(name),
            "keys": [int(x) for x in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore `get_rng_state`'s output; ResumeStateError naming the generator on bad input."""
    try:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ResumeStateError(f"rng.python is not a python random state ({exc})") from None
    try:
        n = state["numpy"]
        keys = np.asarray(n["keys"], dtype=np.uint32)
        np.random.set_state(
            (str(n["name"]), keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ResumeStateError(f"rng.numpy is not a numpy random state ({exc})") from None
    t = state.get("torch")
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise ResumeStateError("rng.torch must be a uint8 tensor (torch.get_rng_state())")
    try:
        torch.set_rng_state(t)
    except RuntimeError as exc:
        raise ResumeStateError(f"rng.torch: {exc}") from None
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ResumeStateError(
                f"rng.cuda holds {len(cuda)} device states, this machine has "
                f"{torch.cuda.device_count()} GPUs"
            )
        torch.cuda.set_rng_state_all(cuda)


def check_tensors(part: str, got: object, expected: Mapping[str, torch.Tensor]) -> None:
    """`got` must hold exactly `expected`'s names with the same shapes and dtypes, all finite."""
    if not isinstance(got, Mapping):
        raise ResumeStateError(f"{part} must be a dict of tensors")
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise ResumeStateError(
            f"{part} does not match this model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name, ref in expected.items():
        t = got[name]
        if not isinstance(t, torch.Tensor):
            raise ResumeStateError(f"{part}.{name} is not a tensor")
        if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype:
            raise ResumeStateError(
                f"{part}.{name}: stored {tuple(t.shape)} {t.dtype}, this model has "
                f"{tuple(ref.shape)} {ref.dtype}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ResumeStateError(f"{part}.{name} holds non-finite values")


def check_optimizer_state(state: object, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer state_dict that fits `optimizer`: same groups, per-parameter tensors of the
    parameters' shapes, finite values."""
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), list):
        raise ResumeStateError("optimizer must be an optimizer state_dict")
    groups = state["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ResumeStateError(
            f"optimizer has {len(groups)} parameter groups, this trainer {len(optimizer.param_groups)}"
        )
    params: dict[int, torch.Tensor] = {}
    for stored, live in zip(groups, optimizer.param_groups):
        ids = stored.get("params") if isinstance(stored, Mapping) else None
        if not isinstance(ids, list) or len(ids) != len(live["params"]):
            raise ResumeStateError("optimizer parameter groups differ in size from this trainer's")
        params.update(zip(ids, live["params"]))
    per_param = state.get("state")
    if not isinstance(per_param, Mapping):
        raise ResumeStateError("optimizer.state must be a dict")
    for idx, entry in per_param.items():
        if idx not in params or not isinstance(entry, Mapping):
            raise ResumeStateError(f"optimizer.state has an entry {idx!r} for no parameter")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                if value.dim() > 0 and tuple(value.shape) != tuple(params[idx].shape):
                    raise ResumeStateError(
                        f"optimizer.state[{idx}].{key}: shape {tuple(value.shape)}, parameter "
                        f"{tuple(params[idx].shape)}"
                    )
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise ResumeStateError(f"optimizer.state[{idx}].{key} holds non-finite values")
            elif isinstance(value, float) and not math.isfinite(value):
                raise ResumeStateError(f"optimizer.state[{idx}].{key} is not finite")


def require(state: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``state[key]`` if it is a `kind`, else ResumeStateError."""
    value = state.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ResumeStateError(f"resume state: {key!r} is missing or not a {kind}")
    return value
