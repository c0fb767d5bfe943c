"""Several sequences decoded together in one llama.cpp context: the llamacpp teacher's batched decode.

Decoding one token is a pass over every weight for one row of activations: on a CPU that pass is
bound by reading the weights, so one pass for N sequences costs little more than for one. llama.cpp
does this natively: a context with `n_seq_max` sequences, each with its own KV cells, and a batch
whose tokens say which sequence they belong to. Each step here puts one token per unfinished
sequence into the batch and reads back one row of logits per sequence (`llama_get_logits_ith`).

Prompts are prefilled one sequence at a time (a prompt is already a batch of rows); their last-position
logits are the first rows. The high-level `Llama` object keeps its own one-sequence context for
everything else; this context is separate and freed on `close`.
"""

from __future__ import annotations

import ctypes

import numpy as np

from smolforge.errors import SmolforgeError


class BatchDecoder:
    """`n_seq` sequences of up to `n_ctx_seq` positions each, decoded in one context of `llm`'s model."""

    def __init__(self, llm, n_seq: int, n_ctx_seq: int, n_threads: int):
        import llama_cpp

        self._lib = llama_cpp
        self.n_seq, self.n_ctx_seq, self.n_vocab = n_seq, n_ctx_seq, int(llm.n_vocab())
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_seq * n_ctx_seq  # split evenly: each sequence its own cells (kv_unified off)
        params.n_batch = params.n_ubatch = max(n_seq, min(512, n_ctx_seq))
        params.n_seq_max = n_seq
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = n_threads
        self.ctx = llama_cpp.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise SmolforgeError(f"llama.cpp could not make a context for {n_seq} sequences of {n_ctx_seq} tokens",
                                 fix="lower --teacher-batch-size or --max-new-tokens")
        self.n_batch = int(params.n_batch)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, n_seq)

    def reset(self) -> None:
        """Every sequence's KV cells emptied (a new group of prompts)."""
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self.ctx), True)

    def prefill(self, seq: int, ids: list[int]) -> np.ndarray:
        """Sequence `seq` reads its prompt; the last position's logits come back."""
        if len(ids) > self.n_ctx_seq:
            raise SmolforgeError(f"a prompt of {len(ids)} tokens does not fit a sequence of {self.n_ctx_seq}",
                                 fix="shorten the prompts or --max-new-tokens")
        last = None
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start:start + self.n_batch]
            entries = [(seq, start + i, tok, start + i == len(ids) - 1) for i, tok in enumerate(chunk)]
            last = self._decode(entries)
        return last[seq]

    def step(self, tokens: dict[int, tuple[int, int]]) -> dict[int, np.ndarray]:
        """One token for each sequence named (seq -> (token, position)); each one's next logits."""
        return self._decode([(seq, pos, tok, True) for seq, (tok, pos) in tokens.items()])

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
        b = self.batch
        b.n_tokens = len(entries)
        for j, (seq, pos, tok, logits) in enumerate(entries):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, pos, 1, logits
            b.seq_id[j][0] = seq
        rc = self._lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise SmolforgeError(f"llama.cpp decode failed (code {rc}) for {len(entries)} tokens",
                                 fix="lower --teacher-batch-size; a KV cache that is full needs fewer or shorter sequences")
        out = {}
        for j, (seq, _, _, logits) in enumerate(entries):
            if logits:
                ptr = self._lib.llama_get_logits_ith(self.ctx, j)
                out[seq] = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                 shape=(self.n_vocab,)).astype(np.float32, copy=True)
        return out

    def close(self) -> None:
        if self.ctx:
            self._lib.llama_batch_free(self.batch)
            self._lib.llama_free(self.ctx)
            self.ctx = None
