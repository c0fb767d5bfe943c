"""Which tokens end a generation: the one answer `generate`, `eval`, the teachers, both serve engines, the
stages, `split generate` and the exports ask.

The stop set is the union of
- the generation config's `eos_token_id` (an int or a list: Llama 3 lists `<|eot_id|>` and `<|eom_id|>`,
  Phi-3 lists `<|endoftext|>`, `<|assistant|>` and `<|end|>`), read from the model, a GenerationConfig,
  a dict or a checkpoint directory's `generation_config.json` (else its `config.json`);
- the tokenizer's `eos_token_id`;
- the chat template's end-of-turn token (`chat.abilities(tok).end_of_turn`), since a model fine-tuned on
  chats ends its answer with it whether or not the generation config lists it.
This is what transformers' `generate` stops on when handed the list (`eos_token_id=[...]`), and what
llama.cpp's `llama_vocab_is_eog` treats as end of generation (EOS, EOT and the tokens it recognises).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from smolforge.models.families.chat import abilities


def _as_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {int(value)}
    return {int(v) for v in value if v is not None}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def generation_eos(source: Any) -> set[int]:
    """The end-of-sequence ids a model's generation config names. `source`: a model (its
    `generation_config`, else its `config`), a GenerationConfig or config object, a dict, a checkpoint
    directory (`generation_config.json`, else `config.json`), or None."""
    if source is None:
        return set()
    if isinstance(source, (str, Path)):
        path = Path(source)
        data = _read_json(path / "generation_config.json") or _read_json(path / "config.json")
        return _as_ids(data.get("eos_token_id"))
    if isinstance(source, dict):
        return _as_ids(source.get("eos_token_id"))
    found = _as_ids(getattr(getattr(source, "generation_config", None), "eos_token_id", None))
    if not found:
        found = _as_ids(getattr(getattr(source, "config", None), "eos_token_id", None))
    return found or _as_ids(getattr(source, "eos_token_id", None))


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The chat template's end-of-turn token id, or None (no template, or no single token ends a turn)."""
    if tokenizer is None:
        return None
    text = abilities(tokenizer).end_of_turn
    if text is None:
        return None
    tid = tokenizer.convert_tokens_to_ids(text)
    return int(tid) if tid is not None and tid != getattr(tokenizer, "unk_token_id", None) else None


def turn_end_id(tokenizer: Any) -> int | None:
    """The token a chat answer ends with: the chat template's end of turn (Phi-3's `<|end|>`), else the
    tokenizer's eos (None: neither). What a response that stopped is closed with, and what the template's
    tail tokens follow (distill/student.py)."""
    eot = end_of_turn_id(tokenizer)
    return eot if eot is not None else getattr(tokenizer, "eos_token_id", None)


def stop_ids(tokenizer: Any, source: Any = None) -> frozenset[int]:
    """Every token id that ends a generation for this model (see the module doc). `source` as for
    `generation_eos`; `tokenizer` may be None (then only the generation config's ids)."""
    ids = generation_eos(source)
    if tokenizer is not None:
        ids |= _as_ids(getattr(tokenizer, "eos_token_id", None))
        eot = end_of_turn_id(tokenizer)
        if eot is not None:
            ids.add(eot)
    return frozenset(ids)


# The text llama.cpp's loader knows an end-of-message token by (llama-vocab.cpp: "find EOM token"; Llama 3.1's
# `<|eom_id|>` ends a tool call): the stop set's token of that text is written as GGUF's EOM.
EOM_TEXTS = ("<|eom_id|>",)


def gguf_stop_ids(tokenizer: Any, source: Any = None) -> dict[str, int]:
    """llama.cpp's end-of-generation keys from the stop set: `eot` (tokenizer.ggml.eot_token_id) the chat
    template's end-of-turn token, `eom` (tokenizer.ggml.eom_token_id) the set's end-of-message token; a key is
    absent when the set has no such token. llama.cpp stops on EOS, EOT and EOM (`llama_vocab_is_eog`)."""
    stops = stop_ids(tokenizer, source)
    out: dict[str, int] = {}
    eot = end_of_turn_id(tokenizer)
    if eot is not None and eot in stops:
        out["eot"] = eot
    eom = [i for i in sorted(stops) if tokenizer.convert_ids_to_tokens(i) in EOM_TEXTS]
    if eom:
        out["eom"] = eom[0]
    return out


def stop_texts(tokenizer: Any, source: Any = None) -> list[str]:
    """The stop set as token texts (Ollama's `PARAMETER stop` lines, GGUF's EOT metadata), sorted by id."""
    return [tokenizer.convert_ids_to_tokens(i) for i in sorted(stop_ids(tokenizer, source))]


def cut_at_stop(ids: list[int], stops: frozenset[int] | set[int], keep: bool = True) -> list[int]:
    """`ids` up to the first id of `stops` (with it when `keep`, the teachers' "response up to and
    including its end"; without it for the text a user reads); all of `ids` when none is a stop."""
    for i, tid in enumerate(ids):
        if tid in stops:
            return list(ids[: i + 1 if keep else i])
    return list(ids)
