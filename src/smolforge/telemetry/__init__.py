"""Metrics writers (JSONL, TensorBoard) and progress reporting."""
