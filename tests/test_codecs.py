"""The gradient codecs (`smolforge.parallel.codecs`): round trips, sizes, and why error feedback matters."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from smolforge.parallel.codecs import ErrorFeedback, decode, encode, payload_bytes


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "int4"])
def test_round_trip_within_the_codecs_precision(codec):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))  # not a multiple of the block
    payload = encode(x, codec, block=256)
    for a in payload.values():
        a.setflags(write=False)  # as Ray hands them over: read-only buffers
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = decode(payload, x.numel())
    assert y.dtype == torch.float32 and y.shape == x.shape
    if codec == "fp32":
        assert torch.equal(x, y)
    elif codec == "fp16":
        torch.testing.assert_close(y, x, atol=2e-3, rtol=1e-3)
    else:
        levels = {"int8": 127, "int4": 7}[codec]
        blocks = torch.nn.functional.pad(x, (0, 24)).view(-1, 256)
        step = (blocks.abs().amax(1) / levels).repeat_interleave(256)[:1000]
        assert bool(((y - x).abs() <= step / 2 + 1e-6).all())
        if codec == "int4":  # all 15 levels in use, zero included: the nibbles' offset is right
            assert set(torch.round(y / step).tolist()) == set(range(-7, 8))


@pytest.mark.parametrize("codec,share", [("int8", (256 + 4) / 1024), ("int4", (128 + 4) / 1024)])
def test_a_blockwise_codec_sends_what_it_claims(codec, share):
    """int8 a byte a value, int4 half a byte, each with an fp32 scale per block of 256: about a quarter and
    an eighth of fp32; the codec's own formula (`nbytes`, what auto plans with) is the payload's size."""
    from smolforge.parallel.codecs import make_codec

    x = torch.randn(10_240)  # 40 whole blocks
    payload = encode(x, codec, 256)
    assert payload_bytes(payload) == make_codec(codec, block=256).nbytes(x.numel()) == share * payload_bytes(encode(x, "fp32"))
    assert all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in payload.values())


def test_error_feedback_keeps_the_sum_of_what_arrived_exact():
    """200 gradients whose every block holds one large outlier, so that their small, steady part (a bias
    of 1e-3 per value) rounds to zero in int8: without feedback it never arrives and the error of the
    running sum grows with every step; with feedback the residual carries it into later messages and
    the sum of what arrived stays within one message's rounding of the true sum."""
    g = torch.Generator().manual_seed(1)
    n, steps = 1024, 200
    bias = 1e-3 * torch.ones(n)
    feedback = ErrorFeedback("int8", block=256)
    true_sum, with_fb, without = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    errors_without = {}
    for t in range(steps):
        grad = bias + 1e-4 * torch.randn(n, generator=g)
        grad[::256] = 1.0  # one outlier per block sets its scale: 1/127 per step, far above the bias
        true_sum += grad
        with_fb += decode(feedback.encode(grad), n)
        without += decode(encode(grad, "int8", 256), n)
        if t + 1 in (50, steps):
            errors_without[t + 1] = float((without - true_sum).norm())  # absolute: it grows with the sum
    err_fb = float((with_fb - true_sum).norm() / true_sum.norm())
    err_plain = float((without - true_sum).norm() / true_sum.norm())
    # measured: err_fb 2.2e-4, err_plain 1.6e-2 (71x); errors_without 1.60 at 50 steps, 6.39 at 200
    assert err_fb <= 1e-3, err_fb
    assert err_plain >= 10 * err_fb, (err_plain, err_fb)
    assert errors_without[steps] > 3 * errors_without[50], errors_without
    # with feedback, the running sum's error is exactly what the last message could not carry
    torch.testing.assert_close(true_sum - with_fb, feedback.residual, atol=1e-4, rtol=0)


def test_error_feedback_residuals_per_codec():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    fp32 = ErrorFeedback("fp32")
    assert torch.equal(decode(fp32.encode(x), x.numel()), x) and fp32.residual is None
    fp16 = ErrorFeedback("fp16")
    fp16.encode(x)
    assert torch.equal(fp16.residual, x - x.half().float())  # the fp16 rounding, carried to the next one
    int8 = ErrorFeedback("int8", block=256)
    int8.encode(x)
    assert int8.residual is not None and float(int8.residual.abs().max()) > 0
    int8.reset()
    assert int8.residual is None
    with pytest.raises(ValueError):
        ErrorFeedback("bf16")


def test_decode_copies_only_what_it_must():
    x = torch.randn(1000)
    payload = encode(x, "fp32")
    assert np.shares_memory(decode(payload, x.numel()).numpy(), payload["values"])  # writable: shared
    payload["values"].setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = decode(payload, x.numel())
    assert not np.shares_memory(y.numpy(), payload["values"])  # read-only: copied, so y can be written
    y.mul_(2)
    assert torch.equal(torch.from_numpy(payload["values"].copy()), x)


@pytest.mark.parametrize("codec,settings", [("fp16", {}), ("int8", {"block": 256}), ("int8", {"block": 100}),
                                            ("int4", {"block": 256}), ("int4", {"block": 100}),
                                            ("sparse", {"topk": 64, "bits": 2}), ("sparse", {"topk": 3, "bits": 2}),
                                            ("sparse", {"chunk": 1000, "topk": 3, "bits": 2}),
                                            ("sparse", {"chunk": 1000, "topk": 5, "bits": 4})])
def test_a_message_encoded_in_pieces_is_the_message_encoded_whole(codec, settings):
    """Error feedback and the aggregate work piece by piece (`codecs.spans`, cache-sized); the payload, the
    new residual and the sum of the parts are bit for bit those of whole tensors, including a tail piece
    and codes packed across pieces (sparse: 3 codes a chunk at 2 bits)."""
    from smolforge.parallel.codecs import PIECE_VALUES, make_codec, spans

    g = torch.Generator().manual_seed(1)
    n = 2 * PIECE_VALUES + 12_345
    coder = make_codec(codec, **settings)
    assert len(list(spans(n, coder.unit))) >= 3
    x, r = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    stream = ErrorFeedback(coder)
    stream.load(r)
    payload = stream.encode(x)
    whole = coder.encode(x + r)
    assert sorted(payload) == sorted(whole)
    for k in whole:
        assert payload[k].dtype == whole[k].dtype and np.array_equal(payload[k], whole[k]), k
    assert torch.equal(stream.residual, (x + r) - coder.decode(whole, n))
    other = coder.encode(torch.randn(n, generator=g))
    weights = [0.25, 0.75]
    expected = torch.zeros(n) + coder.decode(payload, n) * weights[0] + coder.decode(other, n) * weights[1]
    assert torch.equal(coder.aggregate([payload, other], weights, n), expected)
    # diloco's path: the values filled a piece at a time (from the parameters), the pieces packed into one
    # buffer, the parts summed a piece at a time into the outer step: the same bits at every stage
    from smolforge.parallel.codecs import pack_payload, pack_pieces, unpack_payload

    again = ErrorFeedback(coder)
    again.load(r)
    buf, like = pack_pieces(again.encode_pieces(n, lambda a, b, out: out.copy_(x[a:b])))
    assert torch.equal(buf, pack_payload(payload)) and torch.equal(again.residual, stream.residual)
    parts = [unpack_payload(buf, like), other]
    pieced = torch.cat([coder.aggregate_piece(parts, weights, a, b) for a, b in spans(n, coder.unit)])
    assert torch.equal(pieced, expected)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_packed_codes_unpack_by_table_to_the_codes_and_to_their_levels(bits):
    """`unpack_bits` looks a byte's codes up in a table (`byte_table`), its rows moved as one integer where
    they fit 8 bytes: it gives back what `pack_bits` packed (a tail short of a byte included), and with a
    table of levels, each code's level, whether the rows are narrow (int8 levels) or wide (fp32)."""
    from smolforge.parallel.codecs import byte_table, pack_bits, unpack_bits

    codes = torch.randint(0, 1 << bits, (1001,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert packed.numel() == -(-1001 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, 1001), codes.to(torch.uint8))
    narrow = torch.arange(1 << bits, dtype=torch.int16).sub(1 << (bits - 1)).to(torch.int8)  # two's complement
    wide = torch.linspace(-1, 1, 1 << bits)
    for levels in (narrow, wide):
        got = unpack_bits(packed, bits, 1001, byte_table(bits, levels))
        assert got.dtype == levels.dtype and torch.equal(got, levels[codes]), levels.dtype


def test_a_residual_written_in_place_is_the_one_a_new_stream_would_keep():
    """The next message overwrites the residual's buffer piece by piece (no whole-model allocation a sync):
    over three messages each residual is bit for bit that of a new stream loaded with a copy of the last,
    and a copy taken before a message keeps its values."""
    from smolforge.parallel.codecs import PIECE_VALUES

    g = torch.Generator().manual_seed(3)
    n = PIECE_VALUES + 777  # two pieces, the second short
    stream = ErrorFeedback("int4")
    stream.encode(torch.randn(n, generator=g))
    for _ in range(3):
        x, kept = torch.randn(n, generator=g), stream.residual.clone()
        fresh = ErrorFeedback("int4")
        fresh.load(kept)
        buffer = stream.residual
        assert all(np.array_equal(a, b) for a, b in zip(stream.encode(x).values(), fresh.encode(x).values()))
        assert stream.residual is buffer and torch.equal(stream.residual, fresh.residual)
        assert not torch.equal(kept, stream.residual)


def test_int4_refuses_an_odd_block_where_a_job_is_checked():
    """Two codes a byte: an odd block would split a byte between pieces. The codec refuses it, and diloco's
    settings ask the codec, so a job spec is refused by name before anything runs."""
    from smolforge.parallel.codecs import make_codec
    from smolforge.parallel.strategies import strategy_class

    with pytest.raises(ValueError, match="int4 codec: block must be even"):
        make_codec("int4", block=101)
    with pytest.raises(ValueError, match="int4 codec: block must be even"):
        strategy_class("diloco").settings_dict({"codec": "int4", "block": 101})
    assert strategy_class("diloco").settings_dict({"codec": "int4", "block": 128})["block"] == 128
