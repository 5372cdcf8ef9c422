"""The ``int8`` codec: symmetric per-block absmax scaling (1 B per element + 4 B per block).

``q = round(x / s)`` with ``s = absmax / 127`` per block of :data:`codec_blocks.CHUNK`
elements; absolute error <= s / 2 per element. Parts: ``q`` int8 ``[numel]``, ``s`` float32
``[blocks]``. Non-finite values are refused when encoding (a NaN/inf scale would poison its
whole block silently), and a received payload with a negative or non-finite scale is refused.
"""

from __future__ import annotations

import torch

from composer_replication.exchange.codec_blocks import (
    DecodePass,
    DenseCodec,
    PartLayout,
    Parts,
    as_float32,
    check_finite,
    nonzero,
    num_blocks,
    one_thread,
    passes,
    scratch,
    step_bound,
)

__all__ = ["NAME", "Int8Codec"]

NAME = "int8"


class Int8Codec(DenseCodec):
    """int8 codes with a float32 scale per block (see the module docstring)."""

    name = NAME

    def layout(self, numel: int) -> PartLayout:
        return {"q": (torch.int8, (numel,)), "s": (torch.float32, (num_blocks(numel),))}

    def encode(self, t: torch.Tensor) -> Parts:
        flat = t.detach().reshape(-1).to(device="cpu").contiguous()
        with one_thread():
            n = flat.numel()
            work = scratch(n)
            convert = None if flat.dtype == torch.float32 else torch.empty_like(work)
            scale = torch.zeros(num_blocks(n), dtype=torch.float32)
            q = torch.empty(n, dtype=torch.int8)
            for b0, b1, e0, e1 in passes(n):
                x = as_float32(flat[e0:e1], convert).view(b1 - b0, -1)
                w = work[: e1 - e0].view(b1 - b0, -1)
                s = scale[b0:b1]
                torch.amax(torch.abs(x, out=w), dim=1, out=s)  # NaN/inf propagate into the scale
                s.div_(127.0)
                torch.div(x, nonzero(s)[:, None], out=w).round_().clamp_(-127, 127)
                q[e0:e1].view(b1 - b0, -1).copy_(w)
            check_finite(scale, self.name)
            return {"q": q, "s": scale}

    def check_parts(self, parts: Parts, numel: int) -> str | None:
        s = parts["s"]
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            return f"codec {self.name!r}: a per-block scale is negative or not finite"
        return None

    def decode_pass(self, parts: Parts, out_numel: int) -> DecodePass:
        q, scale = parts["q"], parts["s"]

        def run(b0: int, b1: int, e0: int, e1: int, dst: torch.Tensor) -> None:
            rows = dst.view(b1 - b0, -1)
            torch.mul(q[e0:e1].view(b1 - b0, -1), scale[b0:b1, None], out=rows)

        return run

    def max_abs_error_bound(self, t: torch.Tensor) -> torch.Tensor:
        return step_bound(t, lambda x: x.abs().amax(dim=1, keepdim=True) / 127.0)
