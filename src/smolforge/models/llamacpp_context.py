"""Several sequences decoded together in one llama.cpp context: the one place that makes such a context,
fills its batch and reads its logits, for the `llamacpp` teacher (`distill/llamacpp_batch.py`) and the
`llamacpp` serving engine (`serve/llamacpp.py`).

Decoding one token is a pass over every weight for one row of activations: on a CPU that pass is bound
by reading the weights, so one `llama_decode` of a token for each of N sequences costs little more than
for one. A context has `n_seq` sequences (ids 0..n_seq-1) and a batch says which sequence each token
belongs to.

One KV stream for every sequence (`unified`, the default) or one per sequence (llama.cpp's default):
with a stream per sequence a batch is cut into micro-batches of runs of *consecutive* sequence ids in
batch order (`split_equal`), so a step of rows with ids 2, 0, 3, 1 is up to four passes over the
weights unless the caller sends its rows in id order and keeps the ids low (the serving engine does,
`serve/llamacpp.py`); with one stream a batch is one ubatch whatever its ids, but every row's attention
and mask run over every sequence's cells (the CPU flash-attention kernel skips the masked ones, not
for free): with a server's rows coming and going and cells scattered, its prefill was 1.7x slower at
90 % load (issue 44, BENCHMARKS.md). The llamacpp teacher keeps one stream (its rows start and end
together). In a unified context the sequences share all `n_seq * n_ctx_seq` cells: none is held to
`n_ctx_seq`, and `n_ctx_seq` here only sizes the whole; per sequence, each has `n_ctx_seq`.

Logits come back as a view of llama.cpp's own output buffer (no copy): valid until the next decode.
"""

from __future__ import annotations

import ctypes
from typing import Any, Iterable

import numpy as np

from smolforge.errors import SmolforgeError

Entry = tuple[int, int, int, bool]  # (sequence id, position, token id, wants logits)


class SeqContext:
    """A llama.cpp context of `n_seq` sequences over `model` (a `llama_model` pointer), `n_ctx_seq` cells
    each (in all, when `unified`), decoding up to `n_batch` tokens a call on `threads` CPU threads.

    `fix` is what a refused context or a failed decode tells the user to do (the caller's own flags);
    `extra` sets further `llama_context_params` fields (e.g. `cb_eval`, which the caller keeps alive).
    Raises SmolforgeError when llama.cpp cannot make the context (memory)."""

    def __init__(self, lc: Any, model: Any, *, n_seq: int, n_ctx_seq: int, n_batch: int, threads: int,
                 fix: str, unified: bool = True, **extra: Any):
        self.lc, self.n_seq, self.fix = lc, n_seq, fix
        p = lc.llama_context_default_params()
        p.n_ctx = n_seq * n_ctx_seq
        p.n_batch = p.n_ubatch = n_batch
        p.n_seq_max = n_seq
        p.kv_unified = unified
        p.n_threads = p.n_threads_batch = max(1, threads)
        p.no_perf = True
        for name, value in extra.items():
            setattr(p, name, value)
        self.ctx = lc.llama_init_from_model(model, p)
        if not self.ctx:
            raise SmolforgeError(f"llama.cpp could not make a context for {n_seq} sequences of {n_ctx_seq} tokens",
                                 fix=fix)
        self.n_batch = n_batch
        self.n_ctx_seq = int(lc.llama_n_ctx_seq(self.ctx))  # what one sequence may reach (all of it, unified)
        self.n_vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model)))
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        b = self.batch
        for k in range(n_batch):  # every token is one sequence's: set once, not per token
            b.n_seq_id[k] = 1
        # The batch's arrays, read once: each read of a ctypes struct's field makes a new pointer object.
        self._slots = (b.token, b.pos, b.logits, [b.seq_id[k] for k in range(n_batch)])
        self.mem = lc.llama_get_memory(self.ctx)
        self._address: int | None = None
        self._view = np.zeros((0, self.n_vocab), np.float32)
        self.passes = 0  # llama_decode calls
        self.made = 0  # views made over the output buffer (again only when llama.cpp moves it)

    def decode(self, entries: Iterable[Entry]) -> int:
        """At most `n_batch` (seq, pos, token, wants logits) entries in one llama_decode; how many logits
        rows it wrote (read them with `rows`, in entry order). Raises SmolforgeError when llama.cpp refuses
        (a full KV cache: too many or too long sequences)."""
        tokens, positions, wants, seq_ids = self._slots
        k, n_out = -1, 0
        for k, (seq, pos, tok, want) in enumerate(entries):
            tokens[k], positions[k], wants[k] = tok, pos, want
            seq_ids[k][0] = seq
            n_out += want
        self.batch.n_tokens = k + 1
        rc = self.lc.llama_decode(self.ctx, self.batch)
        self.passes += 1
        if rc != 0:
            raise SmolforgeError(f"llama.cpp decode failed (code {rc}) for {k + 1} tokens "
                                 "(its KV cache is full, or it refused the batch)", fix=self.fix)
        return n_out

    def rows(self, n: int) -> np.ndarray:
        """The last decode's first `n` logits rows, [n, n_vocab] float32: a view of llama.cpp's buffer,
        valid until the next decode (rows past `n_seq`: a view made for this call)."""
        if n > self.n_seq:
            return np.ctypeslib.as_array(self.lc.llama_get_logits(self.ctx), shape=(n, self.n_vocab))
        return self.view()[:n]

    def view(self) -> np.ndarray:
        """[n_seq, n_vocab] over llama.cpp's output buffer: the same array object until llama.cpp moves
        the buffer (`made` counts the arrays made), so a caller may keep its own wrapper of it."""
        ptr = self.lc.llama_get_logits(self.ctx)  # also puts the rows back in batch order (output_reorder)
        address = ctypes.cast(ptr, ctypes.c_void_p).value
        if address != self._address:
            self._view = np.ctypeslib.as_array(ptr, shape=(self.n_seq, self.n_vocab))
            self._address, self.made = address, self.made + 1
        return self._view

    def clear(self) -> None:
        """Every sequence's KV cells emptied."""
        self.lc.llama_memory_clear(self.mem, True)

    def drop(self, seq: int, start: int = -1) -> None:
        """Sequence `seq`'s cells from position `start` on (-1: all of them) emptied."""
        self.lc.llama_memory_seq_rm(self.mem, seq, start, -1)

    def copy(self, src: int, dst: int) -> None:
        """Sequence `dst` also holds every cell of `src` (a shared prefix read once)."""
        self.lc.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def close(self) -> None:
        """Free the batch and the context (not the model: its owner frees it)."""
        if self.ctx:
            self.lc.llama_batch_free(self.batch)
            self.lc.llama_free(self.ctx)
            self.ctx = None
