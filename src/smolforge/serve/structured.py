"""Constrained decoding: a grammar decides which tokens a request's next row may take (llguidance).

What it serves: `response_format` (`json_object`: any JSON object; `json_schema`: an object of that
schema) and the tool-call formats of `tool_choice` `required` or a named function (serve/tools.py
writes those grammars). A request carries its grammar as llguidance's own grammar text
(`SamplingParams.grammar`, a JSON string: it crosses the front-to-engine channel as it is); the HTTP
side makes and checks it (`grammar_for`, a bad schema is a 400 before the engine sees it), the
engine's batch turns it into a `Constraint` per request.

Why llguidance (1.9.1) and not xgrammar (0.2.8): both install here from the registry and both read HF
tokenizers, but llguidance is one wheel without dependencies, while xgrammar pulls triton and a TVM
runtime into a CPU install; llguidance also takes Lark grammars with `%json` inside, which is how a
tool call (`<tool_call>` + JSON + `</tool_call>`) is written.

Why one mask path for both engines, not llama.cpp's GBNF: the llamacpp engine samples in Python from
llama.cpp's own logits rows (`LogitsView`), with the same `Batch._sample` as torch; llama.cpp's grammar
lives in its sampler chain, which this engine does not use. One mask on the row, before the token is
drawn, serves torch, llama.cpp and stages alike.

Cost: the mask is computed per step per constrained row (llguidance: tens of microseconds for a JSON
grammar on a small vocabulary); an unconstrained batch pays nothing.

A finish at `max_tokens` before the grammar is complete is what OpenAI does: `finish_reason` "length"
and the text so far (which does not parse). A finished grammar allows only the model's end tokens.
"""

from __future__ import annotations

import json
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

INSTALL_FIX = "pip install llguidance==1.9.1 (a smolforge dependency), or send the request without response_format/tool_choice"


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as err:  # noqa: F841 - the caller turns this into its own refusal
        raise RuntimeError(f"constrained decoding needs llguidance, which is not installed: {INSTALL_FIX}") from None
    return llguidance


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """llguidance's grammar for JSON of this schema (compact separators: no free whitespace a random
    model could spend its tokens on). Raises ValueError naming what is wrong with the schema."""
    llg = _llg()
    grammar = llg.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), overrides={"whitespace_flexible": False})
    check_grammar(grammar)
    return grammar


def lark_grammar(lark: str) -> str:
    """llguidance's grammar for a Lark grammar (which may embed `%json {schema}`). ValueError when invalid."""
    grammar = _llg().LLMatcher.grammar_from_lark(lark)
    check_grammar(grammar)
    return grammar


def check_grammar(grammar: str) -> None:
    """ValueError with llguidance's message when the grammar cannot be built."""
    error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise ValueError(messages[0] if messages else "invalid grammar")


_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]]" = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, n_vocab: int, eos_ids: frozenset[int]) -> Any:
    """llguidance's view of a HF (fast) tokenizer for logits rows of `n_vocab` entries; cached per
    tokenizer object (it reads the whole vocabulary: milliseconds for a small one, about a second for 150k)."""
    import llguidance.hf

    key = (n_vocab, tuple(sorted(eos_ids)))
    per = _TOKENIZERS.setdefault(tokenizer, {})
    if key not in per:
        eos = list(key[1]) or None
        per[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
    return per[key]


class Constraint:
    """One request's grammar state. `allowed(n)` is the next token's mask ([n] bool); `accept(token)`
    moves the grammar on. The matcher is made at the first mask, when the logits' width is known."""

    def __init__(self, grammar: str, tokenizer: Any, eos_ids: frozenset[int]):
        self.grammar, self.tokenizer, self.eos_ids = grammar, tokenizer, eos_ids
        self.matcher: Any = None
        self.masks = 0  # masks computed: the tests check the constraint was applied

    def _start(self, n_vocab: int) -> Any:
        llg = _llg()
        self.matcher = llg.LLMatcher(ll_tokenizer(self.tokenizer, n_vocab, self.eos_ids), self.grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {self.matcher.get_error()}")
        return self.matcher

    def allowed(self, n_vocab: int) -> torch.Tensor:
        """The tokens the grammar allows next, as a bool tensor of `n_vocab` entries."""
        import torch

        matcher = self.matcher or self._start(n_vocab)
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        self.masks += 1
        allowed = torch.from_numpy(bits[:n_vocab].astype(bool))
        if not bool(allowed.any()):
            raise ValueError(f"the grammar allows no next token: {matcher.get_error() or 'a dead end'}")
        return allowed

    def accept(self, token: int) -> None:
        """The token drawn for this row (one the mask allowed)."""
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise ValueError(f"the grammar refused token {token}: {self.matcher.get_error()}")


def constraint_for(grammar: str | None, tokenizer: Any, eos_ids: frozenset[int]) -> Constraint | None:
    """The request's constraint, or None when it has no grammar."""
    return None if grammar is None else Constraint(grammar, tokenizer, eos_ids)


def mask_rows(logits: torch.Tensor, constraints: list[Constraint | None], errors: dict[int, Exception]) -> torch.Tensor:
    """`logits` ([rows, vocab]) with every constrained row's disallowed tokens at -inf: a new tensor
    (the engines' logits may be inference tensors or llama.cpp's own buffer), or `logits` itself when
    no row is constrained. A row whose grammar fails is left as it is and its error put in `errors`."""
    import torch

    if all(c is None for c in constraints):
        return logits
    keep = torch.ones(logits.shape, dtype=torch.bool)
    for i, c in enumerate(constraints):
        if c is not None:
            try:
                keep[i] = c.allowed(logits.shape[-1])
            except Exception as err:  # noqa: BLE001 - that row fails, the others go on
                errors[i] = err
    return torch.where(keep.to(logits.device), logits, torch.tensor(float("-inf"), dtype=logits.dtype,
                                                                     device=logits.device))


def response_grammar(response_format: Any) -> str | None:
    """The grammar of a chat request's `response_format` (protocol.ResponseFormat, or None): None for
    `text`; any JSON object for `json_object`; the schema's JSON for `json_schema`. ValueError saying
    what is wrong (no schema, a schema llguidance cannot compile)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return json_schema_grammar({"type": "object"})
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise ValueError("response_format of type json_schema needs json_schema.schema (a JSON schema object)")
    try:
        return json_schema_grammar(spec.schema_)
    except Exception as err:  # noqa: BLE001 - whatever the compiler says of a client's schema is a 400
        raise ValueError(f"json_schema.schema cannot be used: {err}") from None


def response_grammar_wanted(response_format: Any) -> bool:
    """Whether `response_format` asks for a constraint (anything but absent or `text`)."""
    return response_format is not None and response_format.type != "text"
