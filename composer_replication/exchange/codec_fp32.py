"""The ``fp32`` codec: every element as float32 (4 B); lossless for float32 inputs.

Part ``q``: float32 ``[numel]``. Non-finite values pass through (the screening of the
aggregation refuses them, not the codec). Decoding a payload gives its ``q`` part itself.
"""

from __future__ import annotations

import torch

from composer_replication.exchange.codec_blocks import (
    DecodePass,
    DenseCodec,
    PartLayout,
    Parts,
    check_length,
    check_output,
)

__all__ = ["NAME", "Fp32Codec"]

NAME = "fp32"


class Fp32Codec(DenseCodec):
    """float32 on the wire (see the module docstring)."""

    name = NAME
    zero_copy_decode = True

    def layout(self, numel: int) -> PartLayout:
        return {"q": (torch.float32, (numel,))}

    def encode(self, t: torch.Tensor) -> Parts:
        flat = t.detach().reshape(-1).to(device="cpu")
        return {"q": flat.to(torch.float32).contiguous()}

    def decode(self, parts: Parts, numel: int) -> torch.Tensor:
        """``parts["q"]`` itself, no copy: do not write into it unless you own the parts."""
        return parts["q"]

    def decode_into(
        self,
        parts: Parts,
        out: torch.Tensor,
        *,
        accumulate: bool = False,
        weight: float | None = None,
    ) -> torch.Tensor:
        if weight is None:  # nothing to decode: one pass either way
            check_output(out)
            check_length(out, parts["q"].numel(), out.numel(), self.name)
            return out.add_(parts["q"]) if accumulate else out.copy_(parts["q"])
        return super().decode_into(parts, out, accumulate=accumulate, weight=weight)

    def decode_pass(self, parts: Parts, out_numel: int) -> DecodePass:
        q = parts["q"]

        def run(b0: int, b1: int, e0: int, e1: int, dst: torch.Tensor) -> None:
            dst.copy_(q[e0:e1])

        return run

    def max_abs_error_bound(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.numel())
