"""Frozen model copies: the EMA teacher of channel 2 and in-memory reference models.

A copy is made with ``copy.deepcopy``. TRL patches ``model.forward`` with a fused-LM-head wrapper
whose closure points at the *original* model's forward; a deep copy would carry that instance
attribute along and silently run the original weights. `frozen_copy` therefore drops the
instance-level ``forward`` so the copy uses its own class forward.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def frozen_copy(model: nn.Module) -> nn.Module:
    """An eval-mode, no-grad deep copy of ``model`` running its own (unpatched) forward."""
    clone = copy.deepcopy(model)
    clone.__dict__.pop("forward", None)
    clone.requires_grad_(False)
    clone.eval()
    return clone


class EMATeacher:
    """``teacher <- (1 - rate) * teacher + rate * student`` after every optimizer step.

    ``rate`` = SDPO's teacher update rate (the trainer's ``sdpo_ema_rate``): the teacher lags the
    student, which keeps the distillation target from chasing the student's own noise.
    """

    def __init__(self, student: nn.Module, rate: float) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"sdpo_ema_rate must be in (0, 1], got {rate}")
        self.rate = rate
        self.model = frozen_copy(student)

    @torch.no_grad()
    def update(self, student: nn.Module) -> None:
        teacher_params = dict(self.model.named_parameters())
        for name, param in student.named_parameters():
            target = teacher_params.get(name)
            if target is None:
                continue
            target.lerp_(param.detach().to(target.dtype), self.rate)
        teacher_buffers = dict(self.model.named_buffers())
        for name, buf in student.named_buffers():
            if name in teacher_buffers:
                teacher_buffers[name].copy_(buf)
