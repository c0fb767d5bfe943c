"""Batching: right-pad token rows into tensors for training; left-pad prompts for generation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from smolforge.data.encode import IGNORE

if TYPE_CHECKING:
    import torch


def collate(features: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    import torch  # here, not at import: reading and checking data needs no torch

    width = max(len(f["input_ids"]) for f in features)
    n = len(features)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    for i, f in enumerate(features):
        k = len(f["input_ids"])
        input_ids[i, :k] = torch.tensor(f["input_ids"], dtype=torch.long)
        labels[i, :k] = torch.tensor(f["labels"], dtype=torch.long)
        attention[i, :k] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), left-padded: every row ends at the same column, so a batch decodes
    together and the last positions are every row's last tokens (teachers' batches, on-policy samples)."""
    import torch

    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, row in enumerate(seqs):
        ids[r, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[r, width - len(row):] = 1
    return ids, mask
