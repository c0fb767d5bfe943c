"""A request body before and after the parser: nesting refused before `json.loads` runs (brackets inside
strings do not count), strict UTF-8 and numbers, lone surrogates found by their path; and the bound on a
prompt's characters, only for tokenizers that never turn many characters into one token."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from smolforge.http_limits import MAX_JSON_DEPTH
from smolforge.serve import intake
from smolforge.serve.intake import char_bound, lone_surrogate, read_json
from smolforge.serve.protocol import ApiError


def nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def refusal(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as err:
        read_json(raw)
    assert err.value.status == 400
    return err.value


def test_a_deep_body_never_reaches_the_parser(monkeypatch):
    parsed = []
    real = json.loads
    monkeypatch.setattr(intake.json, "loads", lambda *a, **k: parsed.append(1) or real(*a, **k))
    assert read_json(nested(MAX_JSON_DEPTH)) and parsed == [1]
    err = refusal(nested(MAX_JSON_DEPTH + 1))
    assert err.code == "invalid_json" and f"more than {MAX_JSON_DEPTH} levels" in err.message and parsed == [1]
    refusal(b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert parsed == [1]
    # brackets inside a string are text, however escaped
    text = json.dumps({"content": "[" * 1000 + '\\"' + "{" * 1000}).encode()
    assert read_json(text)["content"].startswith("[[[")


def test_broken_bodies_are_400_with_the_reason():
    assert "not valid JSON" in refusal(b"[" * 100_000).message  # never closed: the parser's bounded refusal
    assert "not valid JSON" in refusal(b"{not json").message
    assert "not UTF-8" in refusal(b'{"a": "\xed\xa0\x80"}').message  # a surrogate as raw bytes
    assert "NaN is not a JSON number" in refusal(b'{"a": NaN}').message
    assert "not valid JSON" in refusal(b'{"a": ' + b"9" * 5000 + b"}").message
    assert "must be a JSON object" in refusal(b"[1]").message


def test_a_lone_surrogate_is_found_by_its_path():
    data = json.loads('{"messages": [{"role": "user", "content": "ok"}, {"content": "x\\ud800"}], "ok": "\\ud83d\\ude00"}')
    assert lone_surrogate(data) == "messages.1.content"
    assert lone_surrogate(json.loads('{"emoji": "\\ud83d\\ude00"}')) is None  # a pair is one character
    err = refusal(b'{"messages": [{"content": "ok"}, {"content": "\\udfff"}]}')
    assert err.param == "messages.1.content" and "lone UTF-16 surrogate" in err.message


class SpecTokenizer:
    """A tokenizer as `char_bound` reads it: its tokenizer.json and its vocabulary."""

    def __init__(self, spec: dict):
        self.backend_tokenizer = SimpleNamespace(to_str=lambda: json.dumps(spec))

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "abc": 1}


def test_the_character_bound_is_kept_for_tokenizers_that_keep_characters(served_tiny):
    longest = max(len(t) for t in served_tiny.tokenizer.get_vocab())
    assert char_bound(served_tiny.tokenizer, 512) == 4 * longest * 512
    ids = served_tiny.tokenizer("x" * 4 * longest * 512)["input_ids"]
    assert len(ids) > 512  # at the bound, the text is over the context indeed
    base = {"model": {"type": "BPE"}, "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}]}}
    assert char_bound(SpecTokenizer(base), 10) == 4 * 3 * 10
    for change in ({"normalizer": {"type": "StripAccents"}}, {"pre_tokenizer": {"type": "WhitespaceSplit"}},
                   {"pre_tokenizer": {"type": "Split", "behavior": "Removed"}}, {"model": {"type": "WordPiece"}},
                   {"model": {"type": "BPE", "fuse_unk": True}},
                   {"normalizer": {"type": "Sequence", "normalizers": [
                       {"type": "NFC"}, {"type": "Replace", "pattern": {"String": "  "}, "content": " "}]}}):
        assert char_bound(SpecTokenizer({**base, **change}), 10) is None, change
