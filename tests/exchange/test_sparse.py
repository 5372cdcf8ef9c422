"""The ``sparseloco`` codec: which entries it keeps, their error bound per chunk, the packing,
the bytes on the wire, and refusal of malformed payloads read from the store."""

from __future__ import annotations

import math

import pytest
import torch

from composer_replication.exchange import codecs, sparse
from composer_replication.exchange.protocol import (
    CorruptContributionError,
    Encoding,
    decode_contribution,
    encode_contribution,
)
from composer_replication.exchange.sparse import SparseCodec, SparseSpec

SPEC = SparseSpec(density=0.02, chunk=512, bits=2)


def chunks(x: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    flat = x.reshape(-1)
    return [flat[i : i + chunk] for i in range(0, flat.numel(), chunk)]


@pytest.mark.parametrize("bits", sparse.BITS)
@pytest.mark.parametrize("numel", [1, 7, 512, 513, 3 * 512 + 100, 20_000])
def test_round_trip_keeps_the_top_k_of_every_chunk_within_the_bound(numel, bits):
    spec = SparseSpec(density=0.03, chunk=512, bits=bits)
    g = torch.Generator().manual_seed(numel + bits)
    t = torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)  # chunk-local scales
    parts = codecs.encode(t, "sparseloco", spec)
    assert codecs.check_parts(parts, "sparseloco", numel) is None
    for name, (dtype, shape) in codecs.expected_parts("sparseloco", numel, parts["m"]).items():
        assert parts[name].dtype == dtype and tuple(parts[name].shape) == shape
    got = codecs.decode(parts, "sparseloco", numel)
    k = spec.k
    for c, (x, y) in enumerate(zip(chunks(t, 512), chunks(got, 512))):
        kk = min(k, x.numel())
        top = set(torch.topk(x.abs(), kk).indices.tolist())
        sent = set(torch.nonzero(y).reshape(-1).tolist())
        assert sent <= top and len(top) == kk  # only the chunk's top-k (a level may be 0 only
        m = x.abs().max().item()  # if the whole chunk is), every other entry decodes to 0
        assert parts["s"][c].item() == pytest.approx(m, rel=0, abs=0)
        idx = torch.tensor(sorted(top))
        # independent bound: half the distance between 2**bits levels spread on [-m, m]
        bound = m / (2**bits - 1) * (1 + 1e-5) + 1e-30
        assert (y[idx] - x[idx]).abs().max().item() <= bound
        assert (y[idx].abs() <= m * (1 + 1e-6)).all()
    kept = sparse.kept(numel, 512, k)[3]
    assert parts["i"].numel() == kept == sum(min(k, len(x)) for x in chunks(t, 512))


def test_two_bit_levels_and_signs_are_the_nearest_ones():
    # one chunk, everything kept: levels -3, -1, 1, 3 (m = 3, step 2)
    t = torch.tensor([3.0, -3.0, 0.9, 1.1, -0.2, 2.2, -1.9, 0.0])
    parts = codecs.encode(t, "sparseloco", SparseSpec(density=1.0, chunk=8, bits=2))
    got = codecs.decode(parts, "sparseloco", 8)
    assert got.tolist() == [3.0, -3.0, 1.0, 1.0, -1.0, 3.0, -1.0, 1.0] or got.tolist() == [
        3.0,
        -3.0,
        1.0,
        1.0,
        -1.0,
        3.0,
        -1.0,
        -1.0,  # 0.0 is a tie between -1 and 1
    ]
    assert parts["q"].numel() == 2  # 8 codes x 2 bits
    assert parts["q"][0].item() == 3 | (0 << 2) | (2 << 4) | (2 << 6)  # first code lowest


def test_zero_tensor_and_empty_tensor_are_exact():
    for t in (torch.zeros(1000), torch.zeros(0)):
        parts = codecs.encode(t, "sparseloco", SPEC)
        assert torch.equal(codecs.decode(parts, "sparseloco", t.numel()), t)


def test_encoding_is_deterministic_and_accumulates_like_decode_then_sum():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(5000, generator=g) for _ in range(3)]
    parts = [codecs.encode(x, "sparseloco", SPEC) for x in xs]
    again = codecs.encode(xs[0], "sparseloco", SPEC)
    assert all(torch.equal(again[k], parts[0][k]) for k in again)
    out = torch.full((5000,), float("nan"))
    weights = (0.2, 0.5, 0.3)
    for i, p in enumerate(parts):
        codecs.decode_into(p, "sparseloco", out, accumulate=i > 0, weight=weights[i])
    ref = sum(codecs.decode(p, "sparseloco", 5000) * w for p, w in zip(parts, weights))
    assert torch.equal(out, ref)


def test_bytes_on_the_wire_are_about_one_percent_of_fp32():
    t = {"w": torch.randn(1_000_000), "b": torch.randn(1000)}
    size = {
        c: encode_contribution(
            t,
            rank=0,
            step=0,
            tokens=1,
            inner_steps=1,
            encoding=Encoding(codec=c, sparse=SparseSpec()),
        )[1].nbytes
        for c in ("fp32", "sparseloco")
    }
    ratio = size["sparseloco"] / size["fp32"]
    # 2 % x (2-byte position + 2 bits) + a 4-byte scale per 4096: 1.15 %
    assert 0.011 < ratio < 0.0125


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (dict(density=0.0), "density"),
        (dict(density=1.5), "density"),
        (dict(chunk=0), "chunk"),
        (dict(chunk=2**21), "chunk"),
        (dict(bits=3), "bits"),
    ],
)
def test_spec_refuses_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        SparseSpec(**bad)


def test_non_finite_values_are_refused():
    t = torch.randn(2000)
    t[1500] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        codecs.encode(t, "sparseloco", SPEC)


def _forge(monkeypatch, change) -> bytes:
    """A payload whose parts ``change`` altered after encoding (a valid checksum over them)."""
    real = SparseCodec.encode

    def forged(self, t):
        parts = real(self, t)
        change(parts)
        return parts

    with monkeypatch.context() as m:
        m.setattr(SparseCodec, "encode", forged)
        payload, _ = encode_contribution(
            {"w": torch.randn(3 * 512 + 10)},
            rank=0,
            step=0,
            tokens=None,
            inner_steps=None,
            encoding=Encoding(codec="sparseloco", sparse=SPEC),
        )
    return b"".join(bytes(memoryview(b)) for b in payload)


def _set(part: str, i: int, value: float):
    def change(parts):
        parts[part][i] = value

    return change


def _replace(part: str, tensor: torch.Tensor):
    def change(parts):
        parts[part] = tensor

    return change


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (_set("i", 0, 600), "outside its chunk"),  # past the chunk of 512
        (_set("i", 0, -1), "outside its chunk"),
        (_set("i", 1, 0), "ascending|outside"),  # a repeated position
        (_set("s", 1, float("nan")), "scale"),
        (_set("s", 0, -1.0), "scale"),
        (_set("m", 1, 600), "k 600"),  # k > chunk
        (_set("m", 2, 3), "bits"),
        (_set("m", 1, 9), "do not match"),  # valid meta, but shapes no longer match it
        (_replace("i", torch.zeros(5, dtype=torch.int16)), "do not match|expected"),
        (_replace("m", torch.zeros(2, dtype=torch.int32)), "int32"),
        (_replace("s", torch.zeros(4, dtype=torch.float64)), "do not match|expected"),
    ],
)
def test_malformed_payloads_are_refused(monkeypatch, change, match):
    blob = _forge(monkeypatch, change)
    with pytest.raises(CorruptContributionError, match=match):
        decode_contribution(blob, step=0, rank=0)


def test_a_valid_payload_decodes_to_the_same_values():
    x = torch.randn(2, 1000)
    payload, own = encode_contribution(
        {"w": x},
        rank=0,
        step=0,
        tokens=None,
        inner_steps=None,
        encoding=Encoding(codec="sparseloco", sparse=SPEC),
    )
    back = decode_contribution(b"".join(bytes(memoryview(b)) for b in payload), step=0, rank=0)
    assert torch.equal(back.decode()["w"], own.decode()["w"])
    assert back.decode()["w"].shape == (2, 1000)
    assert int(torch.count_nonzero(back.decode()["w"])) <= 2 * math.ceil(1000 / 512) * SPEC.k
