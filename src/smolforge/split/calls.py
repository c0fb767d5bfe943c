"""What the trunk server's calls share: the error statuses it answers with (the caller learns what
was wrong, the server carries on) and the checks of the masks and positions that come with hidden
states.

Their own module because both the training sessions (`server`) and the generation sessions
(`trunk_generate`) use them, and `server` imports `trunk_generate`.
"""

from __future__ import annotations

import grpc
import torch


class CallError(Exception):
    """An error status for the caller; the server carries on."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(msg: str) -> CallError:
    """A malformed request: INVALID_ARGUMENT (the session stays usable)."""
    return CallError(grpc.StatusCode.INVALID_ARGUMENT, msg)


def precondition(msg: str) -> CallError:
    """A well-formed request this session cannot take now, or a client/server mismatch."""
    return CallError(grpc.StatusCode.FAILED_PRECONDITION, msg)


def not_found(what: str, ident: str) -> CallError:
    """NOT_FOUND tells a client that the server restarted or freed it (it then starts again)."""
    return CallError(grpc.StatusCode.NOT_FOUND,
                     f"no {what} {ident[:8]}… on this server (it restarted, or the {what} timed out)")


def model_context(config) -> int:
    """The positions a trunk's model can attend over (its config's `max_position_embeddings`; 65,536 when
    it names none): the one bound every call checks, training and generation alike."""
    return int(getattr(config, "max_position_embeddings", 0) or 1 << 16)


def check_length(declared_shape, context: int, what: str = "hidden") -> None:
    """A [batch, seq, ...] tensor's declared sequence length within `context`, checked from the message's
    shape field before its bytes are decoded or anything is computed; INVALID_ARGUMENT otherwise."""
    shape = [int(d) for d in declared_shape]
    if len(shape) >= 2 and shape[1] > context:
        raise invalid(f"{what} holds a sequence of {shape[1]} positions, longer than the model's context "
                      f"({context}); send sequences of at most {context} positions")


def check_mask(mask: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """An integer/bool [rows, width] mask of 0s and 1s, as long; INVALID_ARGUMENT otherwise."""
    if tuple(mask.shape) != (rows, width) or mask.is_floating_point():
        raise invalid(f"attention_mask must be an integer/bool tensor [{rows}, {width}], "
                      f"got {mask.dtype} {list(mask.shape)}")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise invalid("attention_mask values must be 0 or 1")
    return mask.to(torch.long)


def check_positions(pos: torch.Tensor, rows: int, width: int, limit: int | None = None) -> torch.Tensor:
    """Integer positions [rows or 1, width], each >= 0 (and < limit when given), as long."""
    if pos.ndim != 2 or pos.shape[1] != width or pos.shape[0] not in (1, rows) or pos.is_floating_point() \
            or pos.dtype == torch.bool:
        raise invalid(f"positions must be an integer tensor [{rows} or 1, {width}], got {pos.dtype} {list(pos.shape)}")
    if pos.numel() and int(pos.min()) < 0:
        raise invalid("positions must be >= 0")
    if limit is not None and pos.numel() and int(pos.max()) >= limit:
        raise invalid(f"positions must be < {limit}, got {int(pos.max())}")
    return pos.to(torch.long)
