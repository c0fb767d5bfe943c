"""Datasets: JSONL readers, chat templating and masking, packing, the bundled task set."""

from smolforge.data.collate import collate
from smolforge.data.formats import Example, read_examples
from smolforge.data.splits import Splits, load_splits

__all__ = ["Example", "Splits", "collate", "load_splits", "read_examples"]
