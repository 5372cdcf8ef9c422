"""What the dense codecs share: quantisation blocks, streaming passes, one-thread execution.

Blocks are :data:`CHUNK` consecutive elements of the flattened tensor; the last block holds the
remaining ``numel % CHUNK`` elements (its scale is computed from those elements only). A tensor
with no elements still has one block whose scale (and offset) is 0.

Speed: encoding and decoding are streaming passes over :data:`PASS_BLOCKS` blocks at a time
(2 MiB of float32, so the temporaries stay in the L2 cache), with vectorised torch ops and one
reused scratch buffer: the outputs are allocated once at their final size and written slice by
slice, and :func:`stream_decode` dequantises and accumulates straight into a float32 output
(``out += w * decode(parts)``) without materialising the decoded tensor. No Python work per
block, so the cost is a few passes over cache-resident data per 2 MiB: several GB/s per core.

The passes run on one torch thread (the calling thread's intra-op thread count is set to 1 for
the duration and restored; other threads are unaffected): each pass is a dozen small ops, and
forking an OpenMP team per op is slower than the op itself, catastrophically so when several
processes share the cores (measured: 4 replica processes on 2 cores with 2 threads each, 35x
slower than with one).

Every operation of a decode (``q * s``, ``+ z``, ``* w``, ``out + x``) is one elementwise IEEE
float32 op rounded on its own (no fused multiply-add), so every replica that decodes the same
objects in the same order gets bit-identical float32 values, and the result equals decoding to a
full tensor first and summing afterwards.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "CHUNK",
    "PASS_BLOCKS",
    "DecodePass",
    "DenseCodec",
    "NoConfig",
    "PartLayout",
    "Parts",
    "as_float32",
    "check_finite",
    "check_length",
    "check_output",
    "nonzero",
    "num_blocks",
    "one_thread",
    "passes",
    "scratch",
    "step_bound",
    "stream_decode",
]

CHUNK = 2048  # elements per quantisation block: small enough to track local scale, 0.2% overhead
PASS_BLOCKS = 256  # blocks per streaming pass: 256 x 2048 float32 = 2 MiB of scratch

Parts = dict[str, torch.Tensor]
"""A tensor's encoded parts by suffix (``q``, ``s``, ...), as stored on the wire."""
PartLayout = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""Dtype and shape of each encoded part."""
DecodePass = Callable[[int, int, int, int, torch.Tensor], None]
"""Writes the decoded float32 values of blocks [b0, b1) = elements [e0, e1) into ``dst``."""


@dataclass(frozen=True)
class NoConfig:
    """The configuration of a codec that has nothing to configure (its format is fixed)."""


def num_blocks(numel: int) -> int:
    """Quantisation blocks (= per-block scales) of a tensor of ``numel`` elements (>= 1)."""
    return max(1, math.ceil(numel / CHUNK))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the enclosed torch ops on the calling thread alone (its thread count is restored)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def passes(numel: int) -> Iterator[tuple[int, int, int, int]]:
    """(first block, end block, first element, end element) of each streaming pass.

    Full blocks go :data:`PASS_BLOCKS` at a time; a partial last block is a pass of its own, so
    every pass views as ``[blocks, width]``. Element offsets are multiples of CHUNK (even).
    """
    full = numel // CHUNK
    for b0 in range(0, full, PASS_BLOCKS):
        b1 = min(full, b0 + PASS_BLOCKS)
        yield b0, b1, b0 * CHUNK, b1 * CHUNK
    if numel % CHUNK:
        yield full, full + 1, full * CHUNK, numel


def scratch(numel: int) -> torch.Tensor:
    """One pass's float32 work buffer, plus one element (a 4-bit pad code for odd lengths)."""
    return torch.empty(min(numel, PASS_BLOCKS * CHUNK) + 1, dtype=torch.float32)


def as_float32(x: torch.Tensor, convert: torch.Tensor | None) -> torch.Tensor:
    """``x`` itself if float32, else converted into the ``convert`` scratch buffer."""
    if convert is None:
        return x
    return convert[: x.numel()].copy_(x)


def nonzero(scale: torch.Tensor) -> torch.Tensor:
    """Scales with 0 replaced by 1 (an all-equal block: every code is 0, decoding is exact)."""
    return torch.where(scale > 0, scale, 1.0)


def check_finite(scale: torch.Tensor, codec: str, also: str = "") -> None:
    """Per-block scales are non-finite iff the block held NaN/inf (checked on R values, not N);
    ``also`` names another cause, if the codec has one."""
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(
            f"codec {codec!r} cannot encode non-finite values (NaN/inf in the pseudo-gradient"
            + also
            + "); fix the divergence or use codec='fp32'"
        )


def check_output(out: torch.Tensor) -> None:
    """ValueError unless ``out`` is a flat contiguous CPU float32 buffer."""
    if out.dtype != torch.float32 or out.dim() != 1 or out.device.type != "cpu":
        raise ValueError(
            f"decode_into needs a flat CPU float32 output, got {out.dtype} {tuple(out.shape)} "
            f"on {out.device}; pass out.view(-1) of a float32 CPU tensor"
        )
    if not out.is_contiguous():
        raise ValueError("decode_into needs a contiguous output tensor (use .contiguous())")


def check_length(out: torch.Tensor, codes: int, expected_codes: int, codec: str) -> None:
    """ValueError unless the parts describe ``out``'s length: ``codes`` encoded values where
    ``expected_codes`` describe ``out.numel()`` elements."""
    if codes != expected_codes:
        raise ValueError(
            f"decode_into: {codes} encoded {codec} codes do not describe "
            f"{out.numel()} elements; the output has the wrong length"
        )


def stream_decode(
    out: torch.Tensor, decode_pass: DecodePass, *, accumulate: bool, weight: float | None
) -> torch.Tensor:
    """``out = x`` or ``out += x`` for the decoded tensor ``x`` (times ``weight``), one pass at
    a time: ``decode_pass`` writes a pass's values, straight into ``out`` unless accumulating."""
    n = out.numel()
    work = scratch(n) if accumulate else None
    with one_thread():
        for b0, b1, e0, e1 in passes(n):
            dst = out[e0:e1] if work is None else work[: e1 - e0]
            decode_pass(b0, b1, e0, e1, dst)
            if weight is not None:
                dst.mul_(weight)
            if work is not None:
                out[e0:e1].add_(dst)
    return out


def step_bound(t: torch.Tensor, block_step: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per-element worst-case error of a block quantiser: half the quantisation step of the
    element's block (``block_step`` of a ``[blocks, width]`` view, one value per row), plus
    float32 rounding slack (relative, and one smallest normal float32 for subnormal scales)."""
    flat = t.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    n = flat.numel()
    step = torch.empty(n)
    for b0, b1, e0, e1 in passes(n):
        x = flat[e0:e1].view(b1 - b0, -1)
        step[e0:e1].view(b1 - b0, -1).copy_(block_step(x).expand_as(x))
    tiny = torch.finfo(torch.float32).tiny
    return (step / 2) * (1 + 1e-5) + flat.abs() * 1e-6 + tiny


class DenseCodec(ABC):
    """What the dense codecs (every element on the wire, a fixed layout) have in common.

    Subclasses give ``name``, :meth:`layout`, :meth:`encode`, :meth:`decode_pass` and
    :meth:`max_abs_error_bound`; the received payload's layout is the encoder's layout.
    """

    name = ""
    needs_error_feedback = False
    zero_copy_decode = False

    def __init__(self, config: NoConfig | None = None) -> None:
        self.config = NoConfig() if config is None else config

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @abstractmethod
    def layout(self, numel: int) -> PartLayout:
        """Implemented by each dense codec."""

    @abstractmethod
    def encode(self, t: torch.Tensor) -> Parts:
        """Implemented by each dense codec."""

    @abstractmethod
    def decode_pass(self, parts: Parts, out_numel: int) -> DecodePass:
        """A :data:`DecodePass` over ``parts`` (with any unpacking buffers it needs)."""

    @abstractmethod
    def max_abs_error_bound(self, t: torch.Tensor) -> torch.Tensor:
        """Implemented by each dense codec."""

    def expected_parts(self, numel: int, meta: torch.Tensor | None = None) -> PartLayout:
        return self.layout(numel)

    def wire_size(self, numel: int) -> int:
        return sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for dtype, shape in self.layout(numel).values()
        )

    def check_parts(self, parts: Parts, numel: int) -> str | None:
        return None  # values carried as themselves: nothing beyond dtypes and shapes to check

    def decode(self, parts: Parts, numel: int) -> torch.Tensor:
        return self.decode_into(parts, torch.empty(numel, dtype=torch.float32))

    def decode_into(
        self,
        parts: Parts,
        out: torch.Tensor,
        *,
        accumulate: bool = False,
        weight: float | None = None,
    ) -> torch.Tensor:
        check_output(out)
        check_length(out, parts["q"].numel(), self.layout(out.numel())["q"][1][0], self.name)
        return stream_decode(
            out, self.decode_pass(parts, out.numel()), accumulate=accumulate, weight=weight
        )
