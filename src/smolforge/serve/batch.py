"""A batch of rows generated together: rows join it (continuous batching) and leave it as they finish.

Why a batch with rows that join and leave: a CPU or small GPU spends most of a decode step reading
the weights, so eight requests cost little more than one per step. Prompts are left-padded so
every row's next token sits in the last column; each row keeps its own positions, so its tokens
are the ones it would get alone. A finished row is cut out of the cache, the mask and the
positions at once, so the batch shrinks instead of computing for requests nobody waits for.

Why rows join by padding (`join`): the engine schedules per step (engine.py): a new request is
prefilled as a batch of its own (a long prompt in chunks, `step(budget)`, so it does not stall the
others' decode for its whole prompt; a prompt that shares a prefix with a recent one starts from
that prefix's KV, `resume`) and then joins the running batch: the shorter side's cache and mask get
left padding up to the longer side's width (`BatchModel.join_caches`), and each row keeps its own
positions. A paged cache would save the padding columns' attention work, but on a CPU with small
models the step's cost is reading the weights; the padding is cut again as the oldest rows leave.

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
from smolforge.serve.sampling import (
    LogitAdjust,
    SamplingParams,
    adjust_for,
    adjust_rows,
    is_greedy,
    next_token,
    token_logprobs,
)
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

    @property
    def model_type(self) -> str | None:
        """The checkpoint's config `model_type`: the family (`models.families.family_of`) the HTTP side asks
        for the tool-call format, the same on every engine; None: the Generic family."""
        ...

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

    def stage_infos(self) -> list[dict[str, Any] | None]:
        """Each stage's counters for `/metrics` (`StagedModel.stage_infos`: a stage's `info()`, None for one
        that does not answer in time); [] for a model that has no stages (one process, llama.cpp)."""
        ...


class JoiningModel(BatchModel, Protocol):
    """A `BatchModel` whose batches can take new rows while they run (torch in one process, llama.cpp).
    A model without `join_caches` is batched statically (a batch runs until its last row ends)."""

    def join_caches(self, cache: Any, other: Any, pad: int, other_pad: int) -> Any:
        """`cache`'s rows then `other`'s, as one cache (`other` is used up); the side with fewer columns
        gets `pad`/`other_pad` columns of left padding so every row's newest column lines up."""
        ...


class SnapshotModel(BatchModel, Protocol):
    """A `BatchModel` whose rows' KV can be kept and started from again: the prefix cache (prefix.py)."""

    def snapshot(self, cache: Any, row: int, length: int) -> tuple[Any, int]:
        """A copy of row `row`'s KV for its last `length` positions (its prompt), and its size in bytes."""
        ...

    def restore(self, snapshot: Any, length: int) -> Any:
        """A new one-row cache holding the snapshot's first `length` positions."""
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
    adjust: LogitAdjust | None = None  # its logit_bias and penalties (`params`): the row's own state
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # each sampled token's, when asked for
    logprobs_sent: int = 0  # how many of `logprobs` went out with a TokenEvent
    token_events: int = 0  # TokenEvents sent (the first carries the prompt's log-probabilities: echo)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo: the prompt's own, the first None
    cached_tokens: int = 0  # its prompt's positions restored from the prefix cache (not computed)

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step (the client went away)."""
        self.cancelled.set()

    def unsent_logprobs(self) -> list[TokenLogprob] | None:
        """The log-probabilities not yet sent with a TokenEvent (None when the request asked for none)."""
        if self.params.logprobs is None:
            return None
        out, self.logprobs_sent = self.logprobs[self.logprobs_sent:], len(self.logprobs)
        return out


def wants_echo(r: Request) -> bool:
    """True when the request asks for its prompt's own log-probabilities: its prompt is read whole, in
    one forward that keeps every column's logits (not chunked, not started from a kept prefix)."""
    return bool(r.params.prompt_logprobs and r.params.logprobs is not None)


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
        self.fed = 0  # a one-row batch's prompt tokens in the cache so far (chunked prefill, a resumed prefix)
        self.prefilled = False  # every row's whole prompt is in the cache (rows joined later came prefilled)
        self.cost = 0  # tokens the last step computed (padding included): what it took of the step's budget
        for r in requests:
            try:
                r.stream = TextStream(model.tokenizer, r.params.stop)
                r.generator = r.params.generator(model.device)
                r.constraint = constraint_for(r.params.grammar, model.tokenizer, model.eos_ids)
                r.adjust = adjust_for(r.params)
            except Exception as err:  # noqa: BLE001 - this request fails alone (the engine tells it why)
                self.failed.append((r, err))
            else:
                self.active.append(r)

    @property
    def prefilling(self) -> bool:
        """True until every row's prompt is in the cache (the next `step` reads prompt tokens)."""
        return not self.prefilled

    def resume(self, cache: Any, length: int) -> None:
        """Start a one-row batch from a cache that already holds its prompt's first `length` tokens."""
        assert len(self.active) == 1 and self.cache is None and 0 < length < len(self.active[0].prompt_ids)
        self.cache, self.fed = cache, length

    def step(self, budget: int | None = None) -> list[int | None] | None:
        """One new token for each active request (the first call reads the prompts: prefill); None for a
        row that could not be sampled (see `row_errors`): the caller drops it with `keep`. A one-row
        batch reads at most `budget` prompt tokens a call (chunked prefill): None (no tokens at all)
        until its last chunk is in."""
        if self.prefilling:
            one = self.active[0]
            if len(self.active) == 1 and not wants_echo(one) and (self.fed or (budget is not None
                                                                          and budget < len(one.prompt_ids))):
                logits = self._chunk(budget)
                if logits is None:
                    return None
            else:
                logits = self._prefill()
        else:
            logits = self._decode()
        tokens = self._sample(logits)
        if self._greedy_ids is not None and not self.row_errors and len(self._greedy_ids) == len(tokens):
            self.last = self._greedy_ids  # every row greedy: the argmax is the next input as it is
        else:
            self.last = torch.tensor([self.model.pad_id if t is None else t for t in tokens], dtype=torch.long,
                                     device=self.model.device)
        return tokens

    def _prefill(self) -> torch.Tensor:
        """Every row's whole prompt in one forward, left-padded to the longest: the last column's logits."""
        dev = self.model.device
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
        self.cache, self.cost = self.model.new_cache(), ids.numel()
        self.fed, self.prefilled = width, True
        echo = [wants_echo(r) for r in self.active]
        if any(echo):  # every column's logits: the prompts' own log-probabilities (echo)
            every = self.model.forward(ids.to(dev), self.mask, positions, self.cache, keep=width)
            self._prompt_logprobs(every, echo)
            return every[:, -1, :]
        return self.model.forward(ids.to(dev), self.mask, positions, self.cache)

    def _chunk(self, budget: int | None) -> torch.Tensor | None:
        """The one row's next prompt tokens (at most `budget`, at least one): its logits once the last is in."""
        dev, prompt = self.model.device, self.active[0].prompt_ids
        end = len(prompt) if budget is None else min(len(prompt), self.fed + max(1, budget))
        if self.cache is None:
            self.cache = self.model.new_cache()
        if self._mask_all.shape[1] == 0:  # one row has no padding: its mask is all ones
            self._mask_all = torch.ones((1, len(prompt) + self.active[0].params.max_tokens), dtype=torch.long,
                                        device=dev)
        ids = torch.tensor([prompt[self.fed:end]], dtype=torch.long, device=dev)
        positions = torch.arange(self.fed, end, dtype=torch.long, device=dev)[None]
        self.mask = self._mask_all[:, :end]
        self.cost = end - self.fed
        logits = self.model.forward(ids, self.mask, positions, self.cache)
        self.fed, self.prefilled = end, end == len(prompt)
        self.lengths = torch.tensor([end], dtype=torch.long, device=dev)
        return logits if self.prefilled else None

    def _decode(self) -> torch.Tensor:
        """Every row's newest token through the model: one column more of the cache."""
        assert self.mask is not None and self.lengths is not None and self.last is not None
        width = self.mask.shape[1] + 1
        if width > self._mask_all.shape[1]:  # not reached: a row ends at its max_tokens
            self._mask_all = torch.cat([self._mask_all, self._mask_all.new_ones((len(self.active), 1))], dim=1)
        self.mask = self._mask_all[:, :width]
        logits = self.model.forward(self.last[:, None], self.mask, self.lengths[:, None], self.cache)
        self.lengths, self.cost = self.lengths + 1, len(self.active)
        return logits

    def _sample(self, logits: torch.Tensor) -> list[int | None]:
        """One token per row; None (and the error in `row_errors`) for a row that cannot be sampled."""
        self.row_errors = {}
        tokens: list[int | None] = []
        raw = logits = mask_rows(logits, [r.constraint for r in self.active], self.row_errors)
        logits = adjust_rows(logits, [r.adjust for r in self.active], self.row_errors)  # bias, penalties
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
                    r.logprobs.extend(token_logprobs(raw[i], [token], r.params.logprobs))
                if r.constraint is not None:
                    r.constraint.accept(token)
                if r.adjust is not None:
                    r.adjust.accept(token)
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

    def join(self, other: "Batch") -> None:
        """`other`'s rows (prefilled, each with its first token) go on in this batch: the narrower side's
        cache and mask get left padding; `other` is used up. Needs a `JoiningModel`."""
        assert not self.prefilling and not other.prefilling and self.mask is not None and other.mask is not None
        width = max(self.mask.shape[1], other.mask.shape[1])
        pads = (width - self.mask.shape[1], width - other.mask.shape[1])
        self.cache = self.model.join_caches(self.cache, other.cache, *pads)
        other.cache = None
        self.active = self.active + other.active
        reserve = max(r.params.max_tokens - len(r.token_ids) for r in self.active) + 1
        mask_all = self._mask_all.new_ones((len(self.active), width + reserve))
        mask_all[:len(self.lengths), :width] = torch.nn.functional.pad(self.mask, (pads[0], 0))
        mask_all[len(self.lengths):, :width] = torch.nn.functional.pad(other.mask, (pads[1], 0))
        self._mask_all, self.mask = mask_all, mask_all[:, :width]
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.last = torch.cat([self.last, other.last])
        self._greedy_ids = None

    def close(self) -> None:
        """Let the model free this batch's cache (a stage server holds it remotely)."""
        if self.cache is not None:
            cache, self.cache = self.cache, None
            self.model.release(cache)
