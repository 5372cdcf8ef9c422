"""The ``4bit`` codec: per-block min-max uint4 (0.5 B per element + 8 B per block).

``q = round((x - lo) / s)`` with ``s = (hi - lo) / 15`` per block of
:data:`codec_blocks.CHUNK` elements, two codes packed per byte, the even element in the low
nibble; absolute error <= s / 2 per element. Parts: ``q`` uint8 ``[ceil(numel / 2)]``, ``s``
and ``z`` (the block's ``lo``) float32 ``[blocks]``. Non-finite values, and blocks whose
``max - min`` overflows float32, are refused when encoding; a received payload with a negative
or non-finite scale or a non-finite offset is refused.
"""

from __future__ import annotations

import sys

import torch

from composer_replication.exchange.codec_blocks import (
    CHUNK,
    PASS_BLOCKS,
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

__all__ = ["NAME", "Uint4Codec"]

NAME = "4bit"
# (un)packing two nibbles through an int16 view needs the low byte first; else: strided ops
_LITTLE_ENDIAN = sys.byteorder == "little"


class Uint4Codec(DenseCodec):
    """Packed 4-bit codes with a float32 scale and offset per block (see the module doc)."""

    name = NAME

    def layout(self, numel: int) -> PartLayout:
        rows = num_blocks(numel)
        return {
            "q": (torch.uint8, ((numel + 1) // 2,)),
            "s": (torch.float32, (rows,)),
            "z": (torch.float32, (rows,)),
        }

    def encode(self, t: torch.Tensor) -> Parts:
        flat = t.detach().reshape(-1).to(device="cpu").contiguous()
        with one_thread():
            n = flat.numel()
            work = scratch(n)
            convert = None if flat.dtype == torch.float32 else torch.empty_like(work)
            scale = torch.zeros(num_blocks(n), dtype=torch.float32)
            lo = torch.zeros(num_blocks(n), dtype=torch.float32)
            packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
            codes8 = torch.empty(work.numel() + 1, dtype=torch.int8)  # a pass's codes, even length
            pairs16 = torch.empty(codes8.numel() // 2, dtype=torch.int16)
            for b0, b1, e0, e1 in passes(n):
                m = e1 - e0
                x = as_float32(flat[e0:e1], convert).view(b1 - b0, -1)
                w = work[:m].view(b1 - b0, -1)
                s, z = scale[b0:b1], lo[b0:b1]
                torch.amin(x, dim=1, out=z)
                torch.amax(x, dim=1, out=s)
                s.sub_(z).div_(15.0)  # (hi - lo) / 15: inf if the block is non-finite or overflows
                torch.sub(x, z[:, None], out=w).div_(nonzero(s)[:, None]).round_().clamp_(0, 15)
                work[m] = 0.0  # high nibble of an odd-length tensor's last byte
                _pack_nibbles(work[: m + m % 2], codes8, pairs16, packed[e0 // 2 : (e1 + 1) // 2])
            check_finite(scale, self.name, ", or a block whose max - min overflows float32")
            return {"q": packed, "s": scale, "z": lo}

    def check_parts(self, parts: Parts, numel: int) -> str | None:
        s = parts["s"]
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            return f"codec {self.name!r}: a per-block scale is negative or not finite"
        if not bool(torch.isfinite(parts["z"]).all()):
            return f"codec {self.name!r}: a per-block offset is not finite"
        return None

    def decode_pass(self, parts: Parts, out_numel: int) -> DecodePass:
        q, scale, offset = parts["q"], parts["s"], parts["z"]
        # unpacking: two int16 buffers of one pass's bytes (codes, high nibbles)
        pass_bytes = (min(out_numel, PASS_BLOCKS * CHUNK) + 1) // 2
        unpack = torch.empty(2, pass_bytes, dtype=torch.int16)

        def run(b0: int, b1: int, e0: int, e1: int, dst: torch.Tensor) -> None:
            m = e1 - e0
            byte = q[e0 // 2 : (e1 + 1) // 2]
            if _LITTLE_ENDIAN:
                # byte b -> int16 (b & 0x0F) | (b & 0xF0) << 4: as two bytes, low then high
                v = unpack[0, : byte.numel()].copy_(byte)
                hi = torch.bitwise_and(v, 0xF0, out=unpack[1, : byte.numel()])
                hi.bitwise_left_shift_(4)
                v.bitwise_and_(0x0F).bitwise_or_(hi)
                dst.copy_(v.view(torch.uint8)[:m])
            else:
                codes = torch.empty(m + m % 2, dtype=torch.float32).view(-1, 2)
                codes[:, 0].copy_(byte & 0x0F)
                codes[:, 1].copy_(byte >> 4)
                dst.copy_(codes.view(-1)[:m])
            rows = dst.view(b1 - b0, -1)
            rows.mul_(scale[b0:b1, None]).add_(offset[b0:b1, None])

        return run

    def max_abs_error_bound(self, t: torch.Tensor) -> torch.Tensor:
        return step_bound(
            t, lambda x: (x.amax(dim=1, keepdim=True) - x.amin(dim=1, keepdim=True)) / 15.0
        )


def _pack_nibbles(
    codes: torch.Tensor, codes8: torch.Tensor, pairs16: torch.Tensor, dst: torch.Tensor
) -> None:
    """Codes 0..15 (float32, even length) -> bytes ``even | odd << 4`` into ``dst`` (uint8)."""
    if _LITTLE_ENDIAN:
        # two int8 codes a, b read as one int16 are a + 256 b; (v | v >> 4) has a + 16 b as its
        # low byte, which the int16 -> uint8 conversion keeps
        c = codes8[: codes.numel()].copy_(codes)
        v = c.view(torch.int16)
        p = torch.bitwise_right_shift(v, 4, out=pairs16[: v.numel()]).bitwise_or_(v)
        dst.copy_(p)
    else:
        pairs = codes.view(-1, 2)
        dst.copy_(torch.add(pairs[:, 0], pairs[:, 1], alpha=16))  # exact: small integers
