"""The ``bf16`` codec: every element rounded to bfloat16 (2 B), relative error <= 2**-8.

Part ``q``: bfloat16 ``[numel]``, round-to-nearest-even; float64 inputs go through float32 first
(one rounding rule for every input dtype). Non-finite values pass through.
"""

from __future__ import annotations

import torch

from composer_replication.exchange.codec_blocks import DecodePass, DenseCodec, PartLayout, Parts

__all__ = ["NAME", "Bf16Codec"]

NAME = "bf16"


class Bf16Codec(DenseCodec):
    """bfloat16 on the wire (see the module docstring)."""

    name = NAME

    def layout(self, numel: int) -> PartLayout:
        return {"q": (torch.bfloat16, (numel,))}

    def encode(self, t: torch.Tensor) -> Parts:
        flat = t.detach().reshape(-1).to(device="cpu")
        src = flat.to(torch.float32) if flat.dtype == torch.float64 else flat
        return {"q": src.to(torch.bfloat16).contiguous()}

    def decode_pass(self, parts: Parts, out_numel: int) -> DecodePass:
        q = parts["q"]

        def run(b0: int, b1: int, e0: int, e1: int, dst: torch.Tensor) -> None:
            dst.copy_(q[e0:e1])

        return run

    def max_abs_error_bound(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        return flat.abs() * 2.0**-8
