"""Wire codecs for pseudo-gradients exchanged through an object store.

A codec turns one tensor (any floating dtype, any shape) into a few named parts that are stored
as safetensors tensors, and back. Decoding always produces float32, and the aggregation
accumulates in float32, so the result does not depend on the wire format's precision beyond the
quantisation error itself.

Codecs (bytes per element, excluding per-block scales):
- ``fp32``: lossless for float32 inputs (4 B).
- ``bf16``: round-to-nearest-even bfloat16 (2 B); relative error <= 2**-8.
- ``int8``: symmetric per-block absmax scaling, ``q = round(x / s)`` with ``s = absmax / 127``
  (1 B + 4 B per block); absolute error <= s / 2 per element.
- ``4bit``: per-block min-max uint4, ``q = round((x - lo) / s)`` with ``s = (hi - lo) / 15``,
  two codes packed per byte, the even element in the low nibble (0.5 B + 8 B per block);
  absolute error <= s / 2 per element.
- ``sparseloco``: chunk-wise top-k of the values, each quantised to a few bits (SparseLoCo;
  exchange/sparse.py has its layout, parameters (`sparse.SparseSpec`) and error bound). It
  drops most entries, so it is meant to be used with the replica-side error feedback of
  ``diloco/sparseloco.py``; its parts describe themselves (part ``m``: chunk, k, bits).

The dense codecs (:data:`DENSE`) are described below; ``sparseloco`` dispatches to
exchange/sparse.py.

Blocks are :data:`CHUNK` consecutive elements of the flattened tensor; the last block holds the
remaining ``numel % CHUNK`` elements (its scale is computed from those elements only). A tensor
with no elements still has one block whose scale (and offset) is 0.

Speed: encoding and decoding are streaming passes over :data:`PASS_BLOCKS` blocks at a time
(2 MiB of float32, so the temporaries stay in the L2 cache), with vectorised torch ops and one
reused scratch buffer: the outputs are allocated once at their final size and written slice by
slice, and :func:`decode_into` dequantises and accumulates straight into a float32 output
(``out += w * decode(parts)``) without materialising the decoded tensor. No Python work per
block, so the cost is a few passes over cache-resident data per 2 MiB: several GB/s per core.

The passes run on one torch thread (the calling thread's intra-op thread count is set to 1 for
the duration and restored; other threads are unaffected): each pass is a dozen small ops, and
forking an OpenMP team per op is slower than the op itself, catastrophically so when several
processes share the cores (measured: 4 replica processes on 2 cores with 2 threads each, 35x
slower than with one).

Decoding is a pure function of the stored parts, and every operation of :func:`decode_into`
(``q * s``, ``+ z``, ``* w``, ``out + x``) is one elementwise IEEE float32 op rounded on its
own (no fused multiply-add), so every replica that decodes the same objects in the same order
gets bit-identical float32 values (this is what keeps replicas in step), and the result equals
decoding to a full tensor first and summing afterwards.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator

import torch

from composer_replication.exchange import sparse
from composer_replication.exchange.sparse import SparseSpec

DENSE: tuple[str, ...] = ("fp32", "bf16", "int8", "4bit")  # every element on the wire
SPARSE = "sparseloco"
CODECS: tuple[str, ...] = (*DENSE, SPARSE)
CHUNK = 2048  # elements per quantisation block: small enough to track local scale, 0.2% overhead
PASS_BLOCKS = 256  # blocks per streaming pass: 256 x 2048 float32 = 2 MiB of scratch
QUANTISED: tuple[str, ...] = ("int8", "4bit")
# (un)packing two nibbles through an int16 view needs the low byte first; else: strided ops
_LITTLE_ENDIAN = sys.byteorder == "little"


def check_codec(codec: str) -> str:
    """Return ``codec`` if known, else raise ValueError listing the valid names."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    return codec


def num_blocks(numel: int) -> int:
    """Quantisation blocks (= per-block scales) of a tensor of ``numel`` elements (>= 1)."""
    return max(1, math.ceil(numel / CHUNK))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
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


def _passes(numel: int) -> Iterator[tuple[int, int, int, int]]:
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


def _scratch(numel: int) -> torch.Tensor:
    """One pass's float32 work buffer, plus one element (a 4-bit pad code for odd lengths)."""
    return torch.empty(min(numel, PASS_BLOCKS * CHUNK) + 1, dtype=torch.float32)


def encode(t: torch.Tensor, codec: str, spec: SparseSpec | None = None) -> dict[str, torch.Tensor]:
    """Encode one tensor into named parts (suffixes ``q``, ``s``, ``z``) for the wire.

    ``t`` is any floating tensor; it is flattened (row-major) and read as float32. Quantising
    codecs refuse non-finite values because a NaN/inf scale would poison the whole block
    silently. The parts are fresh tensors of their final size (see :func:`expected_parts`).
    ``spec``: what ``sparseloco`` keeps (None: `SparseSpec()`'s defaults); other codecs
    ignore it.
    """
    check_codec(codec)
    if codec == SPARSE:
        return sparse.encode(t, spec or SparseSpec())
    flat = t.detach().reshape(-1).to(device="cpu")
    if codec == "fp32":
        return {"q": flat.to(torch.float32).contiguous()}
    if codec == "bf16":
        # float64 goes through float32 first (one rounding rule for every input dtype)
        src = flat.to(torch.float32) if flat.dtype == torch.float64 else flat
        return {"q": src.to(torch.bfloat16).contiguous()}
    with _one_thread():
        return _quantise(flat.contiguous(), codec)


def _quantise(flat: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """int8 / 4-bit parts of a flat contiguous CPU tensor, streaming (see the module doc)."""
    n = flat.numel()
    work = _scratch(n)
    convert = None if flat.dtype == torch.float32 else torch.empty_like(work)
    scale = torch.zeros(num_blocks(n), dtype=torch.float32)
    if codec == "int8":
        q = torch.empty(n, dtype=torch.int8)
        for b0, b1, e0, e1 in _passes(n):
            x = _as_float32(flat[e0:e1], convert).view(b1 - b0, -1)
            w = work[: e1 - e0].view(b1 - b0, -1)
            s = scale[b0:b1]
            torch.amax(torch.abs(x, out=w), dim=1, out=s)  # NaN/inf propagate into the scale
            s.div_(127.0)
            torch.div(x, _nonzero(s)[:, None], out=w).round_().clamp_(-127, 127)
            q[e0:e1].view(b1 - b0, -1).copy_(w)
        _check_finite(scale, codec)
        return {"q": q, "s": scale}
    lo = torch.zeros(num_blocks(n), dtype=torch.float32)
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
    codes8 = torch.empty(work.numel() + 1, dtype=torch.int8)  # one pass's codes, even length
    pairs16 = torch.empty(codes8.numel() // 2, dtype=torch.int16)
    for b0, b1, e0, e1 in _passes(n):
        m = e1 - e0
        x = _as_float32(flat[e0:e1], convert).view(b1 - b0, -1)
        w = work[:m].view(b1 - b0, -1)
        s, z = scale[b0:b1], lo[b0:b1]
        torch.amin(x, dim=1, out=z)
        torch.amax(x, dim=1, out=s)
        s.sub_(z).div_(15.0)  # (hi - lo) / 15: inf if the block is non-finite or overflows
        torch.sub(x, z[:, None], out=w).div_(_nonzero(s)[:, None]).round_().clamp_(0, 15)
        work[m] = 0.0  # high nibble of an odd-length tensor's last byte
        _pack_nibbles(work[: m + m % 2], codes8, pairs16, packed[e0 // 2 : (e1 + 1) // 2])
    _check_finite(scale, codec)
    return {"q": packed, "s": scale, "z": lo}


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


def _as_float32(x: torch.Tensor, convert: torch.Tensor | None) -> torch.Tensor:
    """``x`` itself if float32, else converted into the ``convert`` scratch buffer."""
    if convert is None:
        return x
    return convert[: x.numel()].copy_(x)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """Scales with 0 replaced by 1 (an all-equal block: every code is 0, decoding is exact)."""
    return torch.where(scale > 0, scale, 1.0)


def _check_finite(scale: torch.Tensor, codec: str) -> None:
    """Per-block scales are non-finite iff the block held NaN/inf (checked on R values, not N)."""
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(
            f"codec {codec!r} cannot encode non-finite values (NaN/inf in the pseudo-gradient"
            + (", or a block whose max - min overflows float32" if codec == "4bit" else "")
            + "); fix the divergence or use codec='fp32'"
        )


def expected_parts(
    codec: str, numel: int, meta: torch.Tensor | None = None
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Dtype and shape of each encoded part for a tensor of ``numel`` elements (for validation).

    ``sparseloco`` parts describe their own layout: pass the payload's ``m`` part as ``meta``
    (ValueError if it is missing or malformed: the payload cannot be decoded).
    """
    check_codec(codec)
    if codec == SPARSE:
        if meta is None:
            raise ValueError("codec 'sparseloco': the payload has no 'm' part [chunk, k, bits]")
        read = sparse.read_meta(meta)
        if isinstance(read, str):
            raise ValueError(read)
        return sparse.expected_parts(numel, *read)
    rows = num_blocks(numel)
    if codec == "fp32":
        return {"q": (torch.float32, (numel,))}
    if codec == "bf16":
        return {"q": (torch.bfloat16, (numel,))}
    if codec == "int8":
        return {"q": (torch.int8, (numel,)), "s": (torch.float32, (rows,))}
    return {
        "q": (torch.uint8, ((numel + 1) // 2,)),
        "s": (torch.float32, (rows,)),
        "z": (torch.float32, (rows,)),
    }


def check_parts(parts: dict[str, torch.Tensor], codec: str, numel: int | None = None) -> str | None:
    """Why parts read from the store (already of :func:`expected_parts`' dtypes and shapes)
    cannot be decoded, or None. Our encoder never writes a non-finite or negative scale or a
    non-finite offset; a payload that has one would silently poison the average.
    ``sparseloco`` also checks its positions (inside their chunk, no repeats): it needs the
    tensor's ``numel``."""
    check_codec(codec)
    if codec == SPARSE:
        if numel is None:
            raise ValueError("check_parts: codec 'sparseloco' needs numel=")
        return sparse.check_parts(parts, numel)
    if codec not in QUANTISED:
        return None  # fp32/bf16 carry the values themselves (non-finite ones pass through)
    s = parts["s"]
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        return f"codec {codec!r}: a per-block scale is negative or not finite"
    if codec == "4bit" and not bool(torch.isfinite(parts["z"]).all()):
        return "codec '4bit': a per-block offset is not finite"
    return None


def decode(parts: dict[str, torch.Tensor], codec: str, numel: int) -> torch.Tensor:
    """Decode parts produced by :func:`encode` into a flat float32 tensor of ``numel`` elements.

    For ``fp32`` that is ``parts["q"]`` itself (no copy: do not write into it unless you own
    the parts). The caller has validated the parts against :func:`expected_parts`.
    """
    if codec == "fp32":
        return parts["q"]
    return decode_into(parts, codec, torch.empty(numel, dtype=torch.float32))


def decode_into(
    parts: dict[str, torch.Tensor],
    codec: str,
    out: torch.Tensor,
    *,
    accumulate: bool = False,
    weight: float | None = None,
) -> torch.Tensor:
    """Decode ``parts`` into ``out`` (flat, contiguous, CPU float32; its length is the numel).

    ``out = x`` or, with ``accumulate=True``, ``out += x``, where ``x`` is the decoded tensor,
    multiplied by ``weight`` (rounded to float32) if given. Streams over the parts: ``x`` only
    ever exists one 2 MiB pass at a time. Returns ``out``. The caller has validated the parts
    against :func:`expected_parts`; a wrong ``out`` raises ValueError.
    """
    check_codec(codec)
    if out.dtype != torch.float32 or out.dim() != 1 or out.device.type != "cpu":
        raise ValueError(
            f"decode_into needs a flat CPU float32 output, got {out.dtype} {tuple(out.shape)} "
            f"on {out.device}; pass out.view(-1) of a float32 CPU tensor"
        )
    if not out.is_contiguous():
        raise ValueError("decode_into needs a contiguous output tensor (use .contiguous())")
    n = out.numel()
    if parts["q"].numel() != expected_parts(codec, n, parts.get("m"))["q"][1][0]:
        raise ValueError(
            f"decode_into: {parts['q'].numel()} encoded {codec} codes do not describe "
            f"{n} elements; the output has the wrong length"
        )
    if codec == SPARSE:
        return sparse.decode_into(parts, out, accumulate=accumulate, weight=weight)
    if codec == "fp32" and weight is None:  # nothing to decode: one pass either way
        return out.add_(parts["q"]) if accumulate else out.copy_(parts["q"])
    work = _scratch(n) if accumulate else None
    # 4-bit unpacking: two int16 buffers of one pass's bytes (codes, high nibbles)
    pass_bytes = (min(n, PASS_BLOCKS * CHUNK) + 1) // 2
    unpack = torch.empty(2, pass_bytes, dtype=torch.int16) if codec == "4bit" else None
    with _one_thread():
        for b0, b1, e0, e1 in _passes(n):
            dst = out[e0:e1] if work is None else work[: e1 - e0]
            _decode_pass(parts, codec, b0, b1, e0, e1, dst, unpack)
            if weight is not None:
                dst.mul_(weight)
            if work is not None:
                out[e0:e1].add_(dst)
    return out


def _decode_pass(
    parts: dict[str, torch.Tensor],
    codec: str,
    b0: int,
    b1: int,
    e0: int,
    e1: int,
    dst: torch.Tensor,
    unpack: torch.Tensor | None,
) -> None:
    """Decoded float32 values of elements [e0, e1) (blocks [b0, b1)) into ``dst``."""
    q = parts["q"]
    if codec in ("fp32", "bf16"):
        dst.copy_(q[e0:e1])
        return
    rows = dst.view(b1 - b0, -1)
    if codec == "int8":
        torch.mul(q[e0:e1].view(b1 - b0, -1), parts["s"][b0:b1, None], out=rows)
        return
    m = e1 - e0
    byte = q[e0 // 2 : (e1 + 1) // 2]
    if _LITTLE_ENDIAN:
        assert unpack is not None
        # byte b -> int16 (b & 0x0F) | (b & 0xF0) << 4: as two bytes in memory, low then high
        v = unpack[0, : byte.numel()].copy_(byte)
        hi = torch.bitwise_and(v, 0xF0, out=unpack[1, : byte.numel()]).bitwise_left_shift_(4)
        v.bitwise_and_(0x0F).bitwise_or_(hi)
        dst.copy_(v.view(torch.uint8)[:m])
    else:
        codes = torch.empty(m + m % 2, dtype=torch.float32).view(-1, 2)
        codes[:, 0].copy_(byte & 0x0F)
        codes[:, 1].copy_(byte >> 4)
        dst.copy_(codes.view(-1)[:m])
    rows.mul_(parts["s"][b0:b1, None]).add_(parts["z"][b0:b1, None])


def max_abs_error_bound(
    t: torch.Tensor, codec: str, spec: SparseSpec | None = None
) -> torch.Tensor:
    """Per-element worst-case absolute error of ``decode(encode(t))`` (flat, float32).

    Half a quantisation step of the element's block, plus float32 rounding slack (relative,
    and one smallest normal float32 for blocks whose scale is subnormal). For ``sparseloco``
    the bound holds for the kept entries only (`sparse.max_abs_error_bound`; ``spec`` None:
    `SparseSpec`'s defaults).
    """
    check_codec(codec)
    if codec == SPARSE:
        return sparse.max_abs_error_bound(t, spec or SparseSpec())
    flat = t.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    n = flat.numel()
    if codec == "fp32":
        return torch.zeros(n)
    if codec == "bf16":
        return flat.abs() * 2.0**-8
    step = torch.empty(n)
    for b0, b1, e0, e1 in _passes(n):
        x = flat[e0:e1].view(b1 - b0, -1)
        if codec == "int8":
            s = x.abs().amax(dim=1, keepdim=True) / 127.0
        else:
            s = (x.amax(dim=1, keepdim=True) - x.amin(dim=1, keepdim=True)) / 15.0
        step[e0:e1].view(b1 - b0, -1).copy_(s.expand_as(x))
    tiny = torch.finfo(torch.float32).tiny
    return (step / 2) * (1 + 1e-5) + flat.abs() * 1e-6 + tiny
