"""Wire codecs for pseudo-gradients exchanged through an object store.

A codec turns one tensor (any floating dtype, any shape) into a few named parts that are stored
as safetensors tensors, and back. Decoding always produces float32, and the aggregation
accumulates in float32, so the result does not depend on the wire format's precision beyond the
quantisation error itself.

Codecs (bytes per element, excluding per-chunk scales):
- ``fp32``: lossless for float32 inputs (4 B).
- ``bf16``: round-to-nearest-even bfloat16 (2 B); relative error <= 2**-8.
- ``int8``: symmetric per-chunk absmax scaling, ``q = round(x / s)`` with ``s = absmax / 127``
  (1 B + 4 B per chunk); absolute error <= s / 2 per element.
- ``4bit``: per-chunk min-max uint4, ``q = round((x - lo) / s)`` with ``s = (hi - lo) / 15``,
  two codes packed per byte (0.5 B + 8 B per chunk); absolute error <= s / 2 per element.

Decoding is a pure function of the stored parts, so every replica that decodes the same object
gets bit-identical float32 values (this is what keeps replicas in step).
"""

from __future__ import annotations

import math

import torch

CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "4bit")
CHUNK = 2048  # elements per quantisation chunk: small enough to track local scale, 0.2% overhead


def check_codec(codec: str) -> str:
    """Return ``codec`` if known, else raise ValueError listing the valid names."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    return codec


def _chunks(flat: torch.Tensor, pad_value: float = 0.0) -> torch.Tensor:
    """[N] float32 -> [ceil(N / CHUNK), CHUNK], padded at the end with ``pad_value``."""
    n = flat.numel()
    rows = max(1, math.ceil(n / CHUNK))
    if rows * CHUNK != n:
        flat = torch.cat([flat, flat.new_full((rows * CHUNK - n,), pad_value)])
    return flat.view(rows, CHUNK)


def encode(t: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """Encode one tensor into named parts (suffixes ``q``, ``s``, ``z``) for the wire.

    ``t`` is any floating tensor; it is flattened (row-major). Quantising codecs refuse
    non-finite values because a NaN/inf scale would poison the whole chunk silently.
    """
    check_codec(codec)
    flat = t.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    if codec == "fp32":
        return {"q": flat.contiguous()}
    if codec == "bf16":
        return {"q": flat.to(torch.bfloat16).contiguous()}
    n = flat.numel()
    if codec == "int8":
        rows = _chunks(flat)
        lo, hi = torch.aminmax(rows, dim=1)  # one pass; NaN/inf propagate into the scale
        scale = torch.maximum(-lo, hi) / 127.0  # [R]
        _check_finite(scale, codec)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        return {"q": q.reshape(-1)[:n].contiguous(), "s": scale.contiguous()}
    # 4bit: padding with the row's own values would change lo/hi; pad with the first element
    rows = _chunks(flat, pad_value=float(flat[0]) if n else 0.0)
    lo, hi = torch.aminmax(rows, dim=1)
    scale = (hi - lo) / 15.0
    _check_finite(scale, codec)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((rows - lo[:, None]) / safe[:, None]).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(-1)[:n]
    if n % 2:
        q = torch.cat([q, q.new_zeros(1)])
    packed = q[0::2] | (q[1::2] << 4)  # low nibble = even element, high nibble = odd element
    return {"q": packed.contiguous(), "s": scale.contiguous(), "z": lo.contiguous()}


def _check_finite(scale: torch.Tensor, codec: str) -> None:
    """Per-chunk scales are non-finite iff the chunk held NaN/inf (checked on R values, not N)."""
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(
            f"codec {codec!r} cannot encode non-finite values (NaN/inf in the pseudo-gradient); "
            "fix the divergence or use codec='fp32'"
        )


def expected_parts(codec: str, numel: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Dtype and shape of each encoded part for a tensor of ``numel`` elements (for validation)."""
    check_codec(codec)
    rows = max(1, math.ceil(numel / CHUNK))
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


def decode(parts: dict[str, torch.Tensor], codec: str, numel: int) -> torch.Tensor:
    """Decode parts produced by :func:`encode` into a flat float32 tensor of ``numel`` elements.

    The caller has validated the parts against :func:`expected_parts`.
    """
    check_codec(codec)
    q = parts["q"]
    if codec in ("fp32", "bf16"):
        return q.to(torch.float32)
    rows = max(1, math.ceil(numel / CHUNK))
    if codec == "int8":
        x = q.to(torch.float32)
        x = _chunks(x).mul_(parts["s"][:, None])
        return x.reshape(-1)[:numel]
    codes = torch.stack([q & 0x0F, q >> 4], dim=1).reshape(-1)[:numel].to(torch.float32)
    x = _chunks(codes).mul_(parts["s"][:, None]).add_(parts["z"][:, None])
    assert x.shape[0] == rows
    return x.reshape(-1)[:numel]


def max_abs_error_bound(t: torch.Tensor, codec: str) -> torch.Tensor:
    """Per-element worst-case absolute error of ``decode(encode(t))`` (flat, float32).

    Used by tests and documentation: half a quantisation step, plus float32 rounding slack.
    """
    flat = t.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    if codec == "fp32":
        return torch.zeros(n)
    if codec == "bf16":
        return flat.abs() * 2.0**-8
    if codec == "int8":
        rows = _chunks(flat)
        step = rows.abs().amax(dim=1, keepdim=True) / 127.0
    else:
        rows = _chunks(flat, pad_value=float(flat[0]) if n else 0.0)
        step = (rows.amax(dim=1, keepdim=True) - rows.amin(dim=1, keepdim=True)) / 15.0
    bound = (step / 2) * (1 + 1e-5) + rows.abs() * 1e-6
    return bound.expand_as(rows).reshape(-1)[:n]
