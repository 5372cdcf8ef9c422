"""Wire codecs for pseudo-gradients exchanged through an object store: the `Codec` protocol and
the registry that maps each codec's name to its implementation.

A codec turns one tensor (any floating dtype, any shape) into a few named parts that are stored
as safetensors tensors, and back. Decoding always produces float32, and the aggregation
accumulates in float32, so the result does not depend on the wire format's precision beyond the
quantisation error itself. Decoding is a pure function of the stored parts, made of elementwise
IEEE float32 ops each rounded on its own, so every replica that decodes the same objects in the
same order gets bit-identical values (this is what keeps replicas in step).

The codecs, one module each (bytes per element, excluding per-block scales):

- ``fp32`` (exchange/codec_fp32.py): lossless for float32 inputs (4 B).
- ``bf16`` (exchange/codec_bf16.py): round-to-nearest-even bfloat16 (2 B); relative error
  <= 2**-8.
- ``int8`` (exchange/codec_int8.py): symmetric per-block absmax scaling (1 B + 4 B per block).
- ``4bit`` (exchange/codec_4bit.py): per-block min-max uint4, two codes per byte (0.5 B + 8 B
  per block).
- ``sparseloco`` (exchange/sparse.py): chunk-wise top-k of the values, each quantised to a few
  bits (SparseLoCo). It drops most entries, so it relies on the replica-side error feedback of
  ``diloco/sparseloco.py`` (``needs_error_feedback``); its parts describe themselves.

The dense codecs share their blocks and streaming passes (exchange/codec_blocks.py). Each codec
owns its configuration (``config``: `sparse.SparseSpec` for ``sparseloco``, `NoConfig` for the
others, whose formats are fixed). Everything else of the package asks this registry for a codec
by name (`get`, `configured`) and calls its methods or reads its properties: no other module
compares codec names. Every list of names is derived from the registry: `names` (what the run
config's ``diloco.codec`` accepts), `DENSE` (no error feedback), `QUANTISED` (dense, with
per-block scales). Adding a codec: one module with its class and ``NAME``, one line in
``_REGISTRY`` below, its tests, and its line in docs/object-store.md ("Codecs").

The module-level functions (`encode`, `decode`, `decode_into`, `expected_parts`, `check_parts`,
`max_abs_error_bound`, `wire_size`) take the codec's name and dispatch through the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, TypeGuard

import torch

from composer_replication.exchange import codec_4bit, codec_bf16, codec_fp32, codec_int8, sparse
from composer_replication.exchange.codec_blocks import (
    CHUNK,
    PASS_BLOCKS,
    NoConfig,
    PartLayout,
    Parts,
    num_blocks,
)
from composer_replication.exchange.sparse import SparseSpec
from composer_replication.fields import OneOf

__all__ = [
    "DEFAULT",
    "CHUNK",
    "CODECS",
    "CodecName",
    "DENSE",
    "PASS_BLOCKS",
    "QUANTISED",
    "SPARSE",
    "Codec",
    "NoConfig",
    "PartLayout",
    "Parts",
    "SparseSpec",
    "check_codec",
    "check_parts",
    "config_type",
    "configured",
    "decode",
    "decode_into",
    "encode",
    "expected_parts",
    "get",
    "is_codec_name",
    "max_abs_error_bound",
    "names",
    "num_blocks",
    "wire_size",
]


class Codec(Protocol):
    """One wire codec. Implementations hold no state beyond their ``config``."""

    @property
    def config(self) -> object:
        """This codec's own configuration dataclass (what the encoder keeps or how)."""
        ...

    @property
    def needs_error_feedback(self) -> bool:
        """The codec drops part of every tensor, and the sender must carry what it dropped into
        later rounds (error feedback): a lone replica then applies its own message, not its
        tensor, and decoupled pushes cannot use the codec (they would count work twice)."""
        ...

    @property
    def zero_copy_decode(self) -> bool:
        """`decode` returns the payload's own tensor (no copy, no arithmetic): an equal-weight
        mean can sum such views directly instead of streaming them through `decode_into`."""
        ...

    def layout(self, numel: int) -> PartLayout:
        """Dtype and shape of each part that `encode` writes for ``numel`` elements."""
        ...

    def wire_size(self, numel: int) -> int:
        """Bytes of the encoded parts of a tensor of ``numel`` elements (framing excluded)."""
        ...

    def encode(self, t: torch.Tensor) -> Parts:
        """Encode one tensor (flattened row-major, read as float32) into fresh parts of their
        final size. Quantising codecs refuse non-finite values (ValueError)."""
        ...

    def expected_parts(self, numel: int, meta: torch.Tensor | None = None) -> PartLayout:
        """The layout a received payload must have for ``numel`` elements; ``meta`` is the
        payload's ``m`` part where the codec's payloads describe themselves (ValueError when
        it is missing or malformed)."""
        ...

    def check_parts(self, parts: Parts, numel: int) -> str | None:
        """Why parts read from the store (already of `expected_parts`' dtypes and shapes)
        cannot be decoded into ``numel`` elements, or None."""
        ...

    def decode(self, parts: Parts, numel: int) -> torch.Tensor:
        """A flat float32 tensor of ``numel`` elements (may be a view of the parts: do not
        write into it unless you own the parts)."""
        ...

    def decode_into(
        self,
        parts: Parts,
        out: torch.Tensor,
        *,
        accumulate: bool = False,
        weight: float | None = None,
    ) -> torch.Tensor:
        """``out = x`` or, with ``accumulate``, ``out += x`` for the decoded ``x`` times
        ``weight`` (rounded to float32) if given; ``out`` is flat contiguous CPU float32 of the
        tensor's numel (ValueError otherwise). Returns ``out``."""
        ...

    def max_abs_error_bound(self, t: torch.Tensor) -> torch.Tensor:
        """Per-element worst case of ``|decode(encode(t)) - t|`` (flat float32; for a codec
        that drops entries, for the kept ones)."""
        ...


@dataclass(frozen=True)
class _Entry:
    config_type: type
    build: Callable[[Any], Codec]


_REGISTRY: dict[str, _Entry] = {
    codec_fp32.NAME: _Entry(NoConfig, codec_fp32.Fp32Codec),
    codec_bf16.NAME: _Entry(NoConfig, codec_bf16.Bf16Codec),
    codec_int8.NAME: _Entry(NoConfig, codec_int8.Int8Codec),
    codec_4bit.NAME: _Entry(NoConfig, codec_4bit.Uint4Codec),
    sparse.NAME: _Entry(SparseSpec, sparse.SparseCodec),
}
_DEFAULTS: dict[int, Codec] = {}  # id(entry) -> the entry's codec with its default config


def names() -> tuple[str, ...]:
    """Every registered codec's name, in registration order (what ``diloco.codec`` accepts)."""
    return tuple(_REGISTRY)


CodecName = Annotated[str, OneOf(names, 'a codec (docs/object-store.md, "Codecs")')]
"""A registered codec's name (the run config's ``diloco.codec``; the loader checks it)."""


def is_codec_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` is a registered codec."""
    return isinstance(name, str) and name in _REGISTRY


def check_codec(codec: str) -> str:
    """Return ``codec`` if known, else raise ValueError listing the valid names."""
    if not is_codec_name(codec):
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(_REGISTRY)}")
    return codec


def get(codec: str) -> Codec:
    """The codec ``codec`` with its default configuration (ValueError for an unknown name).
    Any instance decodes whatever a valid payload of that codec holds."""
    entry = _REGISTRY[check_codec(codec)]
    built = _DEFAULTS.get(id(entry))
    if built is None:
        built = _DEFAULTS[id(entry)] = entry.build(entry.config_type())
    return built


CODECS: tuple[str, ...] = names()
"""The codecs registered when this module was imported (what tests parametrize over; code asks
`names` or `is_codec_name`, which see every registered codec)."""
DENSE: tuple[str, ...] = tuple(n for n in CODECS if not get(n).needs_error_feedback)
"""The codecs that put every element on the wire (derived: no error feedback needed)."""
QUANTISED: tuple[str, ...] = tuple(n for n in DENSE if "s" in get(n).layout(1))
"""The dense codecs with per-block scales (derived: their parts include ``s``)."""
SPARSE = sparse.NAME
DEFAULT = codec_fp32.NAME  # the codec when none is named: `[diloco] codec`'s default, lossless


def config_type(codec: str) -> type:
    """The configuration dataclass of codec ``codec``."""
    return _REGISTRY[check_codec(codec)].config_type


def configured(codec: str, *configs: object) -> Codec:
    """Codec ``codec`` with the first of ``configs`` that is its configuration type (None and
    other codecs' configurations are skipped; none: its defaults)."""
    entry = _REGISTRY[check_codec(codec)]
    for config in configs:
        if isinstance(config, entry.config_type):
            return entry.build(config)
    return get(codec)


def encode(t: torch.Tensor, codec: str, spec: SparseSpec | None = None) -> Parts:
    """Encode one tensor with codec ``codec`` (`Codec.encode`). ``spec``: what ``sparseloco``
    keeps (None: `SparseSpec`'s defaults); other codecs ignore it."""
    return configured(codec, spec).encode(t)


def expected_parts(codec: str, numel: int, meta: torch.Tensor | None = None) -> PartLayout:
    """Dtype and shape of each encoded part of a received payload (`Codec.expected_parts`)."""
    return get(codec).expected_parts(numel, meta)


def check_parts(parts: Parts, codec: str, numel: int) -> str | None:
    """Why received parts cannot be decoded, or None (`Codec.check_parts`). Our encoders never
    write a non-finite or negative scale or a non-finite offset; a payload that has one would
    silently poison the average."""
    return get(codec).check_parts(parts, numel)


def decode(parts: Parts, codec: str, numel: int) -> torch.Tensor:
    """Decode parts into a flat float32 tensor of ``numel`` elements (`Codec.decode`; for
    ``fp32`` the ``q`` part itself). The caller has validated the parts."""
    return get(codec).decode(parts, numel)


def decode_into(
    parts: Parts,
    codec: str,
    out: torch.Tensor,
    *,
    accumulate: bool = False,
    weight: float | None = None,
) -> torch.Tensor:
    """``out = x`` or ``out += x`` for the decoded ``x`` times ``weight`` (`Codec.decode_into`);
    streams, so ``x`` never exists whole. The caller has validated the parts."""
    return get(codec).decode_into(parts, out, accumulate=accumulate, weight=weight)


def max_abs_error_bound(
    t: torch.Tensor, codec: str, spec: SparseSpec | None = None
) -> torch.Tensor:
    """Per-element worst-case absolute error of ``decode(encode(t))`` (flat, float32); for
    ``sparseloco`` (``spec`` None: its defaults) of the kept entries only."""
    return configured(codec, spec).max_abs_error_bound(t)


def wire_size(codec: str, numel: int, config: object | None = None) -> int:
    """Bytes of the encoded parts of ``numel`` elements under ``config`` (None: defaults)."""
    return configured(codec, config).wire_size(numel)
