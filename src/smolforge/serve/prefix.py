"""The prefix cache: a prompt that begins like a recent one starts from that one's KV, not from nothing.

Why: chat clients resend the whole conversation each turn, and many requests share a system prompt;
recomputing those tokens is most of a CPU's time to first token. After a prompt's prefill the
engine keeps a copy of its KV (`SnapshotModel.snapshot`: torch tensors, or llama.cpp's sequence
state); a new prompt whose longest common prefix with a kept one is at least `min_tokens` long is
prefilled from that prefix on (`restore`), and only the rest is computed.

Why least-recently-used and bounded in bytes: the snapshots are as large as the KV they copy (a
300-token prompt of a 100M model is megabytes); `max_bytes` bounds them all, and the entry used
longest ago goes first. A prompt that is a prefix of a kept one is not kept again (the longer one
serves it), and a kept one that is a prefix of the new prompt is replaced by it.

What a snapshot holds may live elsewhere (a chain of stages keeps each stage's layers' KV on that
stage: serve/stages.py): `on_drop` is told of every snapshot the cache lets go (evicted, replaced by a
longer prompt, too large to keep, or failed to restore), so its holder can free it. The cache's decisions (the
key, the hit, the eviction) are this module's alone, whatever holds the bytes.

Lookup compares the prompt with each entry by binary search over list-slice equality (C-speed
comparisons, O(entries x log length) of them); a cache holds tens of entries, not thousands.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Hit:
    """A kept prefix for a prompt: the snapshot to restore and how many of its positions to keep."""

    snapshot: Any
    length: int


def common_prefix(a: list[int], b: tuple[int, ...] | list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    lo, hi = 0, min(len(a), len(b))
    b = list(b) if isinstance(b, tuple) else b
    while lo < hi:  # invariant: a[:lo] == b[:lo]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    """Prompts' KV snapshots by their token ids, least recently used first; `max_bytes` 0 disables it.

    Counters (what /health and /metrics report): `hits`, `tokens_reused` (positions restored instead
    of computed), `evictions`, and the present `entries` and `bytes`. `on_drop(snapshot)` is called for
    every snapshot let go (see the module doc)."""

    def __init__(self, max_bytes: int, min_tokens: int = 16, on_drop: Callable[[Any], None] | None = None):
        self.max_bytes, self.min_tokens = max(0, max_bytes), max(1, min_tokens)
        self.on_drop = on_drop
        self.entries: OrderedDict[tuple[int, ...], tuple[Any, int]] = OrderedDict()
        self.bytes = self.hits = self.tokens_reused = self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def peek(self, prompt: list[int]) -> bool:
        """Whether `lookup` would find a prefix for `prompt` (not counted, not moved)."""
        return self._best(prompt) is not None

    def lookup(self, prompt: list[int]) -> Hit | None:
        """The kept prefix sharing most tokens with `prompt` (at least `min_tokens`, and at least one token
        of the prompt left to compute: its logits are the first token's), counted as a hit; else None."""
        found = self._best(prompt)
        if found is None:
            return None
        best, length = found
        self.entries.move_to_end(best)
        self.hits, self.tokens_reused = self.hits + 1, self.tokens_reused + length
        return Hit(self.entries[best][0], length)

    def _best(self, prompt: list[int]) -> tuple[tuple[int, ...], int] | None:
        best, best_len = None, 0
        for key in self.entries:
            n = common_prefix(prompt, key)
            if n > best_len:
                best, best_len = key, n
        length = min(best_len, len(prompt) - 1)
        if best is None or length < self.min_tokens:
            return None
        return best, length

    def wants(self, prompt: list[int]) -> bool:
        """Whether a snapshot of this prompt would be kept (long enough, not already served by a longer one)."""
        if not self.enabled or len(prompt) < self.min_tokens:
            return False
        return not any(len(key) >= len(prompt) and common_prefix(prompt, key) == len(prompt) for key in self.entries)

    def store(self, prompt: list[int], snapshot: Any, nbytes: int) -> None:
        """Keep `snapshot` (the KV of all of `prompt`, `nbytes` large), evicting the least recently used."""
        if nbytes > self.max_bytes:
            self._dropped(snapshot)
            return
        key = tuple(prompt)
        for shorter in [k for k in self.entries if len(k) < len(key) and key[:len(k)] == k]:
            self._pop(shorter)  # the new prompt serves every prompt it served
        if key in self.entries:
            self._pop(key)
        while self.entries and self.bytes + nbytes > self.max_bytes:
            self._pop(next(iter(self.entries)))
            self.evictions += 1
        self.entries[key] = (snapshot, nbytes)
        self.bytes += nbytes

    def failed(self, hit: Hit) -> None:
        """A hit whose snapshot could not be restored (its holder went away): not counted, and forgotten."""
        self.hits, self.tokens_reused = self.hits - 1, self.tokens_reused - hit.length
        for key in [k for k, (s, _) in self.entries.items() if s is hit.snapshot]:
            self._pop(key)

    def _pop(self, key: tuple[int, ...]) -> None:
        snapshot, size = self.entries.pop(key)
        self.bytes -= size
        self._dropped(snapshot)

    def _dropped(self, snapshot: Any) -> None:
        if self.on_drop is not None:
            self.on_drop(snapshot)

    def stats(self) -> dict[str, int]:
        """The counters, under the names /health and /metrics give them."""
        return {"prefix_hits": self.hits, "prefix_tokens_reused": self.tokens_reused,
                "prefix_evictions": self.evictions, "prefix_entries": len(self.entries), "prefix_bytes": self.bytes}
