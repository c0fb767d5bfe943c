"""A tokenizer of a published family's kind, trained locally in seconds, with the published ids.

Why: what breaks on published models is rarely the merges; it is the pipeline around them (a NFC
normalizer, a Llama-3 regex that groups digits in threes, ByteLevel with or without a prefix space,
SentencePiece-style `▁` + byte fallback, a BOS added by the post-processor) and special tokens at ids
near the end of a 150k vocabulary. So the twin keeps the published pipeline (`tokenizer_header.json`)
verbatim, trains a few thousand merges on a small corpus through that same pipeline, places the
published special/added tokens at their ids, and pads the rest of the vocabulary with filler tokens no
input can reach (multi-character, never produced by a merge, not added tokens).
"""

from __future__ import annotations

import copy
import json

from smolforge.models import tiny

TRAINED_VOCAB = 2000  # alphabet + merges; a few seconds to train on two cores
FILLER = "\u2400filler{}"  # U+2400 is outside the byte-level alphabet; no merge ever builds these


def corpus() -> list[str]:
    """tiny's corpus plus what chat turns and code contain: indentation, punctuation, non-Latin text."""
    extra = [
        "def main(argv):\n    for i in range(10):\n        print(f\"{i:03d}\", argv[i])\n    return 0\n",
        "if (x != y && z >= 0) { return a[i] * 2; }  // C-style code",
        "Größe, café, naïve, Ελληνικά, русский текст, 日本語のテキスト, 中文文本, 한국어",
        "Emoji 🙂 and symbols © ± ≤ ≥ → ∑ √", "Tabs\tand\nnewlines\r\n  and   runs of spaces",
        "JSON: {\"key\": [1, 2.5, true, null]} <tag attr='v'>text</tag>",
    ]
    return tiny._tokenizer_corpus()[:6000] + extra * 50


def _train(header: dict, sentencepiece: bool) -> tuple[list[str], list]:
    """Trained tokens (in the trainer's id order) and merges, through the family's own pipeline."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers

    stub = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": header["normalizer"], "pre_tokenizer": header["pre_tokenizer"],
            "post_processor": None, "decoder": header["decoder"],
            "model": {**header["model"], "vocab": {}, "merges": []}}
    if sentencepiece:
        # SentencePiece never merges across a `▁`: train word by word, then serve with the published
        # pipeline (Prepend + Replace normalizer, no pre-tokenizer) exactly as published.
        stub["normalizer"] = None
        stub["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                                 "split": True}
    tok = Tokenizer.from_str(json.dumps(stub))
    alphabet = [] if sentencepiece else pre_tokenizers.ByteLevel.alphabet()
    limit = {"limit_alphabet": 200} if sentencepiece else {}  # rarer characters go to byte fallback
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_VOCAB, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=[], **limit)
    tok.train_from_iterator(corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    return sorted(model["vocab"], key=model["vocab"].get), model["merges"]


def _layout(header: dict, trained: list[str], sentencepiece: bool) -> dict[str, int]:
    """The model vocabulary: published tokens at their ids, trained tokens in the free ids, then filler."""
    size = header["model_vocab_size"]
    fixed = {t["id"]: t["content"] for t in header["added_tokens"] if t["id"] < size}
    if sentencepiece:  # byte-fallback tokens follow <unk> <s> </s>, as in the Llama 2 vocabulary
        fixed.update({3 + b: f"<0x{b:02X}>" for b in range(256)})
    trained = [t for t in trained if t not in fixed.values()]
    free = [i for i in range(size) if i not in fixed]
    if len(trained) > len(free):
        raise ValueError(f"{len(trained)} trained tokens do not fit in {len(free)} free ids")
    vocab = {content: i for i, content in fixed.items()}
    vocab.update({t: i for t, i in zip(trained, free)})
    vocab.update({FILLER.format(i): i for i in free[len(trained):]})
    return vocab


def tokenizer_json(header: dict) -> dict:
    """The full tokenizer.json of the twin: the published pipeline and added tokens around a local model."""
    sentencepiece = bool(header["model"].get("byte_fallback"))
    trained, merges = _train(header, sentencepiece)
    vocab = _layout(header, trained, sentencepiece)
    added = copy.deepcopy(header["added_tokens"])
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": header["normalizer"], "pre_tokenizer": header["pre_tokenizer"],
            "post_processor": header["post_processor"], "decoder": header["decoder"],
            "model": {**header["model"], "vocab": vocab, "merges": merges}}
