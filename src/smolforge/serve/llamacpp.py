"""The `llamacpp` engine's model: a GGUF in llama.cpp behind the same `BatchModel` seam as torch's.

Why a `BatchModel` and not a second server: everything above the forward (the engine thread and its
batching, stop strings and incremental text, sampling, the chat template, the HTTP side) is the torch
engine's, so the two engines answer alike by construction; only the logits come from llama.cpp's
CPU kernels (quantized weights, about 4x HF's fp32 `generate` for one stream: BENCHMARKS.md).

- The GGUF is the node's cached export of the HF model (`models.export.cache.cached_gguf`, the one
  the `llamacpp` teacher runs, verified against HF when first made); the HF tokenizer renders and
  tokenizes, and its ids go to llama.cpp as they are (our own export keeps the vocabulary).
- Rows of a batch are llama.cpp sequences: a batch's rows are decoded in one `llama_decode`, each
  row with its own sequence id and KV cells, so eight streams share each read of the weights as the
  torch engine's batch does (the context is `models.llamacpp_context.SeqContext`, the llamacpp
  teacher's too). A finished row's cells are freed (`llama_memory_seq_rm`) and its id goes back to
  the pool; no column trimming is needed (llama.cpp keeps no padding).
- Each sequence has its own KV stream (`KV_UNIFIED` False, as llama-server with `-np N`): a row's
  attention reads its own cells only. In one stream shared by all, every row's attention and mask
  ran over every sequence's cells, scattered further as rows came and went: at 90 % load that made
  the engine's prefill 1.7x and its output tokens/s 1.3x slower (BENCHMARKS.md, issue 44). llama.cpp
  cuts a call into one ubatch (one pass over the weights) per run of consecutive ids in batch order
  (`split_equal`), so ids are handed out lowest first and a decode step sends its rows in id order
  (`_step`), their logits given back in row order.
- A step's cost outside llama.cpp is kept small (a small model's token takes a few hundred
  microseconds, issue 32): a decode step sends each row's one token without reading the mask, into
  a `llama_batch` made once, and its logits are llama.cpp's own output rows (`LogitsView`, no copy),
  which the batch samples from before the next decode.
- `n_threads` is what the server was given (`--num-threads`, default the CPUs this process may use).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from smolforge.errors import SmolforgeError
from smolforge.models.families import stop_ids
from smolforge.models.llamacpp_context import SeqContext

INSTALL_FIX = "pip install 'smolforge[export]' (it builds llama.cpp, minutes), or serve with --engine torch"
MAX_CONTEXT = 4096  # per sequence: a 32k-context model's KV cache times --max-batch would not fit a laptop


def require_llama_cpp() -> Any:
    """The bindings, or one message saying how to get them."""
    try:
        import llama_cpp
    except ImportError as err:
        raise SmolforgeError("--engine llamacpp needs llama-cpp-python, which is not installed",
                             fix=INSTALL_FIX) from err
    return llama_cpp


def gguf_context(path: Path) -> int | None:
    """The model's trained context from the GGUF's metadata (None when it does not say)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch = reader.get_field("general.architecture").contents()
        return int(reader.get_field(f"{arch}.context_length").contents())
    except Exception:  # noqa: BLE001 - llama.cpp reports an unreadable file when it loads it
        return None


class LogitsView:
    """The last decode's logits rows as a torch tensor over llama.cpp's own output buffer: no copy.

    Why: at a few hundred microseconds a token (a small model on one thread), a fresh array, a copy
    of every row and `np.ctypeslib.as_array`'s ctypes array type per step were a visible part of the
    step (issue 32). The context's numpy view (`SeqContext.rows`) is made again only when llama.cpp
    moves its buffer, and the tensor over it only then too (`made` counts).
    A view's rows are valid until the next `llama_decode`: the batch samples from them at once."""

    def __init__(self, context: SeqContext):
        self.context = context
        self.array: np.ndarray | None = None
        self.tensor = torch.empty(0)
        self.made = 0

    def rows(self, n: int) -> torch.Tensor:
        """The first `n` rows (n <= the context's sequences: only those llama.cpp wrote are read)."""
        array = self.context.view()
        if array is not self.array:
            self.tensor, self.array = torch.from_numpy(array), array
            self.made += 1
        return self.tensor[:n]


@dataclass
class SeqCache:
    """One batch's cache: llama.cpp sequence ids, one per row (the KV cells live in the context)."""

    seqs: list[int] = field(default_factory=list)


class LlamaCppModel:
    """A GGUF in llama.cpp as a `BatchModel`: `forward` decodes every row's new tokens in one call."""

    KV_UNIFIED = False  # one KV stream for all sequences (the module's doc says why not; the bench's before)

    def __init__(self, path: Path, tokenizer: Any, eos_ids: frozenset[int], *, name: str, quant: str,
                 n_threads: int, max_batch: int):
        lc = require_llama_cpp()
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp's errors only: its load and graph logs would fill the server's log
        self.lc, self.name, self.quant, self.tokenizer, self.eos_ids = lc, name, quant, tokenizer, eos_ids
        self.device = torch.device("cpu")
        self.n_threads, self.n_seq = max(1, n_threads), max(1, max_batch)
        self.max_positions = min(gguf_context(path) or MAX_CONTEXT, MAX_CONTEXT)
        self.gguf_path = path
        self.model_type: str | None = None  # the HF config's (load_llamacpp sets it): the family's tool-call format
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self._model = lc.llama_model_load_from_file(str(path).encode("utf-8"), mparams)
        if not self._model:
            raise SmolforgeError(f"llama.cpp cannot load {path}", where="--engine llamacpp",
                                 fix="delete that cached export (it is made again) or serve with --engine torch")
        try:  # a KV stream per sequence (the module's doc): a step's rows go in id order, one pass
            self.context = SeqContext(lc, self._model, n_seq=self.n_seq, n_ctx_seq=self.max_positions,
                                      n_batch=min(512, self.max_positions * self.n_seq), threads=self.n_threads,
                                      fix="lower --max-batch, or serve with --engine torch", unified=self.KV_UNIFIED,
                                      **self._extra_params())
        except SmolforgeError:
            lc.llama_model_free(self._model)
            raise
        self.max_positions = min(self.max_positions, self.context.n_ctx_seq)  # what each sequence may reach
        self.n_batch = self.context.n_batch  # a prefill's tokens per llama_decode (at most the context's batch)
        self.n_vocab = self.context.n_vocab
        self.logits = LogitsView(self.context)
        self._free = list(range(self.n_seq))

    def _extra_params(self) -> dict[str, Any]:
        """Further `llama_context_params` fields for the context (none; a test sets `cb_eval`)."""
        return {}

    @property
    def _ctx(self) -> Any:
        return self.context.ctx

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else next(iter(self.eos_ids), 0))

    def new_cache(self) -> SeqCache:
        return SeqCache()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: SeqCache, keep: int = 1) -> torch.Tensor:
        """Logits after each row's last new token, [rows, vocab]. The new tokens are those the mask's
        last columns keep (a prefill's left padding is not sent); a first call takes a sequence per row.
        The tensor is a view of llama.cpp's output buffer (`LogitsView`): valid until the next forward.
        `keep` > 1 (a prefill for echo): every column's logits, [rows, width, vocab], a copy (padding 0)."""
        rows, width = input_ids.shape
        if not cache.seqs:
            if rows > len(self._free):
                raise RuntimeError(f"{rows} rows but {len(self._free)} free llama.cpp sequences")
            cache.seqs = self._take_free(rows)
        if width == 1:  # a decode step: one token per row, none of it padding (no mask to read)
            return self._step(cache.seqs, input_ids.reshape(-1).tolist(), position_ids.reshape(-1).tolist())
        real = attention_mask[:, -width:].bool()
        work = [(cache.seqs[i], input_ids[i][real[i]].tolist(), position_ids[i][real[i]].tolist()) for i in range(rows)]
        if keep > 1:
            return self._prefill_every(work, width)[:, -keep:, :]
        return self._prefill(work)

    def _step(self, seqs: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token per row in one llama_decode (rows <= n_seq <= n_batch); every row's logits, in row order.
        The rows go to llama.cpp in sequence-id order: with a KV stream per sequence a batch is one ubatch
        only when its ids rise one by one (`split_equal`); the logits come back in the rows' order."""
        order = sorted(range(len(seqs)), key=seqs.__getitem__)
        if all(i == k for k, i in enumerate(order)):
            self._decode(zip(seqs, positions, tokens, repeat(True)))
            return self.logits.rows(len(seqs))
        self._decode((seqs[i], positions[i], tokens[i], True) for i in order)
        back = sorted(range(len(order)), key=order.__getitem__)  # row i's logits: output row back[i]
        return self.logits.rows(len(seqs))[back]

    def _take_free(self, n: int) -> list[int]:
        """The `n` lowest free sequence ids (the caller checked there are `n`): the running rows' ids stay
        close to 0..rows-1, so a decode step in id order is one ubatch (`_step`)."""
        self._free.sort()
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def _prefill(self, work: list[tuple[int, list[int], list[int]]]) -> torch.Tensor:
        """Every row's tokens through llama_decode, `n_batch` tokens a call; each row's last logits. In one
        call they are the view's first rows, in row order; over several, each call's rows are copied out."""
        flat = [(row, seq, tok, pos, j == len(toks) - 1)
                for row, (seq, toks, poss) in enumerate(work) for j, (tok, pos) in enumerate(zip(toks, poss))]
        out = torch.empty((len(work), self.n_vocab), dtype=torch.float32)
        for start in range(0, len(flat), self.n_batch):
            chunk = flat[start:start + self.n_batch]
            self._decode((seq, pos, tok, last) for _, seq, tok, pos, last in chunk)
            if len(chunk) == len(flat):
                return self.logits.rows(len(work))
            done = [row for row, _, _, _, last in chunk if last]
            if done:
                out[done] = self.logits.rows(len(done))
        return out

    def _prefill_every(self, work: list[tuple[int, list[int], list[int]]], width: int) -> torch.Tensor:
        """`_prefill`, but with every token's logits, [rows, width, vocab] (row i's in its last columns)."""
        flat = [(row, width - len(toks) + j, seq, tok, pos)
                for row, (seq, toks, poss) in enumerate(work) for j, (tok, pos) in enumerate(zip(toks, poss))]
        out = torch.zeros((len(work), width, self.n_vocab), dtype=torch.float32)
        for start in range(0, len(flat), self.n_batch):
            chunk = flat[start:start + self.n_batch]
            self._decode((seq, pos, tok, True) for _, _, seq, tok, pos in chunk)
            got = torch.from_numpy(self.context.rows(len(chunk)).copy())
            rows, cols = zip(*((row, col) for row, col, _, _, _ in chunk))
            out[list(rows), list(cols)] = got
        return out

    def _decode(self, entries: Iterable[tuple[int, int, int, bool]]) -> None:
        """(sequence, position, token, wants logits) entries, at most `n_batch`, in one llama_decode."""
        self.context.decode(entries)

    def select_rows(self, cache: SeqCache, rows: torch.Tensor, trim: int) -> bool:
        """Keep these rows' sequences; the others' cells are freed and their ids reused. True: llama.cpp
        holds no padding, so the batch's mask may drop the columns no row uses."""
        kept = [cache.seqs[i] for i in rows.tolist()]
        self._drop([s for s in cache.seqs if s not in kept])
        cache.seqs = kept
        return True

    joins = True  # a running batch takes new rows: a new sequence id each (no padding to line up)

    def join_caches(self, cache: SeqCache, other: SeqCache, pad: int, other_pad: int) -> SeqCache:
        """`cache`'s sequences then `other`'s (`JoiningModel.join_caches`); positions are per sequence."""
        cache.seqs, other.seqs = cache.seqs + other.seqs, []
        return cache

    def snapshot(self, cache: SeqCache, row: int, length: int) -> tuple[Any, int]:
        """Row `row`'s sequence state (its KV cells) copied out of the context (`llama_state_seq_get_data`)."""
        seq = cache.seqs[row]
        size = self.lc.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        written = self.lc.llama_state_seq_get_data(self._ctx, buf, size, seq)
        if written != size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return buf, size

    def restore(self, snapshot: Any, length: int) -> SeqCache:
        """A free sequence holding the snapshot's first `length` positions (`llama_state_seq_set_data`)."""
        if not self._free:
            raise RuntimeError("no free llama.cpp sequence to restore a prefix into")
        [seq] = self._take_free(1)
        if not self.lc.llama_state_seq_set_data(self._ctx, snapshot, len(snapshot), seq):
            self._free.insert(0, seq)
            raise RuntimeError("llama_state_seq_set_data refused a prefix snapshot")
        self.context.drop(seq, length)
        return SeqCache([seq])

    def release(self, cache: SeqCache) -> None:
        self._drop(cache.seqs)
        cache.seqs = []

    def stage_infos(self) -> list[dict[str, Any] | None]:
        """No stages: the whole model is in this llama.cpp context (`BatchModel.stage_infos`)."""
        return []

    def _drop(self, seqs: list[int]) -> None:
        for s in seqs:
            self.context.drop(s)
            self._free.append(s)

    def close(self) -> None:
        """Free llama.cpp's context and weights (the server's process ends soon after anyway)."""
        if self._model:
            self.context.close()
            self.lc.llama_model_free(self._model)
            self._model = None


def load_llamacpp(model: str, *, name: str, quant: str, n_threads: int, max_batch: int,
                  say=lambda line: None) -> LlamaCppModel:
    """The HF model's cached GGUF at `quant` (exported on first use) with the HF tokenizer."""
    require_llama_cpp()
    from smolforge.models.export.cache import cached_gguf
    from smolforge.models.export.run import model_dir
    from smolforge.models.loading import load_tokenizer

    path = cached_gguf(model, quant, threads=n_threads, say=say)
    tokenizer = load_tokenizer(model)
    # the stop set from the checkpoint's generation config and the tokenizer, without loading weights
    served = LlamaCppModel(path, tokenizer, stop_ids(tokenizer, model_dir(model)), name=name, quant=quant,
                           n_threads=n_threads, max_batch=max_batch)
    served.model_type = _model_type(model_dir(model))
    return served


def _model_type(directory: Path) -> str | None:
    """The checkpoint's `model_type` (config.json), None when it cannot be read."""
    import json

    try:
        return json.loads((Path(directory) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
