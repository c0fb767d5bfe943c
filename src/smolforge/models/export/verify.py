"""Check a GGUF against the model it came from, in llama.cpp itself (llama-cpp-python).

Three checks on a few chat prompts, against the HF model with its adapters applied by peft
(unmerged: an independent path from our merge, so a merge bug shows up here too):
- tokenization: llama.cpp's token ids for each prompt, and for TOKENIZER_TEXTS (digits, spaces,
  CJK, emoji, code), equal the HF tokenizer's (a wrong pre-tokenizer or merge list shows up here);
- logits: normalised MSE over the prompt positions, each row centred first (logits are defined up
  to a constant per row): sum ||a - b||^2 / sum ||b||^2;
- greedy tokens: HF continues each prompt greedily for `new_tokens` tokens; agreement is the share
  of those positions where llama.cpp's argmax, given the same prefix, is the same token (teacher
  forced: one near-tie does not turn every later token of a free-running continuation into a miss;
  the logits above cover the continuation too). A barely trained tiny model has near-ties: a pick
  that differs where HF's own top two logits are closer than the position's logit error (TIE_RMS)
  is reported as a near-tie and counted as agreeing; the exact agreement is reported beside it.
The export fails when any is off by more than its quantisation allows (LIMITS).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from smolforge.errors import SmolforgeError

# quant -> (max logits NMSE, min greedy agreement)
# A differing pick counts as a near-tie when HF's logit gap between its pick and llama.cpp's is within
# TIE_RMS x that position's RMS logit error (llama.cpp vs HF): rounding the weights to the format
# moves logits by about that much, so HF's own choice there is a coin toss.
TIE_RMS = 3.0
LIMITS = {"f16": (1e-4, 1.0), "bf16": (1e-3, 0.9), "q8_0": (1e-2, 0.9), "f32": (1e-5, 1.0)}

QUESTIONS = [
    "What is 12 + 30?", "Reverse hello.", "Uppercase word.", "What is 7 - 9?", "Count vowels in banana.",
    "Sort the letters of code.", "What is 100 + 250?", "Write a word that starts with s.",
    "What is the first character of python?", "Lowercase WATER.", "What is 3 + 4?", "Reverse abc.",
    "What is 999 - 1?", "Say the number after 41.", "Uppercase answer.", "What is 5 + 5 + 5?",
]


# Text no chat prompt above exercises: digits, runs of spaces, CJK, emoji, code with tabs and
# newlines, CRLF. A pre-tokenizer that splits these differently from HF's (e.g. Qwen2's regex
# written as GPT-2's) passes on the chat prompts and fails here.
TOKENIZER_TEXTS = [
    "What is 12345 + 678?  Twelve   spaces ->            <- here 3.14159 1,000,000",
    "日本語のテキストと中文字符，混在する text 🙂🚀 emoji 👩‍💻",
    "def f(x):\n\tif x > 10:\n\t\treturn x ** 2\n    return None\n\n\n",
    "Ünïcödé naïve café — “quotes” … it's we'll THEY'RE don't",
    "   leading and trailing   \r\nCRLF\ttab  ",
]


def sentencepiece_style(llm) -> bool:
    """Whether the GGUF's vocabulary is SentencePiece-style (`tokenizer.ggml.model` llama)."""
    return (getattr(llm, "metadata", None) or {}).get("tokenizer.ggml.model") == "llama"


def tokenizer_texts(llm) -> list[str]:
    """The texts whose tokens must be equal. For a SentencePiece-style vocabulary, TOKENIZER_TEXTS
    less those starting with whitespace, and not the chat prompts (`compare`): llama.cpp follows
    SentencePiece, which such models were trained with, and puts a "▁" before every run of text, at
    the start and after each special token; transformers 5's LlamaTokenizer (Metaspace,
    prepend_scheme "first", legacy=False) puts one only at the start, and none when the text already
    starts with a space ("   x": 3 vs 4 "▁"; "</s>\n<|assistant|>": "\n" vs "▁\n"). Neither is a
    fault of the GGUF, and no GGUF key makes llama.cpp do the other; plain text still compares every
    token, and the logits and greedy checks below run on HF's own token ids."""
    if sentencepiece_style(llm):
        return [t for t in TOKENIZER_TEXTS if not t[:1].isspace()]
    return TOKENIZER_TEXTS


def same_tokens(llm, tokenizer, text: str) -> bool:
    """llama.cpp's token ids for `text` equal the HF tokenizer's (special tokens parsed by both)."""
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)) == list(want)


@dataclass
class VerifyReport:
    prompts: int
    new_tokens: int
    tokenization_equal: bool
    logits_nmse: float
    greedy_agreement: float  # exact: llama.cpp's pick is HF's
    near_ties: int  # picks that differ where HF's top two logits are closer than the format's error
    greedy_agreement_with_ties: float  # what the limit applies to
    max_nmse: float
    min_agreement: float
    ok: bool
    # KL(HF fp32's exact next-token distribution || llama.cpp's), nats per position, mean over every position
    # of the prompts and their greedy continuations: what the format's rounding costs a teacher's logits
    kl_vs_fp32: float = 0.0
    kl_positions: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return (f"llama.cpp vs HF on {self.prompts} prompts: logits NMSE {self.logits_nmse:.2e} (limit "
                f"{self.max_nmse:.0e}), greedy agreement {self.greedy_agreement:.1%}"
                f"{f' ({self.greedy_agreement_with_ties:.1%} counting {self.near_ties} near-tie(s))' if self.near_ties else ''}"
                f" (limit {self.min_agreement:.0%}), KL to HF fp32 {self.kl_vs_fp32:.2e} nats/token over "
                f"{self.kl_positions} positions, tokenization {'equal' if self.tokenization_equal else 'DIFFERENT'}")


def prompts(tokenizer, count: int = 16) -> list[str]:
    """Chat prompts as the model sees them (the chat template with the generation prompt)."""
    out = []
    for q in (QUESTIONS * ((count + len(QUESTIONS) - 1) // len(QUESTIONS)))[:count]:
        msgs = [{"role": "user", "content": q}]
        if getattr(tokenizer, "chat_template", None):
            out.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        else:
            out.append(q)
    return out


def load_llama(gguf_path: Path, n_ctx: int = 256, threads: int | None = None):
    try:
        from llama_cpp import Llama
    except ImportError as err:
        raise SmolforgeError("verifying a GGUF needs llama-cpp-python, which is not installed",
                             fix="pip install 'smolforge[export]' (it builds llama.cpp, minutes), or pass --no-verify"
                             ) from err
    import os

    return Llama(model_path=str(gguf_path), n_ctx=n_ctx, logits_all=True, verbose=False, n_gpu_layers=0,
                 n_threads=threads or max(1, min(4, os.cpu_count() or 1)), n_batch=n_ctx)


def _centred(x):
    return x - x.mean(axis=-1, keepdims=True)


def compare(llm, model, tokenizer, texts: list[str], quant: str, new_tokens: int = 8) -> VerifyReport:
    """Run the checks; `model` is the HF model in eval mode (fp32, CPU)."""
    import numpy as np
    import torch

    max_nmse, min_agree = LIMITS[quant]
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else None
    tok_equal = all(same_tokens(llm, tokenizer, text) for text in tokenizer_texts(llm))
    err, ref, same, ties, total, kl, positions = 0.0, 0.0, 0, 0, 0, 0.0, 0
    for text in texts:
        hf_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        tok_equal &= sentencepiece_style(llm) or same_tokens(llm, tokenizer, text)  # see tokenizer_texts
        with torch.no_grad():
            seq = list(hf_ids)
            for _ in range(new_tokens):  # plain argmax, end tokens included
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            hf_logits = model(torch.tensor([seq])).logits[0].float().numpy()
        llm.reset()
        llm.eval(seq)
        n = vocab or hf_logits.shape[-1]
        cpp_logits = np.asarray(llm.scores[: len(seq)], dtype=np.float32)[:, :n]
        a, b = _centred(cpp_logits), _centred(hf_logits[:, :n])
        err += float(((a - b) ** 2).sum())
        ref += float((b ** 2).sum())
        kl += _kl_sum(hf_logits[:, :n], cpp_logits)
        positions += len(seq)
        # llama.cpp's greedy choice at each generated position, on the same prefix as HF's
        rows = slice(len(hf_ids) - 1, len(seq) - 1)
        picks = cpp_logits[rows].argmax(axis=-1)
        for pick, want, hf_row, row_err in zip(picks, seq[len(hf_ids):], hf_logits[rows, :n], (a - b)[rows]):
            if pick == want:
                same += 1
            elif hf_row[want] - hf_row[pick] <= TIE_RMS * float(np.sqrt((row_err ** 2).mean())):
                ties += 1  # HF's own top two are closer than the format's rounding: either is the greedy pick
        total += new_tokens
    nmse = err / max(ref, 1e-30)
    agree = same / max(total, 1)
    with_ties = (same + ties) / max(total, 1)
    return VerifyReport(len(texts), new_tokens, tok_equal, nmse, agree, ties, with_ties, max_nmse, min_agree,
                        ok=tok_equal and nmse <= max_nmse and with_ties >= min_agree,
                        kl_vs_fp32=kl / max(positions, 1), kl_positions=positions)


def _kl_sum(p_logits, q_logits) -> float:
    """Sum over rows of KL(softmax(p) || softmax(q)), in float64 (a quantization's KL is ~1e-4 nats:
    float32's log-softmax rounding is of that order over 150k ids)."""
    import numpy as np

    def log_softmax(x):
        x = np.asarray(x, dtype=np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum())


def verify_gguf(gguf_path: Path, model, tokenizer, quant: str, count: int = 16, new_tokens: int = 8,
                threads: int | None = None) -> VerifyReport:
    llm = load_llama(gguf_path, threads=threads)
    try:
        return compare(llm, model, tokenizer, prompts(tokenizer, count), quant, new_tokens)
    finally:
        if hasattr(llm, "close"):
            llm.close()
