"""How one request picks its next token: greedy at temperature 0, else temperature and top-p sampling,
after its `logit_bias` and its frequency and presence penalties (`LogitAdjust`).

Why a generator per request: requests batched together must not share a random stream, or a
request's text would depend on who else was in its batch; with its own `torch.Generator` seeded
from `seed`, the same request gives the same text alone or batched.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from smolforge.serve.events import LOGPROB_FLOOR, TokenLogprob

if TYPE_CHECKING:  # torch is imported where a token is drawn: the HTTP front process makes params, never draws
    import torch


@dataclass
class SamplingParams:
    """What a request asks for. `temperature` 0 means greedy (argmax, no randomness)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None  # None: none; k >= 0: each generated token's and the k most likely's
    prompt_logprobs: bool = False  # also the prompt's own (echo), with `logprobs` alternatives each;
    # with max_tokens 0 only those: the prompt is read and nothing generated
    grammar: str | None = None  # llguidance's grammar text the answer must follow (serve/structured.py)
    frequency_penalty: float = 0.0  # subtracted per time a token was generated in this choice (OpenAI's)
    presence_penalty: float = 0.0  # subtracted once from each token generated in this choice
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)

    def __post_init__(self) -> None:
        # ids as ints: params cross the front-to-engine channel as JSON, whose object keys are strings
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    @property
    def adjusts(self) -> bool:
        """True when the logits get an offset before sampling (a bias or a penalty)."""
        return bool(self.logit_bias or self.frequency_penalty or self.presence_penalty)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The request's own random stream (None when greedy: nothing to draw)."""
        if self.temperature <= 0:
            return None
        import torch

        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return g


class LogitAdjust:
    """One choice's additive offset to its logits: `bias[j] - c[j] * frequency - (c[j] > 0) * presence`,
    c[j] the times this choice generated token j so far (OpenAI's definition; the prompt does not count).

    The offset is a float32 vector of the logits' width, made at the first `offset` call (when the
    width is known); `accept(token)` moves one entry. ValueError for a biased id outside the logits."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.counts: dict[int, int] = {}  # token id -> times generated in this choice
        self.vector: torch.Tensor | None = None

    def offset(self, n_vocab: int, device: torch.device | str) -> torch.Tensor:
        """The offset now, [n_vocab] float32 on `device`."""
        if self.vector is None:
            import torch

            vector = torch.zeros(n_vocab, dtype=torch.float32)
            bias = self.params.logit_bias
            if bias:
                if max(bias) >= n_vocab:
                    raise ValueError(f"logit_bias names token {max(bias)}, but the model has {n_vocab} logits")
                vector[list(bias)] = torch.tensor(list(bias.values()), dtype=torch.float32)
            self.vector = vector.to(device)
        return self.vector

    def accept(self, token: int) -> None:
        """`token` was generated: its penalty grows (once by `presence`, each time by `frequency`)."""
        c = self.counts[token] = self.counts.get(token, 0) + 1
        if self.vector is not None:
            p = self.params
            self.vector[token] = p.logit_bias.get(token, 0.0) - (c * p.frequency_penalty + p.presence_penalty)


def adjust_for(params: SamplingParams) -> LogitAdjust | None:
    """The request's logit offset, or None when it asks for none."""
    return LogitAdjust(params) if params.adjusts else None


def adjust_rows(logits: torch.Tensor, adjusts: list[LogitAdjust | None], errors: dict[int, Exception]) -> torch.Tensor:
    """`logits` ([rows, vocab]) with each adjusted row's offset added, as a new float32 tensor (the
    engines' logits may be inference tensors or llama.cpp's own buffer); `logits` itself when no row
    is adjusted. A row whose offset cannot be made keeps its logits and gets its error in `errors`."""
    import torch

    rows, offsets = [], []
    for i, a in enumerate(adjusts):
        if a is not None and i not in errors:
            try:
                offsets.append(a.offset(logits.shape[-1], logits.device))
                rows.append(i)
            except Exception as err:  # noqa: BLE001 - that row fails, the others go on
                errors[i] = err
    if not rows:
        return logits
    if len(rows) == logits.shape[0]:  # every row: one add, no index
        return logits.float() + torch.stack(offsets)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return logits.float().index_add(0, index, torch.stack(offsets))


def is_greedy(params: SamplingParams, generator: torch.Generator | None) -> bool:
    """True when the next token is the argmax (nothing to draw)."""
    return params.temperature <= 0 or generator is None


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row of logits (shape [vocab])."""
    import torch

    if is_greedy(params, generator):
        return int(torch.argmax(logits).item())
    # Shifted before dividing, by a temperature float32 can hold (1e-300 is a valid request but
    # rounds to 0 there): the best logit scales to 0, not inf, so softmax never sees inf - inf (NaN).
    scaled = (logits.float() - logits.float().max()) / max(params.temperature, 1e-30)
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` (at least one)."""
    import torch

    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    sorted_probs[0] = sorted_probs[0].clamp_min(1e-12)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum()


def token_logprobs(logits: torch.Tensor, chosen: list[int], k: int) -> list[TokenLogprob]:
    """Each row's log-probability of its `chosen` token and its `k` most likely tokens (best first).

    logits: [n, vocab], one row per position; chosen: n token ids; k: 0..20 alternatives.
    Of the raw model distribution: log-softmax of the logits in float32, before temperature and
    top-p (what vLLM returns by default, `logprobs_mode="raw_logprobs"`, and what a logit teacher or
    an evaluation harness needs: the model's own likelihood, not the sampler's). A -inf (a masked
    logit) is floored at LOGPROB_FLOOR, OpenAI's "very unlikely"."""
    import torch

    if logits.dim() == 1:
        logits = logits[None]
    lp = torch.log_softmax(logits.float(), dim=-1).clamp_min(LOGPROB_FLOOR)
    picked = lp.gather(-1, torch.tensor(chosen, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if k > 0:
        values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in chosen]
    return [TokenLogprob(int(c), float(p), top) for c, p, top in zip(chosen, picked, tops)]
