"""Feature-row datasets by name (`--dataset digits`): the data of the non-language model kinds (`models.kinds`).

Each is (features float32 [rows, n_features], labels int64 [rows]), split once into train and held-out
rows by a fixed seeded permutation, so every rank and every run holds out the same rows. Every node
resolves these names itself (`data.synthetic.BUILTIN_DATASETS`): a job uploads nothing for them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from smolforge.errors import SmolforgeError

if TYPE_CHECKING:
    import torch

HELD_OUT = 0.2  # fraction of rows held out for evaluation
SPLIT_SEED = 0


@dataclass(frozen=True)
class Tabular:
    """A dataset's train and held-out rows; `n_classes` labels 0..n_classes-1."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    n_classes: int

    @property
    def n_features(self) -> int:
        return int(self.train_x.shape[1])

    def fingerprint(self) -> str:
        """sha256 of the training rows (what a checkpoint's step means is checked against it)."""
        h = hashlib.sha256(self.train_x.numpy().tobytes())
        h.update(self.train_y.numpy().tobytes())
        return h.hexdigest()

    def stats(self) -> dict:
        return {"format": "tabular", "train_sequences": len(self.train_y), "eval_sequences": len(self.eval_y)}


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 handwritten digits (1797 rows, shipped with the package: no download), pixels / 16."""
    import torch
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target, dtype=torch.int64)


DATASETS: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {"digits": _digits}
"""Name -> loader; importing this module loads neither torch nor scikit-learn (the job checks read the names)."""
TABULAR_DATASETS = tuple(DATASETS)


def load_tabular(name: str) -> Tabular:
    """The named dataset split into train and held-out rows. Raises SmolforgeError for an unknown name."""
    if name not in DATASETS:
        raise SmolforgeError(f"no feature-row dataset named {name!r}", where="--dataset",
                             fix=f"use one of: {', '.join(sorted(DATASETS))}")
    import torch

    x, y = DATASETS[name]()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_eval = int(len(y) * HELD_OUT)
    ev, tr = perm[:n_eval], perm[n_eval:]
    return Tabular(x[tr], y[tr], x[ev], y[ev], int(y.max()) + 1)
