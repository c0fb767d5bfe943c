"""The single-worker training engine (also each rank of a data-parallel group)."""
