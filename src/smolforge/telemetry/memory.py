"""How much memory this process has needed: its peak resident set, for run summaries."""

from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
    """The most resident memory this process has held so far, in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 1024)
