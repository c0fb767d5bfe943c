"""Each vocabulary entry's own bytes: the one answer to "what bytes is token N?".

Why bytes and not text: a token can be part of a character (a byte-level BPE token holding the first
byte of "é", a SentencePiece byte-fallback token `<0xC3>`); decoded alone it is U+FFFD, which names no
token. Its bytes name it exactly. OpenAI's `logprobs.content[i].bytes` (and llama-server's, for both
endpoints) carry them; `smolforge serve` sends them (`serve/logprobs.py`) and the endpoint and Ollama
teachers map them back to ids (`distill/teacher_openai.py`, `distill/ollama.py`).

Where the bytes come from is the tokenizer's own decoder (tokenizer.json's `decoder`), never a guess
from a token's spelling: a byte-level decoder (GPT-2, Llama 3, Qwen2, SmolLM, the tiny presets) spells
byte b as `byte_alphabet()[b]`; a SentencePiece-style one (byte fallback: Llama 2, TinyLlama, Phi-3,
Gemma) spells a byte as `<0xAB>` and a space as `▁`, the rest as the UTF-8 of its characters. The same
character in the two kinds is different bytes ("é" is byte 0xE9 in the first, bytes C3 A9 in the
second), so the kind is read once per tokenizer. Added tokens (`<tool_call>`) are their content's UTF-8;
special tokens (`<|im_end|>`) and a tokenizer of neither kind have none (None): callers use the text.

Torch-free (the HTTP front process of `serve` imports it).
"""

from __future__ import annotations

import json
import weakref
from functools import lru_cache
from typing import Any

SPACE = "\u2581"  # SentencePiece's space


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies (256 entries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def _inverse_alphabet() -> dict[str, int]:
    return {c: b for b, c in byte_alphabet().items()}


def _decoder_types(tokenizer: Any) -> set[str]:
    """The step types of the tokenizer's decoder (tokenizer.json), flattened; empty for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {s.get("type") for s in steps if isinstance(s, dict)}


def tokenizer_kind(tokenizer: Any) -> str | None:
    """`byte-level`, `sentencepiece` (byte fallback or `▁` spaces) or None (neither: no bytes known)."""
    types = _decoder_types(tokenizer)
    if "ByteLevel" in types:
        return "byte-level"
    if types & {"ByteFallback", "Metaspace", "Replace"}:
        return "sentencepiece"
    return None


def is_byte_piece(piece: str | None) -> bool:
    """A SentencePiece byte-fallback token (`<0xAB>`): used only for a byte no other piece spells, so where
    it and a piece share bytes ("k" and <0x6B>), the tokenizer makes the piece."""
    return bool(piece) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")  # type: ignore[union-attr]


def piece_bytes(piece: str, kind: str | None) -> bytes | None:
    """The bytes a vocabulary piece (as `convert_ids_to_tokens` spells it) stands for, in a tokenizer of
    `kind`; None when the piece is not a spelling of that kind."""
    if kind == "byte-level":
        inverse = _inverse_alphabet()
        return bytes(inverse[c] for c in piece) if piece and all(c in inverse for c in piece) else None
    if kind == "sentencepiece":
        if is_byte_piece(piece):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        return piece.replace(SPACE, " ").encode("utf-8") if piece else None
    return None


_cache: "weakref.WeakKeyDictionary[Any, list[bytes | None]]" = weakref.WeakKeyDictionary()


def vocab_bytes(tokenizer: Any) -> list[bytes | None]:
    """Every id's bytes (`len(tokenizer)` entries): its piece's bytes (`piece_bytes`), an added token's
    content as UTF-8, None for a special token or a tokenizer of no known kind. Made once per tokenizer
    object (a 150k vocabulary takes a fraction of a second)."""
    try:
        return _cache[tokenizer]
    except (KeyError, TypeError):
        pass
    kind = tokenizer_kind(tokenizer)
    n = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []))
    added = {i: getattr(t, "content", str(t)) for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
    out: list[bytes | None] = [None] * n
    if kind is not None:
        for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(n)))):
            if i in special:
                continue
            out[i] = added[i].encode("utf-8") if i in added else piece_bytes(piece, kind) if piece else None
    try:
        _cache[tokenizer] = out
    except TypeError:  # not weakly referable: made again next time
        pass
    return out
