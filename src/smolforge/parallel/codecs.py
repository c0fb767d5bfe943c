"""How gradients and pseudo-gradients travel: fp32, fp16, blockwise int8, or sparse low-bit, with error feedback.

Shared by DiLoCo (pseudo-gradients through collectives) and the parameter servers (gradients through
Ray's object store, as numpy arrays: zero-copy buffers, never pickled tensors). Each codec is one
registered class (`CODECS`, by name) that encodes a flat fp32 tensor into named numpy arrays, decodes
them, says what a payload costs (`nbytes`, a formula: every payload of `numel` values has the same
arrays and sizes) and sums the ranks' parts (`aggregate`); what it can do is declared on it (`lossy`:
keeps an error-feedback residual; `summable`: its payloads add up in transit, an all-reduce).

- int8 is blockwise absmax: one fp32 scale per `block` values, so one outlier costs precision only in
  its own block (a per-tensor min/max, as the seed has it, flattens every small value of a large tensor
  to zero); int4 is the same at 4 bits (15 levels, two codes a byte): half the bytes.
- sparse follows SparseLoCo (Sarfi et al., arXiv 2508.15706): per chunk of `chunk` values (4096) only
  the `topk` largest magnitudes (64, 1.6 %) travel, their positions as uint16 within the chunk and their
  values at `bits` (2 or 4) on a per-chunk absmax scale; what was not sent stays in the sender's
  error-feedback buffer (SparseLoCo's accumulator, which it runs in place of outer momentum: hence
  `momentum = 0.0`, the outer momentum a DiLoCo job gets by default with this codec).
Error feedback (EF-SGD, Karimireddy et al. 2019, arXiv 1901.09847; Deep Gradient Compression, Lin et al.
2018, arXiv 1712.01887, keeps the unsent gradient locally the same way) adds what a message could not
carry to the next one: over many steps the sum of what arrived equals the sum of what was sent, up to
the last message's residual.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterator

import numpy as np
import torch

CODECS: dict[str, type["Codec"]] = {}  # name -> class, filled by `Codec.__init_subclass__`

# Values one pass of a lossy codec works on at a time (1 MiB of fp32): every pass of an encode with its
# error feedback, or of an aggregate, then reads and writes a core's cache instead of main memory, and no
# temporary is a fresh whole-model allocation. Measured on the 2-core dev machine (one thread, 109.5 M
# values, int8's quantise and residual; stop 58, BENCHMARKS.md "Scale-out at real size, stop 58"): 2.1 s
# whole, 0.17 s in pieces of 2**18, 0.25 s of 2**16, 0.41 s of 2**14.
PIECE_VALUES = 1 << 18


def spans(numel: int, unit: int, size: int = PIECE_VALUES) -> Iterator[tuple[int, int]]:
    """[a, b) ranges covering `numel` values in order, each a whole number of `unit`s (but the last) and
    about `size` values long: the pieces a codec with that `unit` encodes one at a time."""
    if unit <= 0 or numel <= 0:  # a codec whose payloads do not split: one piece
        yield 0, numel
        return
    step = max(unit, size // unit * unit)
    for a in range(0, numel, step):
        yield a, min(a + step, numel)


def _tensor(a: Any, dtype: Any = None) -> torch.Tensor:
    """A numpy array as a writable tensor, copying only where it must: a conversion (`dtype`) makes a
    fresh array anyway; otherwise a writable array is shared and a read-only one (Ray's object store
    hands those over) is copied, since `torch.from_numpy` on it warns and its tensor must not be written."""
    a = np.asarray(a)
    if dtype is not None and a.dtype != dtype:
        return torch.from_numpy(a.astype(dtype))
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().reshape(-1).cpu()


class Codec:
    """One way to carry a flat fp32 tensor. Subclasses set `name` (registered under it), `options` (the
    settings they read, e.g. `block`), `keys` (their payload's array names, by which `decode` knows a
    payload), `lossy` and `summable`, and implement `encode`, `decode` and `nbytes`."""

    name: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ()
    keys: ClassVar[frozenset[str]] = frozenset()
    lossy: ClassVar[bool] = True  # decode(encode(x)) != x: a sender keeps an error-feedback residual
    summable: ClassVar[bool] = False  # payloads add up in transit (an all-reduce); else parts are gathered
    # values whose payloads are independent and concatenate, key by key, into the payload of their
    # concatenation (`spans`: the pieces an encode and an aggregate work on); 0: only whole tensors
    unit: int = 0
    momentum: ClassVar[float | None] = None  # the outer momentum a DiLoCo job defaults to with it (None: DiLoCo's)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.name:
            CODECS[cls.name] = cls

    def encode(self, x: torch.Tensor) -> dict[str, np.ndarray]:
        """A tensor (flattened, as fp32) as the contiguous numpy arrays that carry it."""
        raise NotImplementedError

    def decode(self, payload: dict[str, Any], numel: int) -> torch.Tensor:
        """The flat fp32 tensor of `numel` values a payload carries (read-only arrays are copied, not written)."""
        raise NotImplementedError

    def nbytes(self, numel: int) -> int:
        """What a payload of `numel` values costs on the wire, in bytes (equals `payload_bytes(encode(x))`)."""
        raise NotImplementedError

    def roundtrip(self, x: torch.Tensor) -> tuple[dict[str, np.ndarray], torch.Tensor]:
        """(encode(x), what its receivers decode): the pair error feedback needs, for a codec to compute
        without going through its numpy arrays again."""
        payload = self.encode(x)
        return payload, self.decode(payload, x.numel())

    def settings(self) -> dict[str, Any]:
        """What gives its payloads and residuals meaning: {"codec": name, each option: its value}, e.g.
        {"codec": "sparse", "chunk": 4096, "topk": 64, "bits": 2}; `make_codec(s["codec"], **s)` rebuilds it."""
        return {"codec": self.name, **{k: getattr(self, k) for k in self.options}}

    def piece(self, payload: dict[str, Any], a: int, b: int) -> dict[str, Any]:
        """The part of a payload that carries values [a, b), `a` a multiple of `unit` (views, no copies);
        with `unit` 0 only the whole, (0, numel)."""
        return payload

    def aggregate(self, parts: list[dict[str, Any]], weights: list[float], numel: int) -> torch.Tensor:
        """sum_r weights[r] * decode(parts[r]), in rank order: exactly what was sent, nothing re-quantised;
        computed piece by piece (`spans`, `aggregate_piece`), the same numbers as whole tensors."""
        out = torch.empty(numel)
        for a, b in spans(numel, self.unit):
            out[a:b] = self.aggregate_piece(parts, weights, a, b)
        return out

    def aggregate_piece(self, parts: list[dict[str, Any]], weights: list[float], a: int, b: int) -> torch.Tensor:
        """Values [a, b) of `aggregate` (`a` a multiple of `unit`, or the whole with `unit` 0), as a new
        tensor: the same adds in the same order, so a caller that works piece by piece (diloco's outer step)
        gets the aggregate's bits without a whole-model tensor."""
        acc = torch.zeros(b - a)
        for p, w in zip(parts, weights):
            acc.add_(self.decode(self.piece(p, a, b), b - a) * float(w))
        return acc


class Fp32(Codec):
    """Every value as it is: nothing lost, and payloads sum in an all-reduce."""

    name, keys, lossy, summable, unit = "fp32", frozenset({"values"}), False, True, 1

    def piece(self, payload: dict[str, Any], a: int, b: int) -> dict[str, Any]:
        return {"values": np.asarray(payload["values"])[a:b]}

    def encode(self, x: torch.Tensor) -> dict[str, np.ndarray]:
        """fp32's array may share `x`'s memory."""
        return {"values": np.ascontiguousarray(_flat(x).numpy())}

    def decode(self, payload: dict[str, Any], numel: int) -> torch.Tensor:
        """fp16 values too (the same key): widened to fp32 in one conversion; fp32 shared unless read-only."""
        return _tensor(payload["values"], np.float32).reshape(-1)[:numel]

    def nbytes(self, numel: int) -> int:
        return 4 * numel


class Fp16(Fp32):
    """Half precision: 2 bytes a value, rounded; overflows past 65504 (DiLoCo sends unweighted values)."""

    name, lossy, summable = "fp16", True, False

    def encode(self, x: torch.Tensor) -> dict[str, np.ndarray]:
        return {"values": np.ascontiguousarray(_flat(x).half().numpy())}

    def nbytes(self, numel: int) -> int:
        return 2 * numel


def levels(x: torch.Tensor, block: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax, before the codes are cast: (blocks x `block` fp32 holding whole numbers in
    [-qmax, qmax], one fp32 scale per block); the last block is zero-padded (a copy only where it is short).
    Its own product with the scales is what a receiver decodes (`dequantize_int8` of its codes, bit for bit)."""
    x = x.float().reshape(-1)
    pad = (-x.numel()) % block
    blocks = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(-1, block)
    scales = blocks.abs().amax(dim=1).clamp_min_(1e-30).div_(float(qmax))
    q = torch.div(blocks, scales[:, None])
    return q.round_().clamp_(-qmax, qmax), scales


def quantize_int8(x: torch.Tensor, block: int, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax: (codes in [-qmax, qmax] as int8, one fp32 scale per block); the last block is
    zero-padded. qmax 127 is int8's; 7 is int4's (`Int4` packs the codes two to a byte)."""
    q, scales = levels(x, block, qmax)
    return q.to(torch.int8).view(-1), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """`quantize_int8`'s inverse, up to half a step of each block; the padding is cut off (`numel`)."""
    return (codes.view(scales.numel(), -1).float() * scales[:, None]).view(-1)[:numel]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in [0, 2**bits) (any integer dtype) as uint8 bytes, 8 // bits to a byte, low bits first;
    the tail is zero-padded to a whole byte."""
    per = 8 // bits
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, (-codes.numel()) % per)).view(-1, per)
    out = torch.zeros(c.shape[0], dtype=torch.uint8)
    for j in range(per):
        out |= c[:, j] << (bits * j)
    return out


def byte_table(bits: int, values: torch.Tensor | None = None) -> torch.Tensor:
    """(256, 8 // bits): each byte's codes (`pack_bits`' layout, low bits first) as uint8, or as
    `values[code]` (a tensor of 2**bits levels, in its dtype): `unpack_bits`' table."""
    b = torch.arange(256, dtype=torch.int64)
    codes = torch.stack([(b >> s) & ((1 << bits) - 1) for s in range(0, 8, bits)], dim=1)
    return codes.to(torch.uint8) if values is None else values[codes].contiguous()


_CODE_TABLES = {bits: byte_table(bits) for bits in (1, 2, 4, 8)}
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a table row's bytes -> one integer


def unpack_bits(packed: torch.Tensor, bits: int, count: int, table: torch.Tensor | None = None) -> torch.Tensor:
    """`pack_bits`' inverse: the first `count` codes, as uint8, or as a decoder's levels where `table` is
    `byte_table(bits, levels)` (looked up in the same pass, in the table's dtype). One look-up a byte, a row
    of up to 8 bytes moved as one integer: for 2**18 int4 codes, one thread, 0.16 ms against 1.30 for the
    shifts and masks per code it replaced and 0.43 for a look-up of fp32 rows (stop 62)."""
    table = _CODE_TABLES[bits] if table is None else table
    index = packed.reshape(-1).to(torch.int32)
    word = _WORDS.get(table.shape[1] * table.element_size())
    if word is None:  # wide rows (fp32 levels): a row at a time
        return table.index_select(0, index).view(-1)[:count]
    return table.view(word).view(-1).index_select(0, index).view(table.dtype)[:count]


class Int8(Codec):
    """Blockwise absmax int8: a byte a value (the last block padded) and an fp32 scale per `block` values."""

    name, options, keys = "int8", ("block",), frozenset({"codes", "scales"})
    qmax: ClassVar[int] = 127  # codes in [-qmax, qmax]
    bits: ClassVar[int] = 8  # a code's bits on the wire
    codes_key: ClassVar[str] = "codes"  # the payload's array of (packed) codes

    def __init__(self, block: int = 256):
        self.block = self.unit = int(block)

    @property
    def block_bytes(self) -> int:
        """A block's codes on the wire (whole bytes: int4's block is even)."""
        return self.block * self.bits // 8

    def piece(self, payload: dict[str, Any], a: int, b: int) -> dict[str, Any]:
        lo, hi = a // self.block, -(-b // self.block)
        return {self.codes_key: np.asarray(payload[self.codes_key])[lo * self.block_bytes:hi * self.block_bytes],
                "scales": np.asarray(payload["scales"])[lo:hi]}

    def encode(self, x: torch.Tensor) -> dict[str, np.ndarray]:
        return self._payload(*levels(_flat(x), self.block, self.qmax))

    def roundtrip(self, x: torch.Tensor) -> tuple[dict[str, np.ndarray], torch.Tensor]:
        q, scales = levels(_flat(x), self.block, self.qmax)
        return self._payload(q, scales), (q * scales[:, None]).view(-1)[:x.numel()]  # decode's arithmetic

    def _payload(self, q: torch.Tensor, scales: torch.Tensor) -> dict[str, np.ndarray]:
        """The message of `levels`' output (blocks x block whole numbers, the scales)."""
        return {"codes": np.ascontiguousarray(q.to(torch.int8).view(-1).numpy()),
                "scales": np.ascontiguousarray(scales.numpy())}

    def decode(self, payload: dict[str, Any], numel: int) -> torch.Tensor:
        # int8 codes are exact in fp32: widening them here is the one copy, read-only or not
        return dequantize_int8(_tensor(payload["codes"], np.float32), _tensor(payload["scales"]), numel)

    def nbytes(self, numel: int) -> int:
        blocks = -(-numel // self.block)
        return blocks * (self.block_bytes + 4)


class Int4(Int8):
    """Blockwise absmax at 4 bits: codes in [-7, 7] (15 levels, symmetric, so zero is exact), two to a byte
    (`pack_bits`, offset by 7), and an fp32 scale per `block` values (even: a block's codes fill whole
    bytes, so pieces of whole blocks concatenate). Half int8's bytes; the rounding error per value is up
    to 18x int8's (scale/7 against /127 steps), which error feedback carries to the next message.
    Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) sends its outer gradients at 4 bits (FP4
    E3M0) and reports no loss in quality; this codec is the blockwise-integer kind of 4 bits, with feedback."""

    name, keys = "int4", frozenset({"nibbles", "scales"})
    qmax, bits, codes_key = 7, 4, "nibbles"

    def __init__(self, block: int = 256):
        if int(block) < 2 or int(block) % 2:
            raise ValueError(f"int4 codec: block must be even (two codes a byte), got {block}")
        super().__init__(block)

    # a byte's two codes as int8 levels (nibble - 7), (256, 2): the decode's unpacking is one look-up
    table: ClassVar[torch.Tensor] = byte_table(4, torch.arange(16, dtype=torch.int8) - qmax)

    def _payload(self, q: torch.Tensor, scales: torch.Tensor) -> dict[str, np.ndarray]:
        """Two codes a byte, the first in the low nibble (`pack_bits`' layout), made from the levels as fp32
        whole numbers: lo + 16 hi + 7 * 17, exact, then one cast (a third of `pack_bits`' passes)."""
        pairs = q.view(-1, 2)
        nibbles = torch.add(pairs[:, 0], pairs[:, 1], alpha=16).add_(self.qmax * 17).to(torch.uint8)
        return {"nibbles": np.ascontiguousarray(nibbles.numpy()), "scales": np.ascontiguousarray(scales.numpy())}

    def decode(self, payload: dict[str, Any], numel: int) -> torch.Tensor:
        scales = _tensor(payload["scales"])
        codes = unpack_bits(_tensor(payload["nibbles"]), 4, scales.numel() * self.block, self.table)
        return dequantize_int8(codes, scales, numel)


class Sparse(Codec):
    """SparseLoCo's message: per chunk of `chunk` values the `topk` largest magnitudes, positions as uint16,
    values at `bits` bits on `2**bits` uniform levels spanning [-scale, scale] (scale: the chunk's largest
    sent magnitude, fp32). Payload: `idx` (uint16, chunks x topk), `q` (uint8, the packed codes), `scale`
    (fp32, one per chunk); the last chunk is zero-padded. Aggregates by scattering each part's values."""

    name, options, keys = "sparse", ("chunk", "topk", "bits"), frozenset({"idx", "q", "scale"})
    momentum = 0.0  # error feedback in place of outer momentum (SparseLoCo, section 3)

    def __init__(self, chunk: int = 4096, topk: int = 64, bits: int = 2):
        if int(topk) > int(chunk):
            raise ValueError(f"sparse codec: topk {topk} is more than a chunk ({chunk})")
        if not (1 <= topk <= chunk <= 65536) or bits not in (2, 4):
            raise ValueError(f"sparse codec: need 1 <= topk <= chunk <= 65536 and bits 2 or 4 "
                             f"(got chunk {chunk}, topk {topk}, bits {bits})")
        self.chunk, self.topk, self.bits = int(chunk), int(topk), int(bits)
        self.levels = (1 << self.bits) - 1  # the largest code: levels + 1 values, symmetric about zero
        # each byte's codes as their values on [-1, 1], before the chunk's scale (`unpack_bits`)
        self.table = byte_table(self.bits, torch.arange(self.levels + 1, dtype=torch.float32) * (2.0 / self.levels) - 1.0)
        self.unit = 4 * self.chunk  # 4 chunks' codes fill whole bytes at 2 or 4 bits: packed pieces concatenate

    def _chunks(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def encode(self, x: torch.Tensor) -> dict[str, np.ndarray]:
        x = _flat(x)
        rows = torch.nn.functional.pad(x, (0, (-x.numel()) % self.chunk)).view(-1, self.chunk)
        idx = rows.abs().topk(self.topk, dim=1, sorted=False).indices
        vals = rows.gather(1, idx)
        scale = vals.abs().amax(dim=1).clamp_min(1e-30)
        codes = torch.round((vals / scale[:, None] + 1) * (self.levels / 2)).clamp_(0, self.levels)
        return {"idx": np.ascontiguousarray(idx.to(torch.int32).numpy().astype(np.uint16)),
                "q": np.ascontiguousarray(pack_bits(codes.view(-1), self.bits).numpy()),
                "scale": np.ascontiguousarray(scale.numpy())}

    def _parts(self, payload: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in the padded flat tensor, int64; their fp32 values), chunk by chunk."""
        scale = _tensor(payload["scale"], np.float32)
        idx = _tensor(payload["idx"], np.int64).view(scale.numel(), self.topk)
        vals = unpack_bits(_tensor(payload["q"]), self.bits, idx.numel(), self.table).view_as(idx) * scale[:, None]
        rows = torch.arange(scale.numel(), dtype=torch.int64)[:, None] * self.chunk
        return (idx + rows).view(-1), vals.view(-1)

    def decode(self, payload: dict[str, Any], numel: int) -> torch.Tensor:
        where, vals = self._parts(payload)
        out = torch.zeros(np.asarray(payload["scale"]).size * self.chunk)
        out[where] = vals
        return out[:numel]

    def piece(self, payload: dict[str, Any], a: int, b: int) -> dict[str, Any]:
        """Chunks [a // chunk, ceil(b / chunk)): their positions, scales and packed codes (`unit` is 4
        chunks, so a piece's codes start on a whole byte at 2 or 4 bits)."""
        lo, hi = a // self.chunk, -(-b // self.chunk)
        per = self.topk * self.bits  # bits of one chunk's codes
        return {"idx": np.asarray(payload["idx"]).reshape(-1, self.topk)[lo:hi],
                "q": np.asarray(payload["q"])[lo * per // 8:-(-hi * per // 8)],
                "scale": np.asarray(payload["scale"])[lo:hi]}

    def aggregate(self, parts: list[dict[str, Any]], weights: list[float], numel: int) -> torch.Tensor:
        """The weighted parts scattered into one dense tensor: the same sum as decoding each (a part's
        positions are distinct, so each lands once), without a dense tensor per rank."""
        out = torch.zeros(self._chunks(numel) * self.chunk)
        for p, w in zip(parts, weights):
            where, vals = self._parts(p)
            out[where] += vals * float(w)
        return out[:numel]

    def aggregate_piece(self, parts: list[dict[str, Any]], weights: list[float], a: int, b: int) -> torch.Tensor:
        """Values [a, b) of `aggregate`: the parts' chunks there (`piece`), scattered the same way."""
        pieces = [self.piece(p, a, b) for p in parts]
        return self.aggregate(pieces, weights, b - a)

    def nbytes(self, numel: int) -> int:
        chunks = self._chunks(numel)
        return chunks * (2 * self.topk + 4) + -(-chunks * self.topk * self.bits // 8)


def make_codec(name: str, **settings: Any) -> Codec:
    """The codec `name` with the settings it reads (`Codec.options`; others are ignored).

    Raises ValueError for an unknown name or settings it refuses."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r} (one of {', '.join(CODECS)})")
    cls = CODECS[name]
    return cls(**{k: v for k, v in settings.items() if k in cls.options})


def encode(x: torch.Tensor, codec: str, block: int = 256, **settings: Any) -> dict[str, np.ndarray]:
    """A flat tensor as the contiguous numpy arrays that carry it (`decode` takes them back): numpy, not
    tensors, so that Ray's object store holds them zero-copy. fp32's array may share `x`'s memory."""
    return make_codec(codec, block=block, **settings).encode(x)


def codec_of(payload: dict[str, Any], **settings: Any) -> Codec:
    """The codec a payload was made by, told by its keys (sparse: its `chunk`/`topk`/`bits` from `settings`,
    or its defaults: the sizes of its arrays do not say them)."""
    keys = frozenset(payload)
    for cls in CODECS.values():
        if cls.keys == keys:
            return cls(**{k: v for k, v in settings.items() if k in cls.options})
    raise ValueError(f"no codec sends the arrays {sorted(keys)}")


def decode(payload: dict[str, Any], numel: int, **settings: Any) -> torch.Tensor:
    """The flat fp32 tensor an `encode` payload carries (its codec read from its keys). fp16 and int8
    codes are widened to fp32 in one conversion; fp32 values are shared unless read-only."""
    return codec_of(payload, **settings).decode(payload, numel)


def payload_bytes(payload: dict[str, Any]) -> int:
    """What a payload costs on the wire (its arrays' bytes), for the strategies' traffic counters."""
    return int(sum(np.asarray(a).nbytes for a in payload.values()))


def join_pieces(pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The payload of consecutive pieces' values (`ErrorFeedback.encode_pieces`), key by key."""
    if len(pieces) == 1:
        return pieces[0]
    return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


def pack_pieces(pieces: list[dict[str, np.ndarray]]) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """(`pack_payload(join_pieces(pieces))`, a payload of that layout for `unpack_payload`) in one copy of
    the codes: the pieces' arrays go straight into the one buffer, and the layout's arrays are only
    allocated (never written or read)."""
    keys = sorted(pieces[0])
    buf = torch.cat([torch.from_numpy(np.ascontiguousarray(p[k]).reshape(-1).view(np.uint8)) for k in keys
                     for p in pieces])
    like = {k: np.empty((sum(np.asarray(p[k]).shape[0] for p in pieces), *np.asarray(pieces[0][k]).shape[1:]),
                        dtype=np.asarray(pieces[0][k]).dtype) for k in keys}
    return buf, like


def pack_payload(payload: dict[str, np.ndarray]) -> torch.Tensor:
    """A payload's arrays (by key order) as one flat uint8 tensor: one collective carries them all, and
    its size is `payload_bytes`."""
    return torch.cat([torch.from_numpy(np.ascontiguousarray(payload[k]).reshape(-1).view(np.uint8))
                      for k in sorted(payload)])


def unpack_payload(buf: torch.Tensor, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`pack_payload`'s inverse for a payload laid out as `like` (same codec, same `numel`: same arrays)."""
    out, offset, raw = {}, 0, buf.numpy()
    for k in sorted(like):
        a = np.asarray(like[k])
        out[k] = raw[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
        offset += a.nbytes
    return out


class ErrorFeedback:
    """One stream's encoder that keeps its rounding residual and adds it to the next message, so that
    the sum of what arrived tracks the sum of what was sent (plain int8 drops a small, steady part of
    a gradient for ever; see `tests/test_codecs.py`). One per stream: residuals of different streams
    must not mix. A codec that loses nothing (fp32) keeps no residual.

    `codec`: a name (with its `settings`, e.g. `block=256`) or a `Codec`. Raises ValueError for an unknown name."""

    def __init__(self, codec: str | Codec = "fp32", **settings: Any):
        self.coder = codec if isinstance(codec, Codec) else make_codec(codec, **settings)
        self.codec = self.coder.name
        self._residual: torch.Tensor | None = None

    @property
    def residual(self) -> torch.Tensor | None:
        """What the messages so far could not carry (flat fp32), or None (fp32, or nothing sent yet): the
        stream's own buffer, which the next message of the same size overwrites in place; copy it to keep it."""
        return self._residual

    def load(self, residual: torch.Tensor | None) -> None:
        """Continue from a saved residual (a checkpoint's, or one kept for a retried collective)."""
        self._residual = None if residual is None else residual.detach().float().reshape(-1).clone()

    def encode(self, x: torch.Tensor) -> dict[str, np.ndarray]:
        """`x` plus the residual, encoded; the new residual is what this payload's rounding lost."""
        if not self.coder.lossy:
            return self.coder.encode(x)
        x = _flat(x)
        return join_pieces(self.encode_pieces(x.numel(), lambda a, b, out: out.copy_(x[a:b])))

    def encode_pieces(self, numel: int, fill: Callable[[int, int, torch.Tensor], Any]) -> list[dict[str, np.ndarray]]:
        """A lossy codec's payload of `numel` values plus the residual, as the payloads of its pieces
        (`spans` of the codec's `unit`, in order; `join_pieces` makes them one payload, `pack_pieces` one
        buffer), the values written piece by piece by `fill(a, b, out)` into `out` (fp32, b - a values):
        the caller computes them into a cache-sized buffer instead of a whole-model tensor (diloco's
        pseudo-gradient). The new residual is what the rounding lost; the same bits as `encode`. It is
        written over the old one, piece by piece after that piece is read: a fresh whole-model buffer a
        message page-faulted in 0.4 s of int4's 0.9 s encode of llama-100m (one thread, stop 62)."""
        old, pieces = self._residual, []
        residual = old if old is not None and old.numel() == numel else torch.empty(numel)
        scratch: torch.Tensor | None = None  # the first piece's size: no later piece is longer
        for a, b in spans(numel, self.coder.unit):  # piece by piece: the same payload, cache-sized passes
            scratch = torch.empty(b - a) if scratch is None else scratch
            target = scratch[:b - a]
            fill(a, b, target)
            if old is not None:
                target.add_(old[a:b])
            payload, decoded = self.coder.roundtrip(target)
            pieces.append(payload)
            torch.sub(target, decoded, out=residual[a:b])
        self._residual = residual
        return pieces

    def reset(self) -> None:
        """Forget the residual (a new stream: e.g. after the weights were replaced)."""
        self._residual = None
