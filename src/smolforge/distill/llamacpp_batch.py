"""Several sequences decoded together in one llama.cpp context: the llamacpp teacher's batched decode.

Decoding one token is a pass over every weight for one row of activations: on a CPU that pass is
bound by reading the weights, so one pass for N sequences costs little more than for one. llama.cpp
does this natively: a context with `n_seq_max` sequences, each with its own KV cells (a "stream":
attention reads only its own cells), and a batch whose tokens say which sequence they belong to.
Each step puts one token per unfinished sequence into the batch and reads back the rows of logits
as one [n, V] view of llama.cpp's own buffer (no copy: the caller takes its top-k before the next step).

Three things keep the passes over the weights few (issue 32, measured in BENCHMARKS.md):
- the prompts' shared prefix (a chat template's system turn: 40 of the bench's ~55 tokens) is
  prefilled once, in slot 0, and its KV cells copied to the other slots (`llama_memory_seq_cp` of a
  whole stream); the rest of every prompt is prefilled in one batch across the sequences, logits
  only at each prompt's last position;
- llama.cpp cuts a batch over separate streams into micro-batches of *consecutive* sequence ids
  (`split_equal`, sequential), so when a sequence ends, the highest running one moves into its slot
  (its stream copied, a few MB): the running sequences stay slots 0..n-1, one pass per step;
- the caller's members (its own indices) are mapped to slots here, so it never sees the moves.

The high-level `Llama` object keeps its own one-sequence context for everything else; this
context is separate and freed on `close`.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from smolforge.errors import SmolforgeError


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading ids every prompt has in common, leaving each at least its last id of its own
    (whose logits are the sequence's first row)."""
    if len(prompts) < 2:
        return 0
    return min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)


class BatchDecoder:
    """`n_seq` sequences of up to `n_ctx_seq` positions each, decoded in one context of `llm`'s model."""

    def __init__(self, llm, n_seq: int, n_ctx_seq: int, n_threads: int):
        import llama_cpp

        self._lib = llama_cpp
        self.n_seq, self.n_ctx_seq, self.n_vocab = n_seq, n_ctx_seq, int(llm.n_vocab())
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_seq * n_ctx_seq  # split evenly: each sequence its own cells (kv_unified off)
        params.n_batch = params.n_ubatch = max(n_seq, 512)
        params.n_seq_max = n_seq
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = n_threads
        self.ctx = llama_cpp.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise SmolforgeError(f"llama.cpp could not make a context for {n_seq} sequences of {n_ctx_seq} tokens",
                                 fix="lower --teacher-batch-size or --max-new-tokens")
        self.n_batch = int(params.n_batch)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, n_seq)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.slot: dict[int, int] = {}  # caller's member -> sequence id in this context
        self.passes = self.moves = 0  # counters: llama_decode calls, and streams moved by `_compact`

    def reset(self) -> None:
        """Every sequence's KV cells emptied (a new group of prompts)."""
        self._lib.llama_memory_clear(self.mem, True)
        self.slot = {}

    def prefill(self, prompts: list[list[int]]) -> np.ndarray:
        """Member j reads `prompts[j]`; their last positions' logits [len(prompts), V] (a copy), by member.
        Slots go to the longest prompts first: a micro-batch holds the same number of tokens of each of
        its consecutive sequences, so once the shortest remainder is read, those still reading are slots
        0..m-1 and one micro-batch (not one per run of consecutive ids) takes the next tokens of all."""
        if len(prompts) > self.n_seq:
            raise SmolforgeError(f"{len(prompts)} prompts for a decoder of {self.n_seq} sequences",
                                 fix="lower --teacher-batch-size")
        for ids in prompts:
            if len(ids) > self.n_ctx_seq:
                raise SmolforgeError(f"a prompt of {len(ids)} tokens does not fit a sequence of {self.n_ctx_seq}",
                                     fix="shorten the prompts or --max-new-tokens")
        order = sorted(range(len(prompts)), key=lambda j: -len(prompts[j]))  # slot -> member, longest first
        self.slot = {j: slot for slot, j in enumerate(order)}
        shared = shared_prefix(prompts)
        if shared:
            self._run([(0, pos, tok, False) for pos, tok in enumerate(prompts[order[0]][:shared])])
            for slot in range(1, len(prompts)):
                self._lib.llama_memory_seq_cp(self.mem, 0, slot, -1, -1)  # the whole stream, before the next pass
        entries = [(slot, pos, prompts[j][pos], pos == len(prompts[j]) - 1)
                   for slot, j in enumerate(order) for pos in range(shared, len(prompts[j]))]
        rows = np.concatenate(self._run(entries))  # in slot order
        return rows[np.argsort(order)]

    def step(self, feed: dict[int, tuple[int, int]]) -> tuple[list[int], np.ndarray]:
        """One token for each member named (member -> (token, position)); members not named are done and
        leave. Returns the members in row order and their next logits [len(feed), V]: a view of
        llama.cpp's buffer, valid until the next call."""
        self._compact(set(feed))
        members = sorted(feed, key=self.slot.__getitem__)
        rows = self._decode([(self.slot[m], feed[m][1], feed[m][0], True) for m in members])
        return members, rows

    def _compact(self, keep: set[int]) -> None:
        """Members not in `keep` leave; those in slots past len(keep) move into the freed slots."""
        for m in [m for m in self.slot if m not in keep]:
            self._lib.llama_memory_seq_rm(self.mem, self.slot.pop(m), -1, -1)
        used = set(self.slot.values())
        free = [s for s in range(len(keep)) if s not in used]
        for m in sorted((m for m in keep if self.slot[m] >= len(keep)), key=self.slot.__getitem__):
            src, dst = self.slot[m], free.pop(0)
            self._lib.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
            self._lib.llama_memory_seq_rm(self.mem, src, -1, -1)
            self.slot[m] = dst
            self.moves += 1

    def _run(self, entries: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Entries in batches of n_batch; each batch's logits rows copied (the next batch reuses the buffer)."""
        return [self._decode(entries[i:i + self.n_batch]).copy() for i in range(0, len(entries), self.n_batch)]

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """(seq, pos, token, wants logits) entries, in sequence order: the rows of those that want logits,
        in entry order, as a view of llama.cpp's output buffer."""
        b = self.batch
        b.n_tokens = len(entries)
        for j, (seq, pos, tok, logits) in enumerate(entries):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, pos, 1, logits
            b.seq_id[j][0] = seq
        rc = self._lib.llama_decode(self.ctx, b)
        self.passes += 1
        if rc != 0:
            raise SmolforgeError(f"llama.cpp decode failed (code {rc}) for {len(entries)} tokens",
                                 fix="lower --teacher-batch-size; a KV cache that is full needs fewer or shorter sequences")
        n_out = sum(1 for e in entries if e[3])
        if not n_out:
            return np.zeros((0, self.n_vocab), np.float32)
        ptr = ctypes.cast(self._lib.llama_get_logits(self.ctx), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

    def close(self) -> None:
        if self.ctx:
            self._lib.llama_batch_free(self.batch)
            self._lib.llama_free(self.ctx)
            self.ctx = None
