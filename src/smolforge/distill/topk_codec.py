"""The compact top-k codec of teacher-store shards (format VERSION 2, codec "sorted-rice-q8").

Why this shape (measured in bench/distill_store.py; V = 32,000, k = 32):
- Ids: a row's k ids are a *set* once their log-probs travel with them, so each row is sorted by id
  and stored as gaps (first id, then id[j] - id[j-1] - 1). Gaps of k ids drawn from V are close to
  geometric, for which Golomb-Rice coding is near optimal: the low `b` bits of each gap go into a
  fixed-width bit stream, the rest in unary into a second stream (both decode without a Python
  loop: the unary stream's zero bits mark where each quotient ends). About log2(V/k) + 2 bits an id
  against ceil(log2 V) for plain bit-packing; the rank permutation costs nothing because the
  log-probs below are stored in the same id order and say the rank themselves.
- Log-probs: the row's top log-prob stays fp16; the others are 8-bit codes of their gap below it,
  uniform over [0, span] with span (fp16) the row's largest gap, so a flat row and a peaked row
  both use all 256 levels. The error is at most span / 510 nats per value, plus the fp16 rounding
  of top and span (relative 2^-11).
- Tail mass: fp16, as in VERSION 1 (deriving it as 1 - sum(top-k) loses tiny tails to cancellation).
- A maintained compressor (stdlib zlib, level 9: deterministic, so equal records give equal bytes)
  runs over each byte stream; it also shrinks the prompt and response ids and the text that a shard
  carries besides the top-k. lzma gave the same size (within 0.1 byte/token) 5-300x slower.

Decoding returns each row in rank order again (log-prob descending, ties by id), so readers that
take column 0 as the teacher's favourite still can; ids are exact, log-probs within
that bound.
"""

from __future__ import annotations

import zlib

import numpy as np

CODEC = "sorted-rice-q8"
LEVELS = 255  # 8-bit codes 0..255: gap = code * span / LEVELS
COMPRESSOR = "zlib-9"


def compress_bytes(raw: bytes) -> bytes:
    return zlib.compress(raw, 9)


def decompress_bytes(blob: bytes) -> bytes:
    return zlib.decompress(blob)


# ----------------------------------------------------------------------------- bit streams

def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Non-negative ints < 2**bits as a little-endian bit stream (uint8); empty when bits == 0."""
    v = np.ascontiguousarray(values, dtype=np.uint32).reshape(-1)
    if bits == 0 or v.size == 0:
        return np.zeros(0, dtype=np.uint8)
    if int(v.max()) >= (1 << bits):
        raise ValueError(f"value {int(v.max())} does not fit in {bits} bits")
    bitmat = ((v[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(bitmat.reshape(-1), bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    if bits == 0 or count == 0:
        return np.zeros(count, dtype=np.int64)
    flat = np.unpackbits(np.asarray(packed, dtype=np.uint8), count=count * bits, bitorder="little")
    return (flat.reshape(count, bits).astype(np.int64) << np.arange(bits, dtype=np.int64)).sum(axis=1)


def rice_parameter(gaps: np.ndarray) -> int:
    """The Rice parameter b that gives the fewest bits for these gaps (tried exhaustively: cheap)."""
    if gaps.size == 0:
        return 0
    g = gaps.astype(np.int64)
    top = max(1, int(g.max()).bit_length())
    sizes = [g.size * (b + 1) + int((g >> b).sum()) for b in range(top + 1)]
    return int(np.argmin(sizes))


def rice_encode(gaps: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(unary quotient stream, fixed-width remainder stream) of non-negative gaps."""
    g = np.ascontiguousarray(gaps, dtype=np.int64).reshape(-1)
    q = g >> b
    ends = np.cumsum(q + 1) - 1  # position of each quotient's terminating zero
    unary = np.ones(int(ends[-1]) + 1 if g.size else 0, dtype=np.uint8)
    unary[ends] = 0
    return np.packbits(unary, bitorder="little"), pack_bits(g & ((1 << b) - 1), b)


def rice_decode(unary: np.ndarray, rem: np.ndarray, b: int, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    bits = np.unpackbits(np.asarray(unary, dtype=np.uint8), bitorder="little")
    ends = np.flatnonzero(bits == 0)[:count]
    if ends.size != count:
        raise ValueError("unary stream ends early")
    q = np.diff(ends, prepend=-1) - 1
    return (q << b) | unpack_bits(rem, b, count)


# ------------------------------------------------------------------------------------ rows

def encode_rows(values: np.ndarray, indices: np.ndarray) -> dict[str, np.ndarray | int]:
    """[rows, k] log-probs and ids → the codec's arrays (plus the Rice parameter `rice_b`)."""
    values = np.asarray(values, dtype=np.float32)
    indices = np.asarray(indices, dtype=np.int64)
    rows, k = values.shape
    order = np.argsort(indices, axis=1, kind="stable")
    ids = np.take_along_axis(indices, order, axis=1)
    vals = np.take_along_axis(values, order, axis=1)
    gaps = np.diff(ids, axis=1, prepend=-1) - 1  # first column: the id itself
    if rows and int(gaps.min()) < 0:
        raise ValueError("top-k ids repeat within a row")
    top = vals.max(axis=1) if k else np.zeros(rows, np.float32)
    top16 = top.astype(np.float16)
    below = np.maximum(top16.astype(np.float32)[:, None] - vals, 0.0)
    span16 = (below.max(axis=1) if k else np.zeros(rows, np.float32)).astype(np.float16)
    span = span16.astype(np.float32)
    # span rounded down to fp16 may sit just under the largest gap: clip rather than overflow
    codes = np.clip(np.rint(below / np.where(span > 0, span, 1.0)[:, None] * LEVELS), 0, LEVELS).astype(np.uint8)
    b = rice_parameter(gaps)
    unary, rem = rice_encode(gaps, b)
    return {"top": top16, "span": span16, "codes": codes, "ids_unary": unary, "ids_rem": rem, "rice_b": b}


def decode_rows(arrays: dict[str, np.ndarray], rows: int, k: int, rice_b: int,
                rank_order: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The codec's arrays → ([rows, k] float32 log-probs, [rows, k] int64 ids), in rank order
    (log-prob descending, ties by id) or, with rank_order=False, in id order as stored."""
    gaps = rice_decode(arrays["ids_unary"], arrays["ids_rem"], rice_b, rows * k).reshape(rows, k)
    ids = np.cumsum(gaps + 1, axis=1) - 1
    codes = np.asarray(arrays["codes"]).reshape(rows, k).astype(np.float32)
    top = np.asarray(arrays["top"]).astype(np.float32)
    span = np.asarray(arrays["span"]).astype(np.float32)
    vals = top[:, None] - codes * (span / LEVELS)[:, None]
    if not rank_order:
        return vals, ids
    rank = np.lexsort((ids, -vals), axis=-1) if rows else np.zeros((0, k), np.int64)
    return np.take_along_axis(vals, rank, axis=1), np.take_along_axis(ids, rank, axis=1)


# ---------------------------------------------------------------------------- what it costs

def bucket_kl(stored_lp: np.ndarray, stored_tail: np.ndarray, exact_lp: np.ndarray,
              exact_tail: np.ndarray) -> np.ndarray:
    """Per row KL(Q ‖ P) in nats over the k + 1 buckets (k top-k ids, one tail bucket).

    Q is the stored (decoded) distribution, normalised the way the KD losses normalise it
    (`losses.teacher_bucket_logprobs` at T = 1: softmax over [top-k log-probs, log tail]); P is the
    teacher's exact one (fp32 top-k log-probs and tail mass as computed from its full logits). The
    two rows must list the same ids in the same order. This is the error the codec adds; what
    top-k itself drops is `truncation_kl` (computed by the teacher, which has the full logits).
    """
    def buckets(lp, tail):
        t = np.asarray(tail, dtype=np.float64)
        logt = np.where(t > 0, np.log(np.maximum(t, 1e-300)), -np.inf)
        x = np.concatenate([np.asarray(lp, dtype=np.float64), logt[:, None]], axis=1)
        m = x.max(axis=1, keepdims=True)
        return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))

    q, p = buckets(stored_lp, stored_tail), buckets(exact_lp, exact_tail)
    qe = np.exp(q)
    with np.errstate(invalid="ignore"):
        terms = np.where(qe > 0, qe * (q - p), 0.0)
    return np.maximum(terms.sum(axis=1), 0.0)

