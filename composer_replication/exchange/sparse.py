"""The ``sparseloco`` wire codec: chunk-wise top-k of a tensor, values quantised to a few bits.

SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706) sends, per replica and round, only the
``k`` largest-magnitude entries of every chunk of ``chunk`` consecutive elements (1-3 % of
them), each value quantised to ``bits`` bits. This module is the wire format and its
arithmetic; the error-feedback accumulator that makes the dropped mass reappear in later
rounds lives on the replica side (``diloco/sparseloco.py``), not here.

Layout of one flattened tensor of ``n`` elements (row-major), with :class:`SparseSpec`
``(density, chunk, bits)`` and ``k = spec.k`` (``round(density * chunk)``, at least 1):

- chunk ``c`` holds elements ``[c * chunk, min(n, (c + 1) * chunk))``; the last chunk may be
  shorter, and keeps ``min(k, its length)`` entries; ``K`` = the total kept;
- part ``i``: the kept entries' positions inside their chunk, ascending within each chunk,
  chunk after chunk (int16 when ``chunk <= 32768``, else int32; ``K`` values);
- part ``q``: the quantisation codes, ``bits`` bits each, packed little-end first into uint8
  (``ceil(K * bits / 8)`` bytes; code ``j`` of byte ``b`` is ``(b >> (bits * j)) & (2**bits - 1)``);
- part ``s``: float32 per chunk, the largest magnitude ``m`` among the chunk's kept entries;
- part ``m``: int32 ``[chunk, k, bits]``, so a payload describes itself and the decoder needs
  no out-of-band parameters (it still validates every field: :func:`check_parts`).

Quantisation: ``L = 2**bits`` levels evenly spaced on ``[-m, m]`` including both ends,
``level(j) = j * step - m`` with ``step = m * (2 / (L - 1))``; a value ``v`` gets the nearest
level, ``j = round((v + m) / step)``. The absolute error of a kept entry is at most
``step / 2 = m / (L - 1)`` (plus float32 rounding): ``m / 3`` at 2 bits. The entries that
are not kept decode to 0 (their error is their value, which error feedback carries forward).

Bytes per element: ``density * (index bytes + bits / 8) + 4 / chunk``: at the defaults
(2 %, 4096, 2 bits) 0.047 B against fp32's 4 B, i.e. 1.2 %.

Decoding is a pure function of the parts: the levels are elementwise float32 ops (``j *
step - m``, then ``* w`` and ``out + x`` when accumulating), each rounded on its own, and the
positions are distinct, so every replica gets bit-identical results. Nothing here unpickles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from composer_replication.exchange.codec_blocks import PartLayout, Parts, check_length, check_output

__all__ = [
    "BITS",
    "NAME",
    "SparseCodec",
    "SparseSpec",
    "check_parts",
    "decode_into",
    "encode",
    "expected_parts",
    "kept",
    "max_abs_error_bound",
]

NAME = "sparseloco"
BITS: tuple[int, ...] = (1, 2, 4, 8)  # code widths that pack whole codes into a byte
MAX_CHUNK = 1 << 20  # a larger chunk is not a chunk any more (and a hostile header)
ROWS_PER_PASS = 256  # chunks per streaming pass (256 x 4096 float32 = 4 MiB of scratch)


@dataclass(frozen=True)
class SparseSpec:
    """What a ``sparseloco`` encoder keeps: ``density`` of each ``chunk``, ``bits`` per value.

    The defaults are the run config's (``[diloco] sparseloco_*``, docs/cli.md): 2 % of every
    4096-element chunk, 2-bit values, as in the SparseLoCo paper's 1-3 % / 2-bit regime.
    """

    density: float = 0.02
    chunk: int = 4096
    bits: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool):
            raise ValueError(f"sparseloco chunk must be an int, got {self.chunk!r}")
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise ValueError(f"sparseloco chunk must be in [1, {MAX_CHUNK}], got {self.chunk}")
        if not (isinstance(self.density, (int, float)) and 0.0 < self.density <= 1.0):
            raise ValueError(
                f"sparseloco density must be in (0, 1] (e.g. 0.02 = 2 % of each chunk), "
                f"got {self.density!r}"
            )
        if self.bits not in BITS:
            raise ValueError(f"sparseloco bits must be one of {list(BITS)}, got {self.bits!r}")

    @property
    def k(self) -> int:
        """Entries kept per full chunk: ``round(density * chunk)``, at least 1."""
        return max(1, min(self.chunk, round(self.density * self.chunk)))

    @property
    def index_dtype(self) -> torch.dtype:
        return index_dtype(self.chunk)


def index_dtype(chunk: int) -> torch.dtype:
    """Positions inside a chunk fit int16 up to 32768 elements, else int32."""
    return torch.int16 if chunk <= 1 << 15 else torch.int32


def kept(numel: int, chunk: int, k: int) -> tuple[int, int, int, int]:
    """(full chunks, length of the partial last chunk (0: none), entries kept in it, total K)."""
    full, last = divmod(numel, chunk)
    k_last = min(k, last)
    return full, last, k_last, full * min(k, chunk) + k_last


def _num_chunks(numel: int, chunk: int) -> int:
    return math.ceil(numel / chunk)


def expected_parts(
    numel: int, chunk: int, k: int, bits: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Dtype and shape of each part for ``numel`` elements under ``(chunk, k, bits)``."""
    total = kept(numel, chunk, k)[3]
    return {
        "i": (index_dtype(chunk), (total,)),
        "q": (torch.uint8, (math.ceil(total * bits / 8),)),
        "s": (torch.float32, (_num_chunks(numel, chunk),)),
        "m": (torch.int32, (3,)),
    }


def read_meta(meta: torch.Tensor) -> tuple[int, int, int] | str:
    """``(chunk, k, bits)`` from an ``m`` part read from the store, or why it is unusable."""
    if meta.dtype != torch.int32 or tuple(meta.shape) != (3,):
        return "sparseloco: the 'm' part must be int32 [chunk, k, bits]"
    chunk, k, bits = (int(v) for v in meta.tolist())
    if not 1 <= chunk <= MAX_CHUNK:
        return f"sparseloco: chunk {chunk} is not in [1, {MAX_CHUNK}]"
    if not 1 <= k <= chunk:
        return f"sparseloco: k {k} is not in [1, chunk={chunk}]"
    if bits not in BITS:
        return f"sparseloco: bits {bits} is not one of {list(BITS)}"
    return chunk, k, bits


def _step(scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Distance between two levels of each chunk: ``m * (2 / (L - 1))`` (float32)."""
    return scale * torch.tensor(2.0 / (2**bits - 1), dtype=torch.float32)


def encode(t: torch.Tensor, spec: SparseSpec) -> dict[str, torch.Tensor]:
    """Encode one tensor (any floating dtype and shape, read as float32) into parts i/q/s/m.

    Refuses non-finite values (a NaN would poison a chunk's scale silently). Deterministic:
    the same input gives the same parts.
    """
    flat = t.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    n, chunk, bits = flat.numel(), spec.chunk, spec.bits
    k = min(spec.k, chunk)
    full, last, k_last, total = kept(n, chunk, k)
    idx = torch.empty(total, dtype=spec.index_dtype)
    codes = torch.empty(total, dtype=torch.uint8)
    scale = torch.zeros(_num_chunks(n, chunk), dtype=torch.float32)
    pos = 0
    for r0 in range(0, full, ROWS_PER_PASS):
        r1 = min(full, r0 + ROWS_PER_PASS)
        rows = flat[r0 * chunk : r1 * chunk].view(r1 - r0, chunk)
        _encode_rows(rows, k, bits, idx[pos : pos + (r1 - r0) * k], codes[pos:], scale[r0:r1])
        pos += (r1 - r0) * k
    if last:
        rows = flat[full * chunk :].view(1, last)
        _encode_rows(rows, k_last, bits, idx[pos:], codes[pos:], scale[full:])
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(
            "codec 'sparseloco' cannot encode non-finite values (NaN/inf in the "
            "pseudo-gradient); fix the divergence or use codec='fp32'"
        )
    return {"i": idx, "q": _pack(codes, bits), "s": scale, "m": _meta(chunk, k, bits)}


def _meta(chunk: int, k: int, bits: int) -> torch.Tensor:
    return torch.tensor([chunk, k, bits], dtype=torch.int32)


def _encode_rows(
    rows: torch.Tensor,
    k: int,
    bits: int,
    idx_out: torch.Tensor,
    codes_out: torch.Tensor,
    scale_out: torch.Tensor,
) -> None:
    """Top-k of each row (chunk) by magnitude, positions ascending, values to codes."""
    n_rows = rows.shape[0]
    # torch.topk is a deterministic function of its input (each row on one thread), which the
    # replica's error feedback relies on: it encodes the same tensor the exchange encodes
    top = torch.topk(rows.abs(), k, dim=1, sorted=False).indices
    pos = torch.sort(top, dim=1).values
    vals = torch.gather(rows, 1, pos)
    m = vals.abs().amax(dim=1)
    scale_out.copy_(m)
    step = _step(m, bits)
    safe = torch.where(step > 0, step, 1.0)
    j = (vals + m[:, None]).div_(safe[:, None]).round_().clamp_(0, 2**bits - 1)
    idx_out[: n_rows * k].copy_(pos.reshape(-1))
    codes_out[: n_rows * k].copy_(j.reshape(-1))


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (< 2**bits) -> ``8 / bits`` codes per byte, first code in the low bits."""
    if bits == 8:
        return codes
    per = 8 // bits
    padded = torch.zeros(math.ceil(codes.numel() / per) * per, dtype=torch.uint8)
    padded[: codes.numel()] = codes
    groups = padded.view(-1, per)
    out = groups[:, 0].clone()
    for j in range(1, per):
        out.bitwise_or_(groups[:, j].bitwise_left_shift(bits * j))
    return out


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: the first ``count`` codes as uint8."""
    if bits == 8:
        return packed[:count]
    mask = 2**bits - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return packed[:, None].bitwise_right_shift(shifts).bitwise_and_(mask).view(-1)[:count]


def check_parts(parts: dict[str, torch.Tensor], numel: int) -> str | None:
    """Why parts read from the store cannot be decoded into ``numel`` elements, or None.

    Checks the ``m`` header, every part's dtype and shape, finite non-negative scales, and
    that positions lie inside their chunk and ascend strictly (no position twice: a repeated
    position would make the decoded value depend on write order).
    """
    if set(parts) != {"i", "q", "s", "m"}:
        return f"sparseloco: parts {sorted(parts)} are not exactly ['i', 'm', 'q', 's']"
    meta = read_meta(parts["m"])
    if isinstance(meta, str):
        return meta
    chunk, k, bits = meta
    want = expected_parts(numel, chunk, k, bits)
    for name, (dtype, shape) in want.items():
        got = parts[name]
        if got.dtype != dtype or tuple(got.shape) != shape:
            return (
                f"sparseloco: part {name!r} is {got.dtype} {tuple(got.shape)}, expected "
                f"{dtype} {shape} for {numel} elements (chunk {chunk}, k {k}, bits {bits})"
            )
    s = parts["s"]
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        return "sparseloco: a per-chunk scale is negative or not finite"
    full, last, k_last, _ = kept(numel, chunk, k)
    i = parts["i"].to(torch.int64)
    k_full = min(k, chunk)
    for rows, width, size in (
        (i[: full * k_full].view(full, k_full), chunk, k_full),
        (i[full * k_full :].view(1 if last else 0, k_last), last, k_last),
    ):
        if rows.numel() == 0:
            continue
        if bool((rows < 0).any()) or bool((rows >= width).any()):
            return f"sparseloco: a position lies outside its chunk of {width} elements"
        if size > 1 and not bool((rows[:, 1:] > rows[:, :-1]).all()):
            return "sparseloco: positions within a chunk are not strictly ascending"
    return None


def _flat_positions(idx: torch.Tensor, numel: int, chunk: int, k: int) -> torch.Tensor:
    """Absolute int64 positions of the kept entries (chunk offset + position in chunk)."""
    full, last, k_last, total = kept(numel, chunk, k)
    k_full = min(k, chunk)
    base = torch.empty(total, dtype=torch.int64)
    base[: full * k_full] = torch.arange(full, dtype=torch.int64).repeat_interleave(k_full) * chunk
    base[full * k_full :] = full * chunk
    return base.add_(idx.to(torch.int64))


def decoded_values(parts: dict[str, torch.Tensor], numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(absolute positions int64, float32 values) of the kept entries of validated parts."""
    meta = read_meta(parts["m"])
    assert not isinstance(meta, str), meta
    chunk, k, bits = meta
    full, _, k_last, total = kept(numel, chunk, k)
    k_full = min(k, chunk)
    codes = _unpack(parts["q"], bits, total).to(torch.float32)
    per_entry = torch.empty(total, dtype=torch.int64)  # chunk of each kept entry
    per_entry[: full * k_full] = torch.arange(full).repeat_interleave(k_full)
    per_entry[full * k_full :] = full
    m = parts["s"][per_entry]
    vals = codes.mul_(_step(m, bits)).sub_(m)  # j * step - m, each op rounded on its own
    return _flat_positions(parts["i"], numel, chunk, k), vals


def decode_into(
    parts: dict[str, torch.Tensor],
    out: torch.Tensor,
    *,
    accumulate: bool = False,
    weight: float | None = None,
) -> torch.Tensor:
    """``out = x`` (or ``out += x``) for the decoded dense tensor ``x`` times ``weight``.

    ``out`` is flat contiguous CPU float32 with the tensor's numel; the parts are validated
    (:func:`check_parts`). Entries that were not kept are 0 (``out`` is left as is there when
    accumulating).
    """
    positions, vals = decoded_values(parts, out.numel())
    if weight is not None:
        vals.mul_(weight)
    if not accumulate:
        out.zero_()
    # positions are distinct: one IEEE add per kept entry, independent of order
    out.index_add_(0, positions, vals)
    return out


def max_abs_error_bound(t: torch.Tensor, spec: SparseSpec) -> torch.Tensor:
    """Per-element worst case of ``|decode(encode(t)) - t|`` for the entries that are KEPT:
    half a level step of the element's chunk (``m / (2**bits - 1)``), plus float32 slack.
    Dropped entries are off by their own value (the error feedback's business)."""
    flat = t.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    n, chunk = flat.numel(), spec.chunk
    full, last, k_last, _ = kept(n, chunk, spec.k)
    out = torch.empty(n)
    for c in range(full + (1 if last else 0)):
        x = flat[c * chunk : min(n, (c + 1) * chunk)]
        m = x.abs().topk(min(spec.k, x.numel())).values.max()
        out[c * chunk : c * chunk + x.numel()] = m / (2**spec.bits - 1)
    return out * (1 + 1e-5) + flat.abs() * 1e-6 + torch.finfo(torch.float32).tiny


class SparseCodec:
    """The ``sparseloco`` codec as the registry serves it: :class:`SparseSpec` is its config.

    It drops most entries, so it relies on the sender's error feedback
    (``needs_error_feedback``): a lone replica applies its own message, and decoupled pushes
    (each the whole change since the learner's base version, possibly replaced in the queue)
    cannot use it. Its payloads describe their own layout (part ``m``), so any instance decodes
    any valid payload, whatever spec wrote it.
    """

    needs_error_feedback = True
    zero_copy_decode = False

    def __init__(self, config: SparseSpec | None = None) -> None:
        self.config = SparseSpec() if config is None else config

    def __repr__(self) -> str:
        return f"SparseCodec({self.config})"

    def layout(self, numel: int) -> PartLayout:
        """What :meth:`encode` writes for ``numel`` elements under this codec's spec."""
        c = self.config
        return expected_parts(numel, c.chunk, min(c.k, c.chunk), c.bits)

    def wire_size(self, numel: int) -> int:
        return sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for dtype, shape in self.layout(numel).values()
        )

    def encode(self, t: torch.Tensor) -> Parts:
        return encode(t, self.config)

    def expected_parts(self, numel: int, meta: torch.Tensor | None = None) -> PartLayout:
        """The layout a received payload's ``m`` part announces (ValueError if it is missing or
        malformed: the payload cannot be decoded)."""
        if meta is None:
            raise ValueError(f"codec {NAME!r}: the payload has no 'm' part [chunk, k, bits]")
        read = read_meta(meta)
        if isinstance(read, str):
            raise ValueError(read)
        return expected_parts(numel, *read)

    def check_parts(self, parts: Parts, numel: int) -> str | None:
        return check_parts(parts, numel)

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
        want = self.expected_parts(out.numel(), parts.get("m"))["q"][1][0]
        check_length(out, parts["q"].numel(), want, NAME)
        return decode_into(parts, out, accumulate=accumulate, weight=weight)

    def max_abs_error_bound(self, t: torch.Tensor) -> torch.Tensor:
        return max_abs_error_bound(t, self.config)
