"""Wire codecs: round trips within their error bounds, packing, sizes, determinism."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from composer_replication.exchange import codecs
from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.protocol import encode_contribution

SHAPES = [(), (1,), (7,), (2048,), (2049,), (3, 1000), (2, 3, 4097)]


def round_trip(t: torch.Tensor, codec: str) -> torch.Tensor:
    parts = codecs.encode(t, codec)
    for name, (dtype, shape) in codecs.expected_parts(codec, t.numel()).items():
        assert parts[name].dtype == dtype and tuple(parts[name].shape) == shape
    return codecs.decode(parts, codec, t.numel()).view(t.shape)


@pytest.mark.parametrize("codec", codecs.CODECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_is_bounded(codec, shape):
    g = torch.Generator().manual_seed(math.prod(shape) + len(codec))
    # mixed magnitudes: chunk-local scales matter
    t = torch.randn(shape, generator=g) * torch.logspace(-3, 2, math.prod(shape)).view(shape)
    got = round_trip(t, codec)
    assert got.dtype == torch.float32 and got.shape == t.shape
    err = (got - t).abs().reshape(-1)
    bound = codecs.max_abs_error_bound(t, codec)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max()}"
    if codec == "fp32":
        assert torch.equal(got, t)


@pytest.mark.parametrize("codec", ["int8", "4bit"])
def test_quantised_codecs_are_not_trivially_exact(codec):
    t = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    got = round_trip(t, codec)
    rel = ((got - t).norm() / t.norm()).item()
    # rms error of a uniform quantiser is step / sqrt(12): ~0.6% (int8), ~14% (4bit, 7-sigma range)
    assert 0 < rel < (0.01 if codec == "int8" else 0.16)


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_constant_and_zero_tensors_are_exact(codec):
    for t in (torch.zeros(5000), torch.full((3001,), 0.5)):
        assert torch.equal(round_trip(t, codec), t)


def test_4bit_packing_two_codes_per_byte():
    t = torch.arange(16, dtype=torch.float32)  # lo=0, hi=15: codes == values
    parts = codecs.encode(t, "4bit")
    assert parts["q"].tolist() == [a | (b << 4) for a, b in zip(range(0, 16, 2), range(1, 16, 2))]
    assert torch.equal(codecs.decode(parts, "4bit", 16), t)
    odd = codecs.encode(torch.arange(5, dtype=torch.float32), "4bit")
    assert odd["q"].numel() == 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("codec", ["int8", "4bit"])
def test_non_finite_values_are_refused_by_quantised_codecs(codec, bad):
    t = torch.randn(5000)
    t[4500] = bad  # in the third chunk: every chunk is checked, not only the first
    with pytest.raises(ValueError, match="non-finite"):
        codecs.encode(t, codec)


def test_fp32_passes_non_finite_through_and_unknown_codec_raises():
    t = torch.tensor([1.0, float("inf")])
    assert torch.equal(round_trip(t, "fp32"), t)
    with pytest.raises(ValueError, match="unknown codec"):
        codecs.encode(t, "fp8")


def test_bytes_on_the_wire_shrink_with_the_codec():
    t = {"w": torch.randn(1_000_000), "b": torch.randn(1000)}
    size = {
        c: encode_contribution(t, rank=0, step=0, tokens=1, inner_steps=1, codec=c)[1].nbytes
        for c in codecs.CODECS
    }
    ratio = {c: size[c] / size["fp32"] for c in codecs.CODECS}
    assert 0.49 < ratio["bf16"] < 0.51
    assert 0.25 < ratio["int8"] < 0.255
    assert 0.125 < ratio["4bit"] < 0.13


@pytest.mark.parametrize("codec", ["bf16", "int8", "4bit"])
def test_allreduce_with_codec_is_bit_identical_and_near_mean(tmp_path, codec):
    ts = {
        r: {"w": torch.randn(3, 5000, generator=torch.Generator().manual_seed(r))} for r in (0, 1)
    }
    out = {}

    def go(r):
        ar = ObjectStoreAllReduce(
            str(tmp_path), 2, r, codec=codec, timeout_s=5, poll_interval_s=0.01
        )
        out[r] = (ar.allreduce(ts[r], step=0), ar.last_result)

    threads = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert torch.equal(out[0][0]["w"], out[1][0]["w"])
    bound = sum(codecs.max_abs_error_bound(ts[r]["w"], codec) for r in (0, 1)) / 2 + 1e-6
    err = (out[0][0]["w"] - (ts[0]["w"] + ts[1]["w"]) / 2).abs().reshape(-1)
    assert bool((err <= bound).all())
    assert out[0][1].codec == codec and out[0][1].bytes_uploaded < 15000 * 4 * 0.6


def test_wire_payload_is_standard_safetensors_both_ways():
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from composer_replication.exchange import wire
    from composer_replication.exchange.protocol import HEADER_KEY

    t = {"w": torch.randn(300, 7), "s": torch.tensor(2.5), "h": torch.randn(9).bfloat16()}
    payload, contrib = encode_contribution(t, rank=1, step=3, tokens=5, inner_steps=2, codec="int8")
    blob = b"".join(payload)
    theirs = st_load(blob)  # the reference implementation accepts our framing
    assert theirs.keys() == contrib.parts.keys()
    assert all(torch.equal(theirs[k], contrib.parts[k]) for k in theirs)
    meta, ours, data = wire.unframe(blob, "x")
    assert HEADER_KEY in meta and wire.digest([data]) == contrib.digest
    ref = {"a": torch.arange(6, dtype=torch.int64).view(2, 3), "b": torch.ones(0), "c": t["h"]}
    meta, back, _ = wire.unframe(st_save(ref, metadata={"k": "v"}), "y")  # and theirs is ours
    assert meta == {"k": "v"} and all(torch.equal(back[k], ref[k]) for k in ref)


@pytest.mark.parametrize(
    "entries, match",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, "truncated"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "does not follow"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}}, "inconsistent"),
        ({"a": {"dtype": "O", "shape": [1], "data_offsets": [0, 4]}}, "malformed"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, "malformed"),
    ],
)
def test_unframe_rejects_inconsistent_headers(entries, match):
    import json
    import struct

    from composer_replication.exchange import wire

    header = json.dumps(entries).encode()
    blob = struct.pack("<Q", len(header)) + header + b"\0" * 4
    with pytest.raises(wire.FrameError, match=match):
        wire.unframe(blob, "hostile")
