"""One static batch: requests that arrived together, generated together until each one is done.

Why static batching with rows that leave: a CPU or small GPU spends most of a decode step reading
the weights, so eight requests cost little more than one per step. Prompts are left-padded so
every row's next token sits in the last column; each row keeps its own positions, so its tokens
are the ones it would get alone. A finished row is cut out of the cache, the mask and the
positions at once, so the batch shrinks instead of computing for requests nobody waits for.

`step()` is the interface a multi-stage server keeps: a batch of active requests in, one new
token for each out; only `model.forward` changes (stage actors instead of one module).

Why failures are kept per request: one request whose settings cannot be turned into a random
stream (a seed out of range), or whose row cannot be sampled, must fail alone. Such a request is
left out of the batch (`failed`) or its row is reported (`row_errors`), and the others go on.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from smolforge.serve.events import DoneEvent, ErrorEvent, Event, TokenEvent, TokenLogprob  # noqa: F401
from smolforge.serve.sampling import SamplingParams, is_greedy, next_token, token_logprobs
from smolforge.serve.stops import TextStream
from smolforge.serve.structured import Constraint, constraint_for, mask_rows


class BatchModel(Protocol):
    """What a batch needs from a model: torch in one process (`ServedModel`), a chain of stages
    (`StagedModel`) or a GGUF in llama.cpp (`LlamaCppModel`): the seam `--engine` chooses behind."""

    device: torch.device
    eos_ids: frozenset[int]
    tokenizer: Any

    @property
    def pad_id(self) -> int: ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: Any, keep: int = 1) -> torch.Tensor:
        """Logits after each row's last token, [rows, vocab]; with `keep` > 1 (a prefill whose prompts'
        own log-probabilities are asked for: echo) of the last `keep` columns, [rows, keep, vocab]."""
        ...

    def new_cache(self) -> Any: ...

    def select_rows(self, cache: Any, rows: torch.Tensor, trim: int) -> bool:
        """Keep only these rows of the cache; also drop its first `trim` columns (left padding no row
        uses any more) when the cache allows it. True when the columns were dropped."""
        ...

    def release(self, cache: Any) -> None:
        """The batch is over (finished or failed): whatever the cache holds may go."""
        ...


@dataclass
class Request:
    """One generation: its prompt, its settings, where its events go, and its progress."""

    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancelled: threading.Event = field(default_factory=threading.Event)
    token_ids: list[int] = field(default_factory=list)
    stream: TextStream | None = None
    generator: torch.Generator | None = None
    constraint: Constraint | None = None  # the grammar its tokens must follow (`params.grammar`)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # each sampled token's, when asked for
    logprobs_sent: int = 0  # how many of `logprobs` went out with a TokenEvent
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo: the prompt's own, the first None

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step (the client went away)."""
        self.cancelled.set()

    def unsent_logprobs(self) -> list[TokenLogprob] | None:
        """The log-probabilities not yet sent with a TokenEvent (None when the request asked for none)."""
        if self.params.logprobs is None:
            return None
        out, self.logprobs_sent = self.logprobs[self.logprobs_sent:], len(self.logprobs)
        return out


class Batch:
    """The cache and masks of the requests generated together; rows leave as they finish."""

    def __init__(self, model: BatchModel, requests: list[Request]):
        self.model, self.active = model, []
        self.failed: list[tuple[Request, Exception]] = []  # could not join: their settings are unusable
        self.row_errors: dict[int, Exception] = {}  # rows of the last step() that got no token
        self.cache: Any = None
        self.mask: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None  # real (unpadded) tokens in the cache, per row
        self.last: torch.Tensor | None = None  # each row's newest token: the next step's input
        self._mask_all = torch.ones((0, 0), dtype=torch.long)  # `mask` is its first columns
        self._greedy_ids: torch.Tensor | None = None  # the last step's argmax, when every row was greedy
        for r in requests:
            try:
                r.stream = TextStream(model.tokenizer, r.params.stop)
                r.generator = r.params.generator(model.device)
                r.constraint = constraint_for(r.params.grammar, model.tokenizer, model.eos_ids)
            except Exception as err:  # noqa: BLE001 - this request fails alone (the engine tells it why)
                self.failed.append((r, err))
            else:
                self.active.append(r)

    def step(self) -> list[int | None]:
        """One new token for each active request (the first call reads the prompts: prefill); None for a
        row that could not be sampled (see `row_errors`): the caller drops it with `keep`."""
        dev = self.model.device
        if self.cache is None:
            width = max(len(r.prompt_ids) for r in self.active)
            ids = torch.full((len(self.active), width), self.model.pad_id, dtype=torch.long)
            # The mask of every step to come, made once: a step takes one more column (a view), not a cat.
            self._mask_all = torch.ones((len(self.active), width + max(r.params.max_tokens for r in self.active)),
                                        dtype=torch.long)
            for i, r in enumerate(self.active):
                ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
                self._mask_all[i, :width - len(r.prompt_ids)] = 0
            self._mask_all = self._mask_all.to(dev)
            self.mask = self._mask_all[:, :width]
            positions = (self.mask.cumsum(-1) - 1).clamp_min(0)
            self.lengths = self.mask.sum(-1)
            self.cache = self.model.new_cache()
            echo = [r.params.prompt_logprobs and r.params.logprobs is not None for r in self.active]
            if any(echo):  # every column's logits: the prompts' own log-probabilities (echo)
                every = self.model.forward(ids.to(dev), self.mask, positions, self.cache, keep=width)
                self._prompt_logprobs(every, echo)
                logits = every[:, -1, :]
            else:
                logits = self.model.forward(ids.to(dev), self.mask, positions, self.cache)
        else:
            assert self.mask is not None and self.lengths is not None and self.last is not None
            width = self.mask.shape[1] + 1
            if width > self._mask_all.shape[1]:  # not reached: a row ends at its max_tokens
                self._mask_all = torch.cat([self._mask_all, self._mask_all.new_ones((len(self.active), 1))], dim=1)
            self.mask = self._mask_all[:, :width]
            logits = self.model.forward(self.last[:, None], self.mask, self.lengths[:, None], self.cache)
            self.lengths = self.lengths + 1
        tokens = self._sample(logits)
        if self._greedy_ids is not None and not self.row_errors and len(self._greedy_ids) == len(tokens):
            self.last = self._greedy_ids  # every row greedy: the argmax is the next input as it is
        else:
            self.last = torch.tensor([self.model.pad_id if t is None else t for t in tokens], dtype=torch.long,
                                     device=dev)
        return tokens

    def _sample(self, logits: torch.Tensor) -> list[int | None]:
        """One token per row; None (and the error in `row_errors`) for a row that cannot be sampled."""
        self.row_errors = {}
        tokens: list[int | None] = []
        logits = mask_rows(logits, [r.constraint for r in self.active], self.row_errors)
        # Greedy rows share one argmax and one copy to Python: not a reduction and a sync per row.
        greedy_rows = [is_greedy(r.params, r.generator) for r in self.active]
        self._greedy_ids = logits.argmax(-1) if any(greedy_rows) else None
        best = self._greedy_ids.tolist() if self._greedy_ids is not None else []
        if not all(greedy_rows):
            self._greedy_ids = None
        for i, (r, greedy) in enumerate(zip(self.active, greedy_rows)):
            if i in self.row_errors:  # its grammar failed (`mask_rows`)
                tokens.append(None)
                continue
            try:
                token = best[i] if greedy else next_token(logits[i], r.params, r.generator)
                if r.params.logprobs is not None and r.params.max_tokens > 0:  # the row's own, before its next step
                    r.logprobs.extend(token_logprobs(logits[i], [token], r.params.logprobs))
                if r.constraint is not None:
                    r.constraint.accept(token)
                tokens.append(token)
            except Exception as err:  # noqa: BLE001 - that row fails, the others go on
                self.row_errors[i] = err
                tokens.append(None)
        return tokens

    def _prompt_logprobs(self, every: torch.Tensor, echo: list[bool]) -> None:
        """Each echo row's prompt tokens' log-probabilities from the prefill's logits [rows, width, vocab]
        (left-padded: row i's prompt is its last columns; column c's logits give the token at c + 1)."""
        width = every.shape[1]
        for i, (r, wanted) in enumerate(zip(self.active, echo)):
            if not wanted:
                continue
            n = len(r.prompt_ids)
            rows = every[i, width - n:width - 1]
            r.prompt_logprobs = [None, *token_logprobs(rows, r.prompt_ids[1:], r.params.logprobs or 0)] if n > 1 \
                else [None]

    def keep(self, rows: list[int]) -> None:
        """Only these rows go on: the others' cache, mask and positions are dropped."""
        if len(rows) == len(self.active):
            return
        self.active = [self.active[i] for i in rows]
        if not rows:
            self.close()
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.model.device)
        width = self.mask.shape[1]
        self._mask_all, self.lengths, self.last = self._mask_all[index], self.lengths[index], self.last[index]
        pad = int((self._mask_all[:, :width].sum(0) == 0).sum())  # columns no remaining row uses: left padding only
        if self.model.select_rows(self.cache, index, pad) and pad:
            self._mask_all, width = self._mask_all[:, pad:], width - pad
        self.mask = self._mask_all[:, :width]

    def close(self) -> None:
        """Let the model free this batch's cache (a stage server holds it remotely)."""
        if self.cache is not None:
            cache, self.cache = self.cache, None
            self.model.release(cache)
