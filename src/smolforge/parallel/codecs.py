"""How gradients and pseudo-gradients travel: fp32, fp16, or blockwise int8 with error feedback.

Shared by DiLoCo (pseudo-gradients through collectives) and the parameter servers (gradients through
Ray's object store, as numpy arrays: zero-copy buffers, never pickled tensors). int8 is blockwise
absmax: one fp32 scale per `block` values, so one outlier costs precision only in its own block (a
per-tensor min/max, as the seed has it, flattens every small value of a large tensor to zero).
Error feedback keeps what a message could not carry and adds it to the next one: over many steps
the sum of what arrived equals the sum of what was sent, up to one message's rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

CODECS = ("fp32", "fp16", "int8")


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8: (codes, one fp32 scale per block); the last block is zero-padded."""
    pad = (-x.numel()) % block
    blocks = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, block)
    scales = blocks.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    codes = torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """`quantize_int8`'s inverse, up to half a step of each block; the padding is cut off (`numel`)."""
    return (codes.view(scales.numel(), -1).float() * scales[:, None]).view(-1)[:numel]


def encode(x: torch.Tensor, codec: str, block: int = 256) -> dict[str, np.ndarray]:
    """A flat tensor as the contiguous numpy arrays that carry it (`decode` takes them back): numpy, not
    tensors, so that Ray's object store holds them zero-copy. fp32's array may share `x`'s memory."""
    x = x.detach().float().reshape(-1).cpu()
    if codec == "fp32":
        return {"values": np.ascontiguousarray(x.numpy())}
    if codec == "fp16":
        return {"values": np.ascontiguousarray(x.half().numpy())}
    if codec == "int8":
        codes, scales = quantize_int8(x, block)
        return {"codes": np.ascontiguousarray(codes.numpy()), "scales": np.ascontiguousarray(scales.numpy())}
    raise ValueError(f"unknown codec {codec!r} (one of {', '.join(CODECS)})")


def _tensor(a: Any, dtype: Any = None) -> torch.Tensor:
    """A numpy array as a writable tensor, copying only where it must: a conversion (`dtype`) makes a
    fresh array anyway; otherwise a writable array is shared and a read-only one (Ray's object store
    hands those over) is copied, since `torch.from_numpy` on it warns and its tensor must not be written."""
    a = np.asarray(a)
    if dtype is not None and a.dtype != dtype:
        return torch.from_numpy(a.astype(dtype))
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def decode(payload: dict[str, Any], numel: int) -> torch.Tensor:
    """The flat fp32 tensor an `encode` payload carries (its codec read from its keys). fp16 and int8
    codes are widened to fp32 in one conversion; fp32 values are shared unless read-only."""
    if "codes" in payload:
        # int8 codes are exact in fp32: widening them here is the one copy, read-only or not
        return dequantize_int8(_tensor(payload["codes"], np.float32), _tensor(payload["scales"]), numel)
    return _tensor(payload["values"], np.float32).reshape(-1)[:numel]


def payload_bytes(payload: dict[str, Any]) -> int:
    """What a payload costs on the wire (its arrays' bytes), for the strategies' traffic counters."""
    return int(sum(np.asarray(a).nbytes for a in payload.values()))


class ErrorFeedback:
    """One stream's encoder that keeps its rounding residual and adds it to the next message, so that
    the sum of what arrived tracks the sum of what was sent (plain int8 drops a small, steady part of
    a gradient for ever; see `tests/test_codecs.py`). One per stream: residuals of different streams
    must not mix. fp32 loses nothing and keeps no residual."""

    def __init__(self, codec: str = "fp32", block: int = 256):
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r} (one of {', '.join(CODECS)})")
        self.codec, self.block = codec, block
        self._residual: torch.Tensor | None = None

    @property
    def residual(self) -> torch.Tensor | None:
        """What the messages so far could not carry (flat fp32), or None (fp32, or nothing sent yet)."""
        return self._residual

    def encode(self, x: torch.Tensor) -> dict[str, np.ndarray]:
        """`x` plus the residual, encoded; the new residual is what this payload's rounding lost."""
        if self.codec == "fp32":
            return encode(x, "fp32")
        target = x.detach().float().reshape(-1).cpu()
        if self._residual is not None:
            target = target + self._residual
        payload = encode(target, self.codec, self.block)
        self._residual = target - decode(payload, target.numel())
        return payload

    def reset(self) -> None:
        """Forget the residual (a new stream: e.g. after the weights were replaced or a resume)."""
        self._residual = None
