"""The one safetensors header parser (`wire.parse_header`): every malformed header is refused
with a `FrameError` naming the fault, and contributions, pushes and state snapshots all go
through it (so their errors are the same)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save as st_save

from composer_replication.exchange import wire
from composer_replication.exchange.document_format import decode_state, encode_state
from composer_replication.exchange.protocol import (
    Encoding,
    decode_contribution,
    encode_contribution,
)
from composer_replication.exchange.vocabulary import CorruptContributionError, FrameError


def framed(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A blob: little-endian u64 header length, the JSON header, the data section."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def test_a_well_formed_header_parses_to_entries_in_data_order():
    i8_3 = {"dtype": "I8", "shape": [3], "data_offsets": [8, 11]}
    blob = framed({"__metadata__": {"k": "v"}, "b": F32_2, "a": i8_3}, b"\0" * 11)
    h = wire.parse_header(blob, "ok")
    assert h.metadata == {"k": "v"}
    assert [(e.name, e.dtype, e.shape, e.begin, e.end) for e in h.entries] == [
        ("b", torch.float32, (2,), 0, 8),
        ("a", torch.int8, (3,), 8, 11),
    ]
    assert h.data_start == len(blob) - 11


MALFORMED = {
    # the blob ends inside the length prefix, or inside the header it announces
    "truncated_prefix": (b"\x10\0\0", "3 bytes is not a safetensors payload"),
    "truncated_header": (framed({"a": F32_2}, b"\0" * 8)[:20], "header length"),
    "truncated_data": (framed({"a": F32_2}, b"\0" * 5), "malformed or truncated"),
    # a length of 0, above MAX_HEADER_BYTES, or past the end of the blob
    "zero_length": (framed({}, length=0), "header length 0"),
    "oversized_length": (framed({}, length=wire.MAX_HEADER_BYTES + 1), "header length"),
    "length_past_end": (framed({"a": F32_2}, b"\0" * 8, length=10**6), "header length 1000000"),
    "bad_json": (struct.pack("<Q", 9) + b"{not json", "header is not JSON"),
    "not_an_object": (framed([1, 2]), "not a JSON object"),
    "bad_metadata": (framed({"__metadata__": {"k": 1}}), "metadata must map strings"),
    # offsets: negative, reversed, disagreeing with the shape, past the data section
    "negative_offset": (
        framed({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, b"\0" * 8),
        "inconsistent offsets/shape",
    ),
    "offsets_disagree_with_shape": (
        framed({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        "inconsistent offsets/shape",
    ),
    "offsets_out_of_range": (
        framed({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
        "data section is 8 bytes, header describes 16",
    ),
    "overlapping": (
        framed(
            {"a": F32_2, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8
        ),
        "does not follow",
    ),
    "gap": (
        framed({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
        "does not follow",
    ),
    "wrong_dtype": (
        framed({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "malformed safetensors entry 'a'",
    ),
    "bad_shape": (
        framed({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "malformed safetensors entry 'a'",
    ),
    "extra_key": (framed({"a": {**F32_2, "x": 1}}, b"\0" * 8), "malformed safetensors entry"),
    "pickle": (b"\x80\x04\x95" + b"\0" * 40, "not a safetensors payload"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_header_is_refused_naming_the_fault(case):
    blob, match = MALFORMED[case]
    with pytest.raises(FrameError, match=match) as info:
        wire.parse_header(blob, "hostile object")
    assert str(info.value).startswith("hostile object: ")
    assert isinstance(info.value, CorruptContributionError)  # what every reader catches


@pytest.mark.parametrize("case", ["truncated_data", "overlapping", "wrong_dtype"])
def test_contributions_and_states_share_the_parser_and_its_errors(case):
    blob, match = MALFORMED[case]
    with pytest.raises(FrameError, match=match):
        decode_contribution(blob, step=0, rank=0)
    with pytest.raises(FrameError, match=match):
        decode_state(blob, name="global", round=0)


def test_states_written_by_safetensors_round_trip_through_the_parser():
    state = {"w": torch.randn(3, 4), "step": torch.tensor(7), "b": torch.ones(2, dtype=torch.bool)}
    tensors, extra = decode_state(
        encode_state(state, name="global", round=2, extra={"k": 1}), name="global", round=2
    )
    assert extra == {"k": 1} and set(tensors) == set(state)
    assert all(torch.equal(tensors[k], state[k]) for k in state)
    raw = bytearray(st_save({"w": torch.ones(2)}, metadata={"x": "y"}))
    tensors["w"].add_(1)  # the caller owns the decoded tensors
    assert wire.parse_header(raw, "plain").metadata == {"x": "y"}


def test_a_contribution_header_survives_the_parser():
    payload, contrib = encode_contribution(
        {"x": torch.randn(5)},
        rank=1,
        step=2,
        tokens=None,
        inner_steps=None,
        encoding=Encoding(codec="int8"),
    )
    blob = b"".join(payload)
    h = wire.parse_header(blob, "mine")
    assert sorted(e.name for e in h.entries) == sorted(contrib.parts)
    assert decode_contribution(blob, step=2, rank=1).digest == contrib.digest
