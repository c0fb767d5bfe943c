"""Tensors to and from the wire: raw bytes + dtype + shape, with a choice of lossy codecs.

Why not pickle (or torch.save): unpickling runs code, and the trunk server accepts messages
from the network. Here a message is only ever numbers, and `decode` checks that the byte count
matches the shape before it touches them, so a malformed message is an error, never a crash.

Codecs for activations and gradients (the payload of every Forward and Backward):
- fp32: exact (the equivalence tests run with it);
- fp16 / bf16: half the bytes; fp16 is clamped to its finite range so large activations do not
  turn into inf;
- int8: a quarter of the bytes plus one float32 scale per block; each value is within
  scale/2 = absmax(block)/254 of the original.
`raw` carries integer tensors (attention masks, positions) exactly.
"""

from __future__ import annotations

import math
import sys

import torch

from smolforge.split.protocol import pb

CODECS = ("fp32", "fp16", "bf16", "int8")
WIRE_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_BLOCK = 64
MAX_DIMS = 8
FP16_MAX = 65504.0

if sys.byteorder != "little":  # the wire format is little-endian raw bytes
    raise ImportError("smolforge split learning needs a little-endian machine")


class CodecError(ValueError):
    """A tensor message that cannot be decoded (wrong size, unknown dtype or codec)."""


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu().reshape(-1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: torch.frombuffer wants a writable buffer, and the tensor must own its memory.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def encode(t: torch.Tensor, codec: str = "fp32", block_size: int = DEFAULT_BLOCK) -> pb.Tensor:
    """A floating tensor as a wire message with `codec`; decode() restores shape and dtype."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; use one of {', '.join(CODECS)}")
    if not t.is_floating_point():
        raise CodecError(f"codec {codec} is for floating tensors, got {t.dtype}; use encode_raw")
    msg = pb.Tensor(codec=codec, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape))
    x = t.detach()
    if codec == "int8":
        flat = x.reshape(-1).float().cpu()
        n = flat.numel()
        block_size = min(block_size, max(n, 1))  # a small tensor is one block of its own size
        nblocks = -(-n // block_size)
        padded = torch.zeros(nblocks * block_size, dtype=torch.float32)
        padded[:n] = flat
        blocks = padded.view(nblocks, block_size)
        scale = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        msg.data = _to_bytes(q.reshape(-1)[:n])
        msg.scales = _to_bytes(scale)
        msg.block_size = block_size
        return msg
    wire = WIRE_DTYPE[codec]
    if codec == "fp16":
        x = x.float().clamp(-FP16_MAX, FP16_MAX)
    msg.data = _to_bytes(x.to(wire))
    return msg


def encode_raw(t: torch.Tensor) -> pb.Tensor:
    """An exact copy of any supported tensor (masks, positions)."""
    if t.dtype not in DTYPE_NAMES:
        raise CodecError(f"dtype {t.dtype} is not supported on the wire")
    return pb.Tensor(codec="raw", dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), data=_to_bytes(t))


def _check_shape(shape, max_numel: int) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise CodecError(f"bad tensor shape {list(shape)}")
    if math.prod(shape) > max_numel:
        raise CodecError(f"tensor of shape {list(shape)} exceeds {max_numel} elements")
    return shape


def decode(msg: pb.Tensor, max_numel: int = 1 << 31) -> torch.Tensor:
    """The tensor in `msg` (on CPU, in the sender's dtype). Raises CodecError when malformed."""
    if msg.dtype not in DTYPES:
        raise CodecError(f"unknown dtype {msg.dtype!r}")
    dtype = DTYPES[msg.dtype]
    shape = _check_shape(msg.shape, max_numel)
    n = math.prod(shape)
    if msg.codec == "raw":
        expected = n * dtype.itemsize
        if len(msg.data) != expected:
            raise CodecError(f"raw {msg.dtype} tensor {list(shape)} needs {expected} bytes, got {len(msg.data)}")
        return _from_bytes(msg.data, dtype, shape)
    if msg.codec not in CODECS:
        raise CodecError(f"unknown codec {msg.codec!r}; expected one of {', '.join(CODECS)} or raw")
    if not dtype.is_floating_point:
        raise CodecError(f"codec {msg.codec} carries floating tensors, not {msg.dtype}")
    if msg.codec == "int8":
        bs = int(msg.block_size)
        if bs <= 0 or bs > max(n, 1):  # checked before any allocation: a huge block would allocate its size
            raise CodecError(f"int8 tensor of {n} elements has block_size {bs} (must be 1..{max(n, 1)})")
        nblocks = -(-n // bs)
        if len(msg.data) != n or len(msg.scales) != 4 * nblocks:
            raise CodecError(f"int8 tensor {list(shape)} needs {n} bytes and {nblocks} scales, "
                             f"got {len(msg.data)} bytes and {len(msg.scales) / 4:g} scales")
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        q = _from_bytes(msg.data, torch.int8, (n,)).float()
        scale = _from_bytes(msg.scales, torch.float32, (nblocks,))
        values = q * scale[torch.arange(n) // bs]
        return values.reshape(shape).to(dtype)
    wire = WIRE_DTYPE[msg.codec]
    expected = n * wire.itemsize
    if len(msg.data) != expected:
        raise CodecError(f"{msg.codec} tensor {list(shape)} needs {expected} bytes, got {len(msg.data)}")
    return _from_bytes(msg.data, wire, shape).to(dtype)


def wire_bytes(codec: str, numel: int, block_size: int = DEFAULT_BLOCK) -> int:
    """Payload bytes of one tensor of `numel` values under `codec` (without protobuf framing)."""
    if codec == "int8":
        return numel + 4 * -(-numel // block_size)
    return numel * WIRE_DTYPE[codec].itemsize
