"""Tensor codecs (raw bytes + dtype + shape) and the generated gRPC stubs."""

from __future__ import annotations

import pytest
import torch

from smolforge.split import gen_proto
from smolforge.split.codec import CODECS, CodecError, decode, encode, encode_raw, wire_bytes
from smolforge.split.protocol import pb


def sample(shape=(4, 33, 128), scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def roundtrip(x, codec, **kw):
    msg = pb.Tensor.FromString(encode(x, codec, **kw).SerializeToString())  # through real protobuf bytes
    return decode(msg), msg


def test_fp32_is_exact_and_keeps_dtype_and_shape():
    x = sample()
    y, msg = roundtrip(x, "fp32")
    assert torch.equal(x, y) and y.dtype == torch.float32 and list(msg.shape) == [4, 33, 128]
    assert len(msg.data) == x.numel() * 4


@pytest.mark.parametrize("codec,rtol", [("fp16", 1e-3), ("bf16", 8e-3)])
def test_half_codecs_round_trip_within_their_precision(codec, rtol):
    x = sample()
    y, msg = roundtrip(x, codec)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert len(msg.data) == x.numel() * 2
    assert torch.allclose(y, x, rtol=rtol, atol=1e-6)


def test_bf16_tensors_travel_and_come_back_as_bf16():
    x = sample().to(torch.bfloat16)
    for codec in CODECS:
        y, _ = roundtrip(x, codec)
        assert y.dtype == torch.bfloat16


def test_fp16_clamps_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 1.0])
    y, _ = roundtrip(x, "fp16")
    assert torch.isfinite(y).all() and float(y[0]) == pytest.approx(65504.0)


@pytest.mark.parametrize("block", [64, 7])
def test_int8_blockwise_error_bound(block):
    x = sample((5, 31, 40), scale=10.0)
    x[0, 0, :5] = 500.0  # an outlier only hurts its own block
    y, msg = roundtrip(x, "int8", block_size=block)
    assert len(msg.data) == x.numel() and len(msg.scales) == 4 * -(-x.numel() // block)
    flat_x, flat_err = x.reshape(-1), (y - x).abs().reshape(-1)
    n = flat_x.numel()
    pad = -n % block
    absmax = torch.cat([flat_x.abs(), torch.zeros(pad)]).view(-1, block).amax(1)
    bound = (absmax / 254.0).repeat_interleave(block)[:n] * (1 + 1e-5) + 1e-7
    assert bool((flat_err <= bound).all()), float((flat_err - bound).max())
    # most blocks are far more accurate than the outlier block
    assert float(flat_err[block * 2:].max()) < 0.2


def test_int8_zero_and_empty_tensors():
    z, _ = roundtrip(torch.zeros(3, 100), "int8")
    assert torch.equal(z, torch.zeros(3, 100))
    e, _ = roundtrip(torch.zeros(0, 4), "int8")
    assert e.shape == (0, 4)
    e, _ = roundtrip(torch.zeros(2, 0), "fp32")
    assert e.shape == (2, 0)


def test_raw_is_exact_for_masks_and_positions():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.uint8)
    pos = torch.arange(6, dtype=torch.int32).view(2, 3)
    assert torch.equal(decode(encode_raw(mask)), mask)
    assert torch.equal(decode(encode_raw(pos)), pos)
    assert torch.equal(decode(encode_raw(torch.ones(2, 2, dtype=torch.bool))), torch.ones(2, 2, dtype=torch.bool))


def test_non_contiguous_input():
    x = sample((8, 16)).t()
    assert torch.equal(roundtrip(x, "fp32")[0], x)


@pytest.mark.parametrize("mutate,match", [
    (lambda m: setattr(m, "data", m.data[:-1]), "needs"),
    (lambda m: setattr(m, "codec", "zip"), "unknown codec"),
    (lambda m: setattr(m, "dtype", "complex64"), "unknown dtype"),
    (lambda m: m.shape.__setitem__(0, -4), "bad tensor shape"),
    (lambda m: m.shape.extend([1] * 9), "bad tensor shape"),
    (lambda m: m.shape.__setitem__(0, 10**12), "exceeds"),
])
def test_malformed_messages_are_codec_errors(mutate, match):
    msg = encode(sample((2, 3, 4)), "fp32")
    mutate(msg)
    with pytest.raises(CodecError, match=match):
        decode(msg)


def test_malformed_int8_and_raw():
    msg = encode(sample((2, 70)), "int8")
    msg.scales = msg.scales[:4]
    with pytest.raises(CodecError, match="scales"):
        decode(msg)
    msg = encode(sample((2, 70)), "int8")
    msg.block_size = 0
    with pytest.raises(CodecError, match="block_size"):
        decode(msg)
    raw = encode_raw(torch.ones(3, dtype=torch.int64))
    raw.data += b"x"
    with pytest.raises(CodecError):
        decode(raw)
    with pytest.raises(CodecError, match="floating"):
        encode(torch.ones(3, dtype=torch.long), "fp32")


def test_wire_bytes_per_codec():
    n = 4 * 33 * 128
    assert wire_bytes("fp32", n) == 4 * n and wire_bytes("fp16", n) == 2 * n == wire_bytes("bf16", n)
    assert wire_bytes("int8", n) == n + 4 * (n // 64)
    for codec in CODECS:
        msg = encode(sample(), codec)
        assert len(msg.data) + len(msg.scales) == wire_bytes(codec, n)


def test_stubs_are_generated_with_a_package_relative_import(tmp_path):
    assert gen_proto.is_current()
    gen_proto._generate_into(tmp_path)
    text = (tmp_path / "split_pb2_grpc.py").read_text()
    assert "from . import split_pb2 as split__pb2" in text and "\nimport split_pb2" not in text
    assert gen_proto.is_current(tmp_path)
    (tmp_path / gen_proto.STAMP).write_text("stale\n")  # a changed .proto makes them stale
    assert not gen_proto.is_current(tmp_path)


def test_a_huge_int8_block_size_is_refused_before_any_allocation():
    """34 bytes of input once allocated 517 MiB: a block larger than the tensor is refused at the header."""
    import resource

    msg = pb.Tensor(codec="int8", dtype="float32", shape=[2], data=b"\x01\x02", scales=b"\x00\x00\x80\x3f",
                    block_size=2**29)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CodecError, match="block_size"):
        decode(msg)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB
    small = encode(torch.tensor([1.0, -2.0, 0.5]), "int8")  # a small tensor is one block of its own size
    assert small.block_size == 3 and torch.allclose(decode(small), torch.tensor([1.0, -2.0, 0.5]), atol=0.02)
