"""A student's training row: token ids, labels, and the teacher's top-k over its target tokens.

Its own module because two producers make rows (the store's shards, `distill/student.py`, and the
student's own samples, `distill/on_policy.py`) and the student trains on both alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Row:
    input_ids: list[int]
    labels: list[int]
    topk_logprobs: np.ndarray | None = None  # [targets, k]
    topk_indices: np.ndarray | None = None
    tail: np.ndarray | None = None
