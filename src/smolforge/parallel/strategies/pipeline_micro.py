"""Micro-batches at their own width, for the pipeline strategy (`pipeline.py`).

The schedule's buffers have one shape per step, so micro-batches cross the cuts padded to the step's
width; each stage crops a micro-batch to its longest row on the way in and pads back on the way out,
so every micro-batch runs as the training loop would run it alone (same shapes, same masks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from smolforge.data.encode import IGNORE
from smolforge.models.partition import Stage, positions_for
from smolforge.train.strategy import Batch


class StageStep(nn.Module):
    """What the schedule runs on this rank: its stage, on one micro-batch at the micro-batch's own width.

    Micro-batches cross the cuts at the step's width (the schedule's buffers have one shape); each is
    cropped to its longest row on the way in and padded back on the way out, so it runs exactly as the
    loop runs it alone: the same shapes, the same masks (a micro-batch without padding takes SDPA's
    causal path; padded to a longer width, it would take the masked one and round differently).
    """

    def __init__(self, stage: Stage, hidden_dtype: torch.dtype):
        super().__init__()
        self.stage = stage
        self.hidden_dtype = hidden_dtype

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        width = int(attention_mask.sum(-1).max())  # right padding: the longest row
        mask = attention_mask[:, :width]
        out = self.stage(x[:, :width].contiguous(), mask, positions_for(mask))
        if self.stage.has_head:
            return out  # logits, to the loss at this micro-batch's width
        if out.dtype != self.hidden_dtype:
            raise RuntimeError(f"stage {self.stage.lo}-{self.stage.hi} made {out.dtype} hidden states; the next "
                               f"stage's buffers hold {self.hidden_dtype}")
        return PadTo.apply(out, x.shape[1])


class PadTo(torch.autograd.Function):
    """Right-pad hidden states to the step's width with zeros; the gradient comes back contiguous, as the
    layers would get it in one process."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, width: int) -> torch.Tensor:
        ctx.width = h.shape[1]
        return F.pad(h, (0, 0, 0, width - h.shape[1]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[:, :ctx.width].contiguous(), None


def concat_micro_batches(micro: list[Batch]) -> tuple[Batch, set[str]]:
    """The step's micro-batches as one batch at the widest one's width (labels padded with IGNORE, the rest
    with 0), and which keys have a sequence dimension."""
    width = max(m["input_ids"].shape[1] for m in micro)
    per_token = {k for k, v in micro[0].items()
                 if all(m[k].ndim >= 2 and m[k].shape[1] == m["input_ids"].shape[1] for m in micro)}
    out = {}
    for k in micro[0]:
        if k in per_token:
            fill = IGNORE if k == "labels" else 0
            pad = [(0, 0) * (m[k].ndim - 2) + (0, width - m[k].shape[1]) for m in micro]
            out[k] = torch.cat([F.pad(m[k], p, value=fill) for m, p in zip(micro, pad)])
        else:
            out[k] = torch.cat([m[k] for m in micro])
    return out, per_token
