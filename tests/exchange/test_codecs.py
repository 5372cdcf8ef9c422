"""Wire codecs: round trips within their error bounds, packing, sizes, determinism, and the
streaming decode-and-accumulate path against slow whole-tensor references."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch
from tolerances import tol

from composer_replication.exchange import codec_4bit, codecs
from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.merge_arithmetic import average_in_rank_order
from composer_replication.exchange.protocol import (
    CorruptContributionError,
    Encoding,
    decode_contribution,
    encode_contribution,
    make_commit,
    parse_commit,
)
from composer_replication.exchange.settings import AllReduceConfig

B = codecs.CHUNK
PASS = codecs.PASS_BLOCKS * B  # elements per streaming pass
SHAPES = [(), (1,), (7,), (2048,), (2049,), (3, 1000), (2, 3, 4097), (2 * PASS + 2 * B + 3,)]


def round_trip(t: torch.Tensor, codec: str) -> torch.Tensor:
    parts = codecs.encode(t, codec)
    for name, (dtype, shape) in codecs.expected_parts(codec, t.numel()).items():
        assert parts[name].dtype == dtype and tuple(parts[name].shape) == shape
    return codecs.decode(parts, codec, t.numel()).view(t.shape)


@pytest.mark.parametrize("codec", codecs.DENSE)
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


@pytest.mark.parametrize("codec", codecs.DENSE)
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
        c: encode_contribution(
            t, rank=0, step=0, tokens=1, inner_steps=1, encoding=Encoding(codec=c)
        )[1].nbytes
        for c in codecs.DENSE
    }
    ratio = {c: size[c] / size["fp32"] for c in codecs.DENSE}
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
            str(tmp_path),
            2,
            r,
            config=AllReduceConfig(codec=codec, timeout_s=5, poll_interval_s=0.01),
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

    from composer_replication.exchange import checksums, wire
    from composer_replication.exchange.protocol import HEADER_KEY

    t = {"w": torch.randn(300, 7), "s": torch.tensor(2.5), "h": torch.randn(9).bfloat16()}
    payload, contrib = encode_contribution(
        t, rank=1, step=3, tokens=5, inner_steps=2, encoding=Encoding(codec="int8")
    )
    blob = b"".join(payload)
    theirs = st_load(blob)  # the reference implementation accepts our framing
    assert theirs.keys() == contrib.parts.keys()
    assert all(torch.equal(theirs[k], contrib.parts[k]) for k in theirs)
    meta, ours, data = wire.unframe(blob, "x")
    assert HEADER_KEY in meta and checksums.digest([data]) == contrib.digest
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


# ----------------------------------------------------------------------------- references
# Written the slow, obvious way (whole tensors, padding, Python-level reshapes), independently
# of the streaming implementation.


def blocks64(x: torch.Tensor) -> list[torch.Tensor]:
    """The float64 values of each quantisation block (the last one may be partial)."""
    flat = x.detach().reshape(-1).to(torch.float32).to(torch.float64)
    return list(flat.split(B)) if flat.numel() else []


def analytic_step(block: torch.Tensor, codec: str) -> float:
    """The quantisation step of one block: absmax / 127 (int8), (max - min) / 15 (4-bit)."""
    if codec == "int8":
        return block.abs().max().item() / 127
    return (block.max() - block.min()).item() / 15


def slow_decode(parts: dict[str, torch.Tensor], codec: str, n: int) -> torch.Tensor:
    q = parts["q"]
    if codec in ("fp32", "bf16"):
        return q.to(torch.float32).clone()
    s = parts["s"].repeat_interleave(B)[:n]
    if codec == "int8":
        return q.to(torch.float32) * s
    codes = torch.stack([q & 0x0F, q >> 4], dim=1).reshape(-1)[:n].to(torch.float32)
    return codes * s + parts["z"].repeat_interleave(B)[:n]


def slow_encode(x: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """The quantiser's formula on padded whole tensors (each block padded with its own value)."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    rows = -(-n // B)
    pad = rows * B - n
    padded = torch.cat([flat, flat[-1:].expand(pad)]).view(rows, B)  # repeats the last value
    if codec == "int8":
        s = padded.abs().amax(1) / 127.0
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(padded / safe[:, None]).clamp(-127, 127).to(torch.int8)
        return {"q": q.reshape(-1)[:n], "s": s}
    lo, hi = padded.amin(1), padded.amax(1)
    s = (hi - lo) / 15.0
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((padded - lo[:, None]) / safe[:, None]).clamp(0, 15).to(torch.uint8)
    codes = torch.cat([codes.reshape(-1)[:n], codes.new_zeros(n % 2)])
    return {"q": codes[0::2] | (codes[1::2] << 4), "s": s, "z": lo}


def assert_within_analytic_bound(x: torch.Tensor, got: torch.Tensor, codec: str) -> None:
    """max |error| of every block <= half its step (+ float32 rounding slack)."""
    for i, (blk, dec) in enumerate(zip(blocks64(x), blocks64(got))):
        err = (dec - blk).abs().max().item()
        slack = 8 * 2.0**-24 * blk.abs().max().item() + torch.finfo(torch.float32).tiny
        bound = analytic_step(blk, codec) / 2
        assert err <= bound + slack, f"block {i}: max error {err} > bound {bound} (+{slack})"


# ----------------------------------------------------------------------------- error bounds

EDGE_CASES = {
    "zeros": lambda: torch.zeros(3 * B + 5),
    "constant": lambda: torch.full((2 * B + 1,), -0.37),
    "constant_block_then_random": lambda: torch.cat([torch.full((B,), 3.5), torch.randn(B + 9)]),
    "one_huge_value": lambda: torch.randn(3 * B).index_fill_(0, torch.tensor([B + 17]), 1e30),
    "one_huge_negative": lambda: torch.randn(B + 3).index_fill_(0, torch.tensor([2]), -3e37),
    "subnormal_block": lambda: torch.randn(B + 100) * 1e-42,
    "tiny_tail_after_huge_head": lambda: torch.cat([torch.tensor([1e6]), torch.randn(B + 10)]),
    "multi_pass_odd_tail": lambda: torch.randn(2 * PASS + 7) * 10,
    "exact_pass_multiple": lambda: torch.randn(PASS),
    "single_element": lambda: torch.tensor([2.5]),
}


@pytest.mark.parametrize("codec", codecs.QUANTISED)
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_error_per_block_within_analytic_bound_edge_cases(codec, case):
    torch.manual_seed(len(case))
    x = EDGE_CASES[case]()
    got = round_trip(x, codec)
    assert_within_analytic_bound(x, got, codec)
    for blk, dec in zip(blocks64(x), blocks64(got)):
        if codec == "4bit" and bool((blk == blk[0]).all()):
            assert torch.equal(dec, blk)  # constant blocks decode exactly (step 0, offset = value)
    if case == "one_huge_value":  # the huge value costs only its own block its precision
        for i in (0, 2):
            err = (got.view(3, B)[i] - x.view(3, B)[i]).abs().max().item()
            assert err <= x.view(3, B)[i].abs().max().item() / (127 if codec == "int8" else 7)
    if case == "tiny_tail_after_huge_head":  # the partial last block has its own scale
        s = codecs.encode(x, codec)["s"][-1].item()
        tail = x[B:]
        expected = tail.abs().max() / 127 if codec == "int8" else (tail.max() - tail.min()) / 15
        # the codec's scale and this one: a max (or max - min, one rounding) and one division in
        # fp32, possibly grouped differently: 2 gamma_2
        bound = tol(2, abs(expected.item()))
        assert s == pytest.approx(expected.item(), rel=bound["rtol"], abs=bound["atol"])


@pytest.mark.parametrize("codec", codecs.QUANTISED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_input_dtypes_encode_as_their_float32_values(codec, dtype):
    x = (torch.randn(2 * B + 77) * 3).to(dtype)
    parts, ref = codecs.encode(x, codec), codecs.encode(x.to(torch.float32), codec)
    assert all(torch.equal(parts[k], ref[k]) for k in ref)
    assert_within_analytic_bound(x, round_trip(x, codec), codec)


@pytest.mark.parametrize("codec", codecs.QUANTISED)
@pytest.mark.parametrize("n", [0, 1, 2, B - 1, B, B + 1, PASS + B + 1, 2 * PASS])
def test_encode_equals_the_whole_tensor_formula(codec, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-2, 2, n)
    got, ref = codecs.encode(x, codec), slow_encode(x, codec)
    assert got.keys() == ref.keys()
    if n == 0:  # one block of scale 0 (and offset 0) for an empty tensor
        ref = {k: (v if k == "q" else torch.zeros(1)) for k, v in ref.items()}
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_4bit_range_overflow_is_refused_with_a_clear_error():
    x = torch.tensor([3e38, -3e38, 0.0])
    with pytest.raises(ValueError, match="overflows float32"):
        codecs.encode(x, "4bit")
    assert_within_analytic_bound(x, round_trip(x, "int8"), "int8")  # int8 has no such limit


# ----------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("codec", codecs.DENSE)
@pytest.mark.parametrize("weights", [None, (0.2, 0.5, 0.3)])
def test_decode_into_accumulates_exactly_like_decode_then_sum(codec, weights):
    n = PASS + 3 * B + 1  # two passes, odd, partial last block
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, generator=g) * 10.0**k for k in (-2, 0, 1)]
    parts = [codecs.encode(x, codec) for x in xs]
    out = torch.full((n,), float("nan"))  # every element must be written
    for i, p in enumerate(parts):
        w = None if weights is None else weights[i]
        assert codecs.decode_into(p, codec, out, accumulate=i > 0, weight=w) is out
    ref = None
    for i, p in enumerate(parts):
        x = slow_decode(p, codec, n)
        x = x if weights is None else x * weights[i]
        ref = x if ref is None else ref + x
    assert torch.equal(out, ref)
    assert torch.equal(codecs.decode(parts[0], codec, n), slow_decode(parts[0], codec, n))


def test_4bit_packing_does_not_depend_on_byte_order(monkeypatch):
    x = torch.randn(PASS + B + 3)
    parts = codecs.encode(x, "4bit")
    little = codecs.decode(parts, "4bit", x.numel())
    monkeypatch.setattr(codec_4bit, "_LITTLE_ENDIAN", False)  # the strided path other CPUs take
    strided = codecs.encode(x, "4bit")
    assert all(torch.equal(strided[k], parts[k]) for k in parts)
    assert torch.equal(codecs.decode(parts, "4bit", x.numel()), little)


@pytest.mark.parametrize("codec", codecs.DENSE)
@pytest.mark.parametrize("weighting", ["equal", "tokens"])
def test_average_of_contributions_equals_the_slow_reference(codec, weighting):
    shapes = {"w": (3, B + 5), "b": (7,), "s": ()}
    contribs, decoded = {}, {}
    for r in range(3):
        g = torch.Generator().manual_seed(r)
        t = {k: torch.randn(sh, generator=g) * (r + 1) for k, sh in shapes.items()}
        payload, _ = encode_contribution(
            t, rank=r, step=0, tokens=10 * (r + 1), inner_steps=1, encoding=Encoding(codec=codec)
        )
        blob = bytearray(b"".join(payload))  # a privately fetched buffer, as from a local store
        c = decode_contribution(blob, step=0, rank=r)
        contribs[r] = c
        decoded[r] = {
            n: slow_decode(p, codec, max(1, math.prod(sh))).view(sh) for n, sh, p in c.encoded()
        }
    record = make_commit(
        step=0,
        world_size=3,
        included=list(contribs.values()),
        weighting=weighting,
        committed_by=0,
        excluded={},
    )
    commit = parse_commit(json.dumps(record).encode(), step=0, world_size=3)  # as read back
    got = average_in_rank_order(commit, dict(contribs))
    for name in shapes:
        if weighting == "equal":
            ref = (decoded[0][name] + decoded[1][name] + decoded[2][name]) / 3
        else:
            w = commit["weights"]
            ref = decoded[0][name] * w[0] + decoded[1][name] * w[1] + decoded[2][name] * w[2]
        assert got[name].dtype == torch.float32 and torch.equal(got[name], ref), name


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "codec, part, value, match",
    [
        ("int8", "s", float("nan"), "scale"),
        ("int8", "s", -1.0, "scale"),
        ("4bit", "s", float("inf"), "scale"),
        ("4bit", "z", float("nan"), "offset"),
    ],
)
def test_contribution_with_a_forged_scale_is_refused(monkeypatch, codec, part, value, match):
    """A payload with a valid checksum but a non-finite or negative scale/offset (which our
    encoder never writes) would poison the average: it is rejected when validated."""
    x = torch.randn(3 * B)
    codec_class = type(codecs.get(codec))
    real_encode = codec_class.encode

    def forged(self, t):
        parts = real_encode(self, t)
        parts[part][1] = value
        return parts

    monkeypatch.setattr(codec_class, "encode", forged)
    payload, _ = encode_contribution(
        {"w": x}, rank=0, step=0, tokens=None, inner_steps=None, encoding=Encoding(codec=codec)
    )
    with pytest.raises(CorruptContributionError, match=f"'w'.*{match}"):
        decode_contribution(b"".join(payload), step=0, rank=0)


def test_decode_into_refuses_a_wrong_output_buffer():
    parts = codecs.encode(torch.randn(100), "int8")
    with pytest.raises(ValueError, match="float32"):
        codecs.decode_into(parts, "int8", torch.empty(100, dtype=torch.float64))
    with pytest.raises(ValueError, match="wrong length"):
        codecs.decode_into(parts, "int8", torch.empty(99))
    with pytest.raises(ValueError, match="contiguous"):
        codecs.decode_into(parts, "int8", torch.empty(200)[::2])


def test_codecs_run_on_one_thread_and_restore_the_callers_thread_count(monkeypatch):
    seen = []
    real_mul = torch.mul

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_mul(*args, **kwargs)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parts = codecs.encode(torch.randn(3 * B), "int8")
        monkeypatch.setattr(torch, "mul", spy)
        codecs.decode(parts, "int8", 3 * B)
        assert seen == [1]  # the decode pass ran single-threaded
        assert torch.get_num_threads() == 2  # and the caller's setting is back
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- the seam


@pytest.mark.parametrize("codec", codecs.CODECS)
@pytest.mark.parametrize("numel", [0, 1, 7, B, 3 * B + 5, 9000])
def test_layout_and_wire_size_are_what_encode_writes(codec, numel):
    spec = codecs.SparseSpec(density=0.1, chunk=64, bits=4)
    c = codecs.configured(codec, spec)
    parts = c.encode(torch.randn(numel, generator=torch.Generator().manual_seed(numel)))
    layout = {k: (t.dtype, tuple(t.shape)) for k, t in parts.items()}
    assert layout == c.layout(numel)
    assert c.wire_size(numel) == sum(t.numel() * t.element_size() for t in parts.values())
    assert codecs.wire_size(codec, numel, spec) == c.wire_size(numel)
    # what a reader expects of the payload is what was written (sparseloco: from part "m")
    assert c.expected_parts(numel, parts.get("m")) == layout
    assert codecs.get(codec).check_parts(parts, numel) is None


def test_each_codec_owns_its_config():
    spec = codecs.SparseSpec(density=0.5, chunk=8, bits=1)
    assert codecs.configured("sparseloco", None, spec).config is spec
    assert codecs.get("sparseloco").config == codecs.SparseSpec()  # the defaults
    assert codecs.config_type("sparseloco") is codecs.SparseSpec
    for name in codecs.DENSE:  # fixed formats: nothing to configure, another codec's is skipped
        assert codecs.config_type(name) is codecs.NoConfig
        assert codecs.configured(name, spec).config == codecs.NoConfig()
    with pytest.raises(ValueError, match="unknown codec 'fp8'; choose one of fp32, bf16"):
        codecs.get("fp8")


def test_what_callers_ask_of_a_codec_instead_of_its_name():
    needs_feedback = {c for c in codecs.CODECS if codecs.get(c).needs_error_feedback}
    zero_copy = {c for c in codecs.CODECS if codecs.get(c).zero_copy_decode}
    assert needs_feedback == {"sparseloco"} and zero_copy == {"fp32"}
    parts = codecs.encode(torch.randn(300), "fp32")
    assert codecs.decode(parts, "fp32", 300) is parts["q"]  # zero copy: the payload itself


def test_no_module_outside_the_registry_compares_a_codec_name():
    """The codec seam: exchange/, diloco/ and run/ ask the registry (`codecs.get(name)`) and
    the codec's properties; only the registry and the codec modules know the names."""
    import ast
    from pathlib import Path

    import composer_replication

    pkg = Path(composer_replication.__file__).parent
    own = {"codecs.py", "codec_blocks.py", "sparse.py"}
    found = []
    for folder in ("exchange", "diloco", "run"):
        for path in sorted((pkg / folder).rglob("*.py")):
            if path.name in own or path.name.startswith("codec_"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare):
                    for sub in ast.walk(node):
                        if isinstance(sub, ast.Constant) and sub.value in codecs.CODECS:
                            found.append(f"{path.relative_to(pkg)}:{node.lineno}")
    assert found == []
