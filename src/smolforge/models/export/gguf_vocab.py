"""The tokenizer half of a GGUF: which llama.cpp tokenizer reproduces tokenizer.json, and its keys.

llama.cpp tokenizes with its own code, chosen by two keys: `tokenizer.ggml.model` (`gpt2` is
byte-level BPE, `llama` is SentencePiece-style BPE with byte fallback) and, for byte-level BPE,
`tokenizer.ggml.pre` (the regex split before BPE). The name is read from what tokenizer.json's
normalizer and pre_tokenizer actually do, compared step by step with the published tokenizers
(never guessed: a wrong name tokenizes differently and the model reads garbage). The names and
regexes are llama.cpp's, src/llama-vocab.cpp (github.com/ggerganov/llama.cpp at c392e5094dea):
- `gpt-2`: ByteLevel with its built-in regex (openai-community/gpt2), or that regex as a Split;
- `llama-bpe`: Llama 3's Split regex, llama-vocab.cpp l.281-282 "original regex from
  tokenizer.json" (meta-llama/Llama-3.2-1B-Instruct has the same pre_tokenizer); llama.cpp also
  turns on `ignore_merges` for it (llama_vocab::impl::load), as Llama 3's tokenizer.json does;
- `smaug-bpe`: the same Llama 3 regex with `ignore_merges` false, as some Llama 3 fine-tunes ship
  it (convert_hf_to_gguf.py names abacusai/Smaug-Llama-3-70B-Instruct for it): llama.cpp's
  LLAMA_VOCAB_PRE_TYPE_SMAUG splits with the Llama 3 regex ("same as llama3", beside DBRX in
  llm_tokenizer_bpe) and its load leaves `ignore_merges` off, so a word that is a whole token is
  still built by the merges, as HF does with ignore_merges false (checked against HF by
  tests/test_export_families.py on the Llama 3.2 twin's tokenizer with the flag flipped);
- `qwen2`: Qwen2's Split regex, llama-vocab.cpp l.351-352 (Qwen/Qwen2.5-0.5B-Instruct), NFC
  normalizer (text that is already NFC, the usual case, splits the same);
- `starcoder`: single digits split first, then ByteLevel's regex (llama-vocab.cpp l.328-339:
  `\\p{N}` then GPT-2's regex; `smollm` is the same case, so SmolLM2 and our presets both fit).
"""

from __future__ import annotations

import json
from pathlib import Path

from smolforge.errors import SmolforgeError

# tokenizers' ByteLevel(use_regex=True) split, as written in tokenizer.json when spelled out as a Split
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_LLAMA3_STEPS = (("Split", LLAMA3_REGEX), ("ByteLevel", False))

# (the pre_tokenizer steps (see _step), tokenizer.json's model.ignore_merges) -> llama.cpp's pre-tokenizer
# name; llama.cpp's llama_vocab load turns ignore_merges on for llama-bpe and leaves it off for the others
BYTE_LEVEL_PRE = {
    ((("ByteLevel", True),), False): "gpt-2",
    ((("Split", GPT2_REGEX), ("ByteLevel", False)), False): "gpt-2",
    (_LLAMA3_STEPS, True): "llama-bpe",
    (_LLAMA3_STEPS, False): "smaug-bpe",
    ((("Split", QWEN2_REGEX), ("ByteLevel", False)), False): "qwen2",
    ((("Digits", True), ("ByteLevel", True)), False): "starcoder",
}


def _refuse(what: str) -> SmolforgeError:
    return SmolforgeError(what, fix="export with --to hf and convert with llama.cpp's convert_hf_to_gguf.py, "
                                    "which knows the tokenizers of published models")


def _step(step: dict) -> tuple:
    """What matters of one pre-tokenizer step for the split it makes; anything unusual stays visible."""
    kind = step.get("type")
    if kind == "ByteLevel":
        if step.get("add_prefix_space", False):
            return (kind, "add_prefix_space")
        return (kind, step.get("use_regex", True))
    if kind == "Digits":
        return (kind, step.get("individual_digits", False))
    if kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert", False):
        return (kind, (step.get("pattern") or {}).get("Regex"))
    return (kind, json.dumps(step, sort_keys=True))


def _steps(node: dict | None) -> list[dict]:
    if not node:
        return []
    return node.get("pretokenizers" if "pretokenizers" in node else "normalizers", []) \
        if node.get("type") == "Sequence" else [node]


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """The llama.cpp pre-tokenizer that tokenizes exactly as a byte-level tokenizer.json does: the same
    split, and the same `ignore_merges` (a word that is a whole vocabulary token taken as it is, or
    built by the merges). Raises SmolforgeError (with the converter to use instead) when none does."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = tuple(_step(s) for s in _steps(pre))
    if not any(key[0] == steps for key in BYTE_LEVEL_PRE):
        raise _refuse(f"the tokenizer's pre-tokenizer {json.dumps(pre)[:300]} has no known llama.cpp equivalent")
    norm = [s.get("type") for s in _steps(tokenizer_json.get("normalizer"))]
    if norm not in ([], ["NFC"]):
        raise _refuse(f"the tokenizer's normalizer {norm} has no llama.cpp equivalent for byte-level BPE")
    ignore = bool(tokenizer_json["model"].get("ignore_merges", False))
    name = BYTE_LEVEL_PRE.get((steps, ignore))
    if name is None:
        other = BYTE_LEVEL_PRE[(steps, not ignore)]
        raise _refuse(f"tokenizer.json has ignore_merges={ignore} but llama.cpp's {other!r} pre-tokenizer, the one "
                      f"with its split, {'applies' if ignore else 'ignores'} the merges for whole-word tokens")
    return name


def spm_prefix(tokenizer_json: dict) -> bool | None:
    """For a SentencePiece-style BPE (byte fallback, '▁' for spaces): whether a '▁' is prepended to
    each stretch of text (llama.cpp's add_space_prefix); None when the tokenizer is not of that kind.

    Two spellings reach the same split: the legacy normalizer Prepend('▁') + Replace(' ', '▁')
    (TinyLlama, Phi-3), or a Metaspace pre-tokenizer. llama.cpp prepends after every special token
    too, as Prepend and Metaspace's 'always' do; Metaspace's 'first' does not, so it is refused.
    """
    model = tokenizer_json.get("model", {})
    if not model.get("byte_fallback"):
        return None
    norm = [(s.get("type"), s.get("prepend"), s.get("content"), (s.get("pattern") or {}).get("String"))
            for s in _steps(tokenizer_json.get("normalizer"))]
    pre = tokenizer_json.get("pre_tokenizer")
    if not pre and norm == [("Prepend", "▁", None, None), ("Replace", None, "▁", " ")]:
        return True
    if not pre and norm == [("Replace", None, "▁", " ")]:
        return False
    if not norm and pre and pre.get("type") == "Metaspace" and pre.get("replacement") == "▁" \
            and not pre.get("split", True) and pre.get("prepend_scheme") in ("always", "never"):
        return pre["prepend_scheme"] == "always"
    raise _refuse(f"the byte-fallback tokenizer's normalizer/pre-tokenizer ({json.dumps(norm)[:200]}, "
                  f"{json.dumps(pre)[:200]}) is not the SentencePiece split llama.cpp reproduces")


def _spm_scores(tokenizer_json: dict, n: int) -> list[float]:
    """SentencePiece-style scores from the merge order: llama.cpp merges the adjacent pair whose
    joined token has the highest score, HF the pair with the lowest merge rank; score = -rank makes
    them the same choice. Tokens no merge makes (characters, bytes, specials) are never a join."""
    vocab = tokenizer_json["model"]["vocab"]
    scores = [-1e9] * n
    for rank, merge in enumerate(tokenizer_json["model"].get("merges", [])):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        i = vocab.get(a + b)
        if i is not None and i < n and scores[i] == -1e9:
            scores[i] = -float(rank)
    return scores


def _token_id(tokenizer_json: dict, token: str | dict | None) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    vocab = tokenizer_json["model"]["vocab"]
    if token in vocab:
        return vocab[token]
    return next((a["id"] for a in tokenizer_json.get("added_tokens", []) if a["content"] == token), None)


def _tokens(tj: dict, vocab_size: int, spm: bool) -> tuple[list[str], list]:
    import re

    import gguf

    T = gguf.TokenType
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [T.UNUSED] * vocab_size
    unk = tj["model"].get("unk_token")
    for text, i in tj["model"]["vocab"].items():
        if i < vocab_size:
            tokens[i] = text
            types[i] = (T.BYTE if spm and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text)
                        else T.UNKNOWN if spm and text == unk else T.NORMAL)
    for added in tj.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            if types[added["id"]] in (T.UNUSED, T.NORMAL):
                types[added["id"]] = T.CONTROL if added.get("special") else T.USER_DEFINED
    return tokens, types


def adds_bos(tokenizer_config: dict) -> bool:
    """Whether llama.cpp adds a BOS when tokenizing (written as tokenizer.ggml.add_bos_token): exactly
    when HF's tokenizer says it does (our byte-level presets add none: bos_token null)."""
    return bool(tokenizer_config.get("add_bos_token", False)) and bool(tokenizer_config.get("bos_token"))


def write_stops(w, tok_dir: Path, source: Path | None) -> dict[str, int]:
    """llama.cpp's end-of-turn (EOT) and end-of-message (EOM) keys from the model's stop set
    (`families.gguf_stop_ids`: the generation config's eos ids, the tokenizer's eos, the chat template's end of
    turn), so llama.cpp ends a generation where HF's `generate` does; returns what was written."""
    from transformers import AutoTokenizer

    from smolforge.models.families.stops import gguf_stop_ids

    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    found = gguf_stop_ids(tokenizer, source if source is not None else tok_dir)
    for key, add in (("eot", w.add_eot_token_id), ("eom", w.add_eom_token_id)):
        if key in found:
            add(found[key])
    return found


def write_tokenizer(w, tok_dir: Path, cfg: dict, vocab_size: int, template: str | None,
                    source: Path | None = None) -> dict:
    """The tokenizer keys; returns {tokenizer, pre_tokenizer, eos/bos/pad/eot/eom ids} for the report.
    `source`: the checkpoint directory whose generation_config.json names the eos ids (default `tok_dir`)."""
    tj = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if tj.get("model", {}).get("type") != "BPE":
        raise _refuse(f"{tok_dir}/tokenizer.json is not a BPE tokenizer")
    tc_path = tok_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    prefix = spm_prefix(tj)
    spm = prefix is not None
    pre = None if spm else pre_tokenizer_name(tj)
    tokens, types = _tokens(tj, vocab_size, spm)
    w.add_tokenizer_model("llama" if spm else "gpt2")
    if spm:
        w.add_add_space_prefix(prefix)
        w.add_token_scores(_spm_scores(tj, vocab_size))
        unk = _token_id(tj, tj["model"].get("unk_token"))
        if unk is not None:
            w.add_unk_token_id(unk)
    else:
        w.add_tokenizer_pre(pre)
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])])
    w.add_token_list(tokens)
    w.add_token_types(types)
    ids = {}
    for key in ("eos", "bos", "pad"):
        ids[key] = _token_id(tj, tc.get(f"{key}_token")) if tc.get(f"{key}_token") else cfg.get(f"{key}_token_id")
    for add, value in ((w.add_eos_token_id, ids["eos"]), (w.add_bos_token_id, ids["bos"]),
                       (w.add_pad_token_id, ids["pad"])):
        if isinstance(value, int):
            add(value)
    stops = write_stops(w, tok_dir, source)
    w.add_add_bos_token(adds_bos(tc))
    if template:
        w.add_chat_template(template)
    return {"tokenizer": "llama" if spm else "gpt2", "pre_tokenizer": pre, "eos_token_id": ids["eos"],
            "bos_token_id": ids["bos"], "pad_token_id": ids["pad"], "eot_token_id": stops.get("eot"),
            "eom_token_id": stops.get("eom")}
