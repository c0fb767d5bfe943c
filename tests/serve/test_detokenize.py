"""The incremental detokenizer (`TextStream`): at every token its text is the whole answer's decode
and it releases the very chunks the old whole-answer decoder did (same held-back half characters,
same stop-string cuts), for a byte-level BPE and a SentencePiece-style tokenizer (byte fallback,
leading spaces); and its decoding work grows linearly with the answer, not quadratically."""

from __future__ import annotations

import random

import pytest

from smolforge.serve.stops import TextStream


class WholeDecode:
    """The reference: the old `TextStream`, which decoded the whole answer at every token."""

    def __init__(self, tokenizer, stop):
        self.tokenizer, self.stop, self.ids, self.sent, self.text, self.stopped = tokenizer, stop, [], 0, "", False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s)
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
        if self.stopped:
            return self._release(len(self.text))
        safe = len(self.text.rstrip("\ufffd"))
        return self._release(safe - max([n for s in self.stop for n in range(1, len(s))
                                         if self.text[:safe].endswith(s[:n])], default=0))

    def finish(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out


def run(stream, ids: list[int]) -> list[str]:
    chunks = []
    for i in ids:
        chunks.append(stream.push(i))
        if stream.stopped:
            break
    return chunks + [stream.finish()]  # what was held back


def check(tokenizer, ids: list[int], stop: list[str]) -> TextStream:
    """The incremental stream and the reference agree chunk by chunk; without a stop hit, the answer
    is exactly the whole decode."""
    ts = TextStream(tokenizer, stop)
    new, old = run(ts, ids), run(WholeDecode(tokenizer, stop), ids)
    assert new == old, (ids, stop)
    if not ts.stopped:
        assert ts.text == "".join(new) == tokenizer.decode(ids, skip_special_tokens=True)
    return ts


@pytest.fixture(scope="module")
def sentencepiece():
    """A Llama-style tokenizer (Metaspace pieces, <0xNN> byte fallback, the first space stripped on
    decode): built from a vocabulary, no download; only decoding is exercised."""
    from helpers import byte_fallback_tokenizer

    return byte_fallback_tokenizer(["▁", "▁Hello", "▁world", ",", ".", "▁the", "▁café", "ing", "▁S", "T", "O", "P",
                                    "▁\n", "!"])


def _bytes(vocab: dict[str, int], text: str) -> list[list[int]]:
    """A character as its UTF-8 bytes, one <0xNN> token each: split across tokens."""
    return [[vocab[f"<0x{b:02X}>"] for b in text.encode()]]


def test_sentencepiece_answers_decode_exactly_and_stops_span_tokens(sentencepiece):
    tok, vocab = sentencepiece
    words = [[vocab[p]] for p in ("▁Hello", "▁world", ",", ".", "▁the", "▁café", "ing", "▁", "▁\n", "!", "<s>")]
    chars = _bytes(vocab, "€") + _bytes(vocab, "😀") + _bytes(vocab, "é") + _bytes(vocab, "日")
    stop_word = [vocab[p] for p in ("▁S", "T", "O", "P")]  # " STOP": a stop string over four tokens
    rng = random.Random(0)
    for trial in range(60):
        parts = [rng.choice(words + chars) for _ in range(rng.randint(1, 40))]
        if trial % 3 == 0:
            parts.insert(rng.randint(0, len(parts)), stop_word)
        ids = [i for p in parts for i in p]
        stop = [["STOP"], ["€."], ["d,", "TOP"], []][trial % 4]
        check(tok, ids, stop)
    ts = check(tok, [vocab["▁Hello"], *stop_word, vocab["▁world"]], ["STOP"])
    assert ts.stopped and ts.text == "Hello "
    ts = check(tok, [vocab["▁Hello"], *_bytes(vocab, "€")[0], vocab["."], vocab["▁world"]], ["€."])
    assert ts.stopped and ts.text == "Hello"


def test_byte_level_answers_decode_exactly(tiny_llama_dir):
    from smolforge.models.loading import load_tokenizer

    tok = load_tokenizer(str(tiny_llama_dir))
    text = "What is 12 + 7? 19. Café: 5 €, naïve 日本語 😀 done.\n  Next line"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # a character split across tokens
    assert check(tok, ids, []).text == text
    check(tok, ids, ["€,"])  # a stop string that ends in a multi-byte character
    check(tok, ids, ["日本"])


def test_decoding_work_is_linear_in_the_answer(sentencepiece):
    """The old stream read n*(n+1)/2 ids for an n-token answer; the window reads a few per token."""
    tok, vocab = sentencepiece
    ids = [vocab["▁Hello"], vocab["▁world"], *_bytes(vocab, "€")[0], vocab[","]] * 100
    ts = check(tok, ids, ["never"])
    assert ts.decoded_ids <= 12 * len(ids), ts.decoded_ids


def test_a_tokenizer_that_rewrites_text_is_decoded_whole():
    """With clean_up_tokenization_spaces ("Hello ." becomes "Hello.", which transformers applies to
    non-BPE models) a window cannot be exact: such a tokenizer's answers are decoded whole."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "Hello": 1, "world": 2, ".": 3, "a": 4, ",": 5, "!": 6, "?": 7}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    ids = [vocab[w] for w in ("Hello", ".", "world", ".", "a", ",", "a", "!")] * 10
    ts = check(fast, ids, [])
    assert ts.decoded_ids == len(ids) * (len(ids) + 1) // 2 and ts.text.startswith("Hello. world. a, a! Hello.")
    fast.clean_up_tokenization_spaces = False  # the same tokenizer without the cleanup: the window
    ts = check(fast, ids, [])
    assert ts.decoded_ids <= 12 * len(ids) and ts.text.startswith("Hello . world . a , a ! Hello .")
