"""Zero-copy safetensors framing for large payloads read from and written to an object store.

The bytes are the standard safetensors format: ``safetensors.torch.load`` reads what
:func:`layout` + :func:`header_bytes` write, and :func:`unframe` reads what
``safetensors.torch.save`` writes (the tests check both directions). We frame ourselves only to
avoid copies: ``safetensors.torch.save`` materialises one more copy of every tensor and ``load``
another, which for a 100M-parameter pseudo-gradient costs more than the file transfer itself.

:func:`parse_header` is the package's one parser of untrusted safetensors headers (contributions,
pushes and state snapshots): it validates as strictly as the reference implementation, a JSON
header of known dtypes and shapes whose data offsets tile the data section exactly, and raises
`FrameError` (a `CorruptContributionError`) saying what is wrong. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from dataclasses import dataclass

import torch

from composer_replication.exchange.vocabulary import FrameError
from composer_replication.json_types import JSONDict

__all__ = [
    "MAX_HEADER_BYTES",
    "ST_DTYPES",
    "Buffer",
    "Entry",
    "FrameError",
    "Header",
    "header_bytes",
    "layout",
    "parse_header",
    "unframe",
]

MAX_HEADER_BYTES = 64 * 2**20  # a safetensors header larger than this is hostile, not a model
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}

Buffer = bytes | bytearray | memoryview


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, any rank including 0-dim)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def layout(tensors: dict[str, torch.Tensor]) -> tuple[JSONDict, list[memoryview]]:
    """Safetensors entries and zero-copy data buffers for ``tensors``, in file order.

    Tensors are ordered by descending element size (then name) so every tensor's offset stays
    aligned to its element size. Concatenating the buffers gives the data section.
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    entries: JSONDict = {}
    buffers: list[memoryview] = []
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _ST_NAMES:
            raise ValueError(f"cannot frame {name!r}: dtype {t.dtype} is not supported")
        buf = _as_bytes_view(t.cpu())
        entries[name] = {
            "dtype": _ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + buf.nbytes],
        }
        offset += buf.nbytes
        buffers.append(buf)
    return entries, buffers


def header_bytes(entries: JSONDict, metadata: dict[str, str]) -> bytes:
    """Length prefix + JSON header (space-padded so the data section starts 8-byte aligned)."""
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % 8)
    return struct.pack("<Q", len(header)) + header


@dataclass(frozen=True)
class Entry:
    """One tensor a safetensors header describes: its bytes are ``data[begin:end]``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A validated safetensors header: the metadata, the entries in data order (their byte
    ranges tile the data section exactly), and where the data section starts in the blob."""

    metadata: dict[str, str]
    entries: tuple[Entry, ...]
    data_start: int


def parse_header(blob: Buffer, what: str) -> Header:
    """Parse and validate the safetensors header of ``blob`` without touching its tensor data.

    The one parser of untrusted safetensors headers in the package (contributions, pushes and
    state snapshots all go through it). Raises `FrameError` naming ``what`` and the fault: a
    blob too short for the length prefix, a header length of 0, above ``MAX_HEADER_BYTES`` or
    past the end (truncated object, pickle or foreign file), a header that is not a JSON object,
    metadata that is not strings, an entry with unknown keys, an unknown dtype or a bad shape,
    offsets that disagree with the shape, and byte ranges that overlap, leave gaps or do not end
    where the data section ends.
    """
    mv = memoryview(blob).cast("B")
    if mv.nbytes < 8:
        raise FrameError(f"{what}: {mv.nbytes} bytes is not a safetensors payload")
    (n,) = struct.unpack("<Q", mv[:8])
    if n == 0 or n > MAX_HEADER_BYTES or 8 + n > mv.nbytes:
        raise FrameError(
            f"{what}: not a safetensors payload (header length {n} for {mv.nbytes} bytes; "
            "truncated object, pickle or foreign file)"
        )
    try:
        header = json.loads(bytes(mv[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"{what}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FrameError(f"{what}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FrameError(f"{what}: safetensors metadata must map strings to strings")
    entries = [_entry(name, e, what) for name, e in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end, e.name))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise FrameError(f"{what}: data of {e.name!r} does not follow the previous tensor")
        pos = e.end
    data_bytes = mv.nbytes - 8 - n
    if pos != data_bytes:
        raise FrameError(
            f"{what}: malformed or truncated safetensors (data section is {data_bytes} bytes, "
            f"header describes {pos})"
        )
    return Header(metadata=meta, entries=tuple(entries), data_start=8 + n)


def _entry(name: str, e: object, what: str) -> Entry:
    """One header entry, validated (FrameError otherwise)."""
    ok = (
        isinstance(e, dict)
        and set(e) == {"dtype", "shape", "data_offsets"}
        and e["dtype"] in ST_DTYPES
        and isinstance(e["shape"], list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in e["shape"])
        and isinstance(e["data_offsets"], list)
        and len(e["data_offsets"]) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in e["data_offsets"])
    )
    if not ok:
        raise FrameError(f"{what}: malformed safetensors entry {name!r}")
    assert isinstance(e, dict)
    begin, end = e["data_offsets"]
    dtype = ST_DTYPES[e["dtype"]]
    shape = tuple(e["shape"])
    if not 0 <= begin <= end or end - begin != math.prod(shape) * _itemsize(dtype):
        raise FrameError(f"{what}: entry {name!r} has inconsistent offsets/shape")
    return Entry(name, dtype, shape, begin, end)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def unframe(blob: Buffer, what: str) -> tuple[dict[str, str], dict[str, torch.Tensor], memoryview]:
    """Parse and validate a safetensors payload: (metadata, tensors, data section).

    The tensors are zero-copy views into ``blob`` (read-only if ``blob`` is ``bytes``: never
    write into them). Raises FrameError saying what is wrong (see :func:`parse_header`).
    """
    header = parse_header(blob, what)
    mv = memoryview(blob).cast("B")
    data = mv[header.data_start :]
    tensors = {}
    with warnings.catch_warnings():  # bytes are read-only; we never write into these views
        warnings.simplefilter("ignore", UserWarning)
        for e in header.entries:
            if e.end == e.begin:
                tensors[e.name] = torch.empty(e.shape, dtype=e.dtype)
                continue
            itemsize = _itemsize(e.dtype)
            src: Buffer = mv
            offset = header.data_start + e.begin
            if offset % itemsize:  # misaligned (not written by us): copy to an aligned buffer
                src, offset = bytearray(data[e.begin : e.end]), 0
            count = (e.end - e.begin) // itemsize
            t = torch.frombuffer(src, dtype=e.dtype, count=count, offset=offset)
            tensors[e.name] = t.view(e.shape)
    return header.metadata, tensors, data
