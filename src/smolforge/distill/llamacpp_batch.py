"""Several sequences decoded together in one llama.cpp context: the llamacpp teacher's batched decode.

Decoding one token is a pass over every weight for one row of activations: on a CPU that pass is
bound by reading the weights, so one pass for N sequences costs little more than for one. The context
is `models.llamacpp_context.SeqContext` (the serving engine's too): `n_seq` sequences in one KV stream,
so a batch is one pass whatever sequence ids it holds. Each step puts one token per unfinished sequence
into the batch and reads back the rows of logits as one [n, V] view of llama.cpp's own buffer (no copy:
the caller takes its top-k before the next step).

Two things keep the passes over the weights few (issue 32, measured in BENCHMARKS.md):
- the prompts' shared prefix (a chat template's system turn: 40 of the bench's ~55 tokens) is
  prefilled once, in sequence 0, and its KV cells shared with the other sequences
  (`llama_memory_seq_cp`); the rest of every prompt is prefilled in one batch across the sequences,
  logits only at each prompt's last position;
- one KV stream for all sequences (stop 51, after issue 44 found it for the engine): when a sequence
  ends its cells are freed and the others stay where they are; the step of the rest is still one
  pass. (With a stream per sequence llama.cpp cuts a batch into micro-batches of consecutive ids, and
  this module moved the highest running sequence into each freed slot to keep them consecutive;
  unified KV made that unneeded and `generate` 1.13x faster in wall time on a quieter machine:
  BENCHMARKS.md, stop 51.)

The high-level `Llama` object keeps its own one-sequence context for everything else; this
context is separate and freed on `close`.
"""

from __future__ import annotations

import os

import numpy as np

from smolforge.errors import SmolforgeError
from smolforge.models.llamacpp_context import SeqContext

FIX = "lower --teacher-batch-size or --max-new-tokens"


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading ids every prompt has in common, leaving each at least its last id of its own
    (whose logits are the sequence's first row)."""
    if len(prompts) < 2:
        return 0
    return min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)


class BatchDecoder:
    """`n_seq` sequences of up to `n_ctx_seq` positions each, decoded in one context of `llm`'s model.
    Member j (the caller's index) is sequence j of the context; `extra`: further llama_context_params
    fields (`SeqContext`'s, e.g. a test's `cb_eval`)."""

    def __init__(self, llm, n_seq: int, n_ctx_seq: int, n_threads: int, **extra):
        import llama_cpp

        self.n_seq, self.n_ctx_seq = n_seq, n_ctx_seq
        self.context = SeqContext(llama_cpp, llm.model, n_seq=n_seq, n_ctx_seq=n_ctx_seq,
                                  n_batch=max(n_seq, 512), threads=n_threads, fix=FIX, **extra)
        self.n_vocab = self.context.n_vocab
        self.running: set[int] = set()  # members whose sequences hold cells

    @property
    def passes(self) -> int:
        """llama_decode calls so far (one per step: a step is one pass whatever members run)."""
        return self.context.passes

    def reset(self) -> None:
        """Every sequence's KV cells emptied (a new group of prompts)."""
        self.context.clear()
        self.running = set()

    def prefill(self, prompts: list[list[int]]) -> np.ndarray:
        """Member j reads `prompts[j]`; their last positions' logits [len(prompts), V] (a copy), by member."""
        if len(prompts) > self.n_seq:
            raise SmolforgeError(f"{len(prompts)} prompts for a decoder of {self.n_seq} sequences",
                                 fix="lower --teacher-batch-size")
        for ids in prompts:
            if len(ids) > self.n_ctx_seq:
                raise SmolforgeError(f"a prompt of {len(ids)} tokens does not fit a sequence of {self.n_ctx_seq}",
                                     fix="shorten the prompts or --max-new-tokens")
        self.running = set(range(len(prompts)))
        shared = shared_prefix(prompts)
        if shared:
            self._run([(0, pos, tok, False) for pos, tok in enumerate(prompts[0][:shared])])
            for j in range(1, len(prompts)):
                self.context.copy(0, j)  # the prefix's cells, before the next pass
        entries = [(j, pos, ids[pos], pos == len(ids) - 1)
                   for j, ids in enumerate(prompts) for pos in range(shared, len(ids))]
        return np.concatenate(self._run(entries))

    def step(self, feed: dict[int, tuple[int, int]]) -> tuple[list[int], np.ndarray]:
        """One token for each member named (member -> (token, position)); members not named are done and
        leave (their cells freed). Returns the members in row order and their next logits [len(feed), V]:
        a view of llama.cpp's buffer, valid until the next call. One llama_decode."""
        for m in self.running - set(feed):
            self.context.drop(m)
        self.running = set(feed)
        members = sorted(feed)
        n = self.context.decode((m, feed[m][1], feed[m][0], True) for m in members)
        return members, self.context.rows(n)

    def _run(self, entries: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Entries in batches of n_batch; each batch's logits rows copied (the next batch reuses the buffer)."""
        size, out = self.context.n_batch, []
        for i in range(0, len(entries), size):
            n = self.context.decode(entries[i:i + size])
            out.append(self.context.rows(n).copy() if n else np.zeros((0, self.n_vocab), np.float32))
        return out

    def close(self) -> None:
        self.context.close()
