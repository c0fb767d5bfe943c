"""GGUF and Ollama export for the tokenizer and chat families people run (issue 30).

Small checkpoints are built here (a BPE trained in about a second, a random 2-layer model), one
per tokenizer family llama.cpp tells apart:
- byte-level BPE with GPT-2's regex (pre-tokenizer `gpt-2`), on a Llama with linear rope scaling;
- Llama 3's Split regex with ignore_merges (`llama-bpe`), on a Llama with rope_scaling llama3
  (carried as the `rope_freqs` tensor);
- Qwen2's Split regex and NFC normalizer (`qwen2`), on Qwen2 (q/k/v biases) with YaRN rope;
- SentencePiece-style BPE with byte fallback (tokenizer model `llama`, TinyLlama/Phi-3's kind).
Each is exported through `run.export` (what the CLI calls), loaded by llama.cpp (llama-cpp-python),
its tokenization compared with HF's on varied text (digits, runs of spaces, CJK, emoji, code with
tabs and newlines) and its greedy tokens with HF's at f16 (export's own verification).
Ollama: for the published Zephyr, Llama 3.2, ChatML (Qwen2.5) and Phi-3 templates
(models/chat_templates.py), the Modelfile TEMPLATE rendered by Go's text/template equals the Jinja
rendering of a multi-turn conversation with a system prompt, and without one (Llama 3.2's less its
"Today Date" line: a TEMPLATE carries no date, so the export day is not told to every later chat).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import require
from smolforge.models.export.verify import TOKENIZER_TEXTS as TEXTS  # varied text, also checked by export
from test_export import GO_RENDER, require_llama_cpp

pytestmark = pytest.mark.timeout(600)


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ("the of and to in is you that it was for on are with as his they be at one have this from "
             "what sum reverse code python return print def class self none true false").split()
    lines = []
    for _ in range(600):
        a, b = rng.randint(0, 99999), rng.randint(0, 999)
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))) + f" {a} + {b} = {a + b}.")
        lines.append(f"def f{a}(x):\n\treturn x * {b}\n    # it's done  ")
    return lines + TEXTS[:2] * 3


def _bpe(pre: list, *, normalizer=None, ignore_merges: bool = False, specials: list[str], vocab: int = 600):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer:
        tok.normalizer = normalizers.Sequence(normalizer)
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def _spm_bpe():
    """A SentencePiece-style BPE as HF stores TinyLlama's: <unk> <s> </s>, 256 byte tokens, merges
    within '▁'-words, legacy normalizer Prepend('▁') + Replace(' ', '▁'), no pre-tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=500, show_progress=False))
    trained = json.loads(tok.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for text, _ in sorted(trained["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(text, len(vocab))
    spec = lambda i, t: {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,  # noqa: E731
                         "normalized": False, "special": True}
    trained.update(
        added_tokens=[spec(0, "<unk>"), spec(1, "<s>"), spec(2, "</s>")], pre_tokenizer=None, post_processor=None,
        normalizer={"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        decoder={"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})
    trained["model"].update(vocab=vocab, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    return Tokenizer.from_str(json.dumps(trained))


def _checkpoint(out: Path, tok, config, template: str, **tokens) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)
    fast.chat_template = template
    fast.save_pretrained(out)
    config.vocab_size = len(fast)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def _small(cls, **kw):
    return cls(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, **kw)


def build(kind: str, out: Path) -> Path:
    """The checkpoint of one tokenizer family (see the module docstring)."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers import LlamaConfig, Qwen2Config

    from smolforge.models.chat_templates import TEMPLATES
    from smolforge.models.export.gguf_vocab import LLAMA3_REGEX, QWEN2_REGEX
    from smolforge.models.tiny import CHAT_TEMPLATE

    split = lambda rx: pre_tokenizers.Split(pattern=Regex(rx), behavior="isolated")  # noqa: E731
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if kind == "gpt-2":
        tok = _bpe([pre_tokenizers.ByteLevel(add_prefix_space=False)], specials=["<|im_start|>", "<|im_end|>"])
        linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        return _checkpoint(out, tok, _small(LlamaConfig, rope_parameters=linear), CHAT_TEMPLATE, eos_token="<|im_end|>")
    if kind == "llama-bpe":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        tok = _bpe([split(LLAMA3_REGEX), byte_level], ignore_merges=True, specials=specials)
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return _checkpoint(out, tok, _small(LlamaConfig, rope_parameters=rope), TEMPLATES["llama-3.2"],
                           bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    if kind == "qwen2":
        tok = _bpe([split(QWEN2_REGEX), byte_level], normalizer=[normalizers.NFC()],
                   specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        yarn = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 128}
        return _checkpoint(out, tok, _small(Qwen2Config, rope_parameters=yarn), TEMPLATES["qwen2.5"],
                           eos_token="<|im_end|>")
    assert kind == "spm"
    return _checkpoint(out, _spm_bpe(), _small(LlamaConfig), TEMPLATES["tinyllama-chat"], bos_token="<s>",
                       eos_token="</s>", unk_token="<unk>")


KINDS = ["gpt-2", "llama-bpe", "qwen2", "spm"]


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_tokenizes_and_generates_like_hf_in_llama_cpp(kind, tmp_path):
    require_llama_cpp()
    import gguf
    from transformers import AutoTokenizer

    from smolforge.models.export.run import export
    from smolforge.models.export.verify import load_llama, same_tokens

    ckpt = build(kind, tmp_path / "ckpt")
    summary = export(str(ckpt), "gguf", tmp_path / "gguf", quant="f16", threads=1)
    got = summary["gguf"]
    assert (got["tokenizer"], got["pre_tokenizer"]) == (("llama", None) if kind == "spm" else ("gpt2", kind)), got
    v = summary["verify"]
    assert v["ok"] and v["tokenization_equal"] and v["logits_nmse"] <= 1e-4, v
    # a random model has near-ties (HF's own top two closer than f16 rounding): those count as agreeing
    assert v["greedy_agreement_with_ties"] == 1.0 and v["greedy_agreement"] >= 0.95, v
    reader = gguf.GGUFReader(str(tmp_path / "gguf" / "model.gguf"))
    assert ("rope_freqs.weight" in [t.name for t in reader.tensors]) == (kind == "llama-bpe")
    # The GGUF carries the Jinja template as it is (no date rendered into it): llama.cpp renders Llama 3.2's
    # "Today Date" with its own strftime_now when the chat happens (minja's chat_template_inputs.now).
    field = reader.fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode("utf-8") == AutoTokenizer.from_pretrained(str(ckpt)).chat_template
    hf = AutoTokenizer.from_pretrained(str(ckpt))
    llm = load_llama(tmp_path / "gguf" / "model.gguf", threads=1)
    for text in TEXTS:  # export's verification checked these too; here each one names itself when it fails
        assert same_tokens(llm, hf, text), (kind, text)
        assert hf.decode(hf(text, add_special_tokens=False)["input_ids"]) == text  # nothing lost to <unk>


def test_unknown_pre_tokenizer_and_rope_are_refused_with_one_message():
    from smolforge.errors import SmolforgeError
    from smolforge.models.export.gguf import _rope_scaling
    from smolforge.models.export.gguf_vocab import LLAMA3_REGEX, QWEN2_REGEX, pre_tokenizer_name

    odd = {"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Whitespace"}}
    with pytest.raises(SmolforgeError, match="no known llama.cpp equivalent") as err:
        pre_tokenizer_name(odd)
    assert "convert_hf_to_gguf.py" in err.value.fix
    split = lambda rx: {"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [  # noqa: E731
        {"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}}
    assert pre_tokenizer_name(split(LLAMA3_REGEX)) == "smaug-bpe"  # test_llama3_regex_without_ignore_merges_...
    qwen2_ignoring = split(QWEN2_REGEX)
    qwen2_ignoring["model"]["ignore_merges"] = True
    with pytest.raises(SmolforgeError, match="ignore_merges"):  # llama.cpp's qwen2 applies the merges
        pre_tokenizer_name(qwen2_ignoring)
    with pytest.raises(SmolforgeError, match="rope scaling 'dynamic'"):
        _rope_scaling(None, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "LLAMA")
    with pytest.raises(SmolforgeError, match="rope scaling 'llama3'"):
        _rope_scaling(None, {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "QWEN2")


# Words the Llama 3.2 twin's vocabulary holds whole (its tokenizer is trained on a corpus with them)
WHOLE_WORDS = ["Ġreturn", "Ġprint", "Ġletters", "Ġquestion", "Ġcharacter", "Ġreverse"]
IGNORE_MERGES_TEXTS = [
    "Please print the letters of each question, character by character, then return.",
    " reverse return print\n letters question character",
]


def test_llama3_regex_without_ignore_merges_exports_as_smaug_bpe_and_tokenizes_like_hf(tmp_path):
    """A Llama-3-regex tokenizer whose `ignore_merges` is false (some Llama 3 fine-tunes ship it) exports
    under llama.cpp's `smaug-bpe` (the Llama 3 regex, merges applied) and llama.cpp tokenizes like HF.

    The Llama 3.2 twin's tokenizer with the flag flipped; so that the flag decides something, the merges
    that build a few whole-word tokens are dropped (the tokens stay: a word is in the vocabulary but the
    merges do not reach it, as in tiktoken-converted vocabularies): HF then splits those words, and a
    llama.cpp pre-tokenizer that ignores merges (`llama-bpe`) would take them whole."""
    require_llama_cpp()
    from transformers import AutoTokenizer

    from smolforge.models.export.run import export
    from smolforge.models.export.verify import TOKENIZER_TEXTS, load_llama, same_tokens
    from smolforge.models.twins import twin_dir

    ckpt = Path(shutil.copytree(twin_dir("twin:llama-3.2-1b-instruct"), tmp_path / "ckpt"))
    tj = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    assert tj["model"]["ignore_merges"] is True and all(w in tj["model"]["vocab"] for w in WHOLE_WORDS)
    tj["model"]["merges"] = [m for m in tj["model"]["merges"] if "".join(m) not in WHOLE_WORDS]
    (ckpt / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    ignoring = AutoTokenizer.from_pretrained(str(ckpt))
    tj["model"]["ignore_merges"] = False
    (ckpt / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    hf = AutoTokenizer.from_pretrained(str(ckpt))
    for text in IGNORE_MERGES_TEXTS:  # the flag decides these texts' tokens
        assert hf(text)["input_ids"] != ignoring(text)["input_ids"], text

    summary = export(str(ckpt), "gguf", tmp_path / "gguf", quant="f16", threads=1, verify=False)
    assert (summary["gguf"]["tokenizer"], summary["gguf"]["pre_tokenizer"]) == ("gpt2", "smaug-bpe"), summary["gguf"]
    llm = load_llama(tmp_path / "gguf" / "model.gguf", threads=1)
    for text in IGNORE_MERGES_TEXTS + TOKENIZER_TEXTS:
        assert same_tokens(llm, hf, text), text


CONVERSATION = [
    {"role": "system", "content": "You are a pirate.\nAnswer in one line."},
    {"role": "user", "content": "Hi there, who are you?"},
    {"role": "assistant", "content": "Arr, a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?\nThanks"},
    {"role": "assistant", "content": "5, matey."},
    {"role": "user", "content": "And \"4 + 4\" <please>?"},
]
# Llama 3 (8B) Instruct's template, as github.com/ggerganov/llama.cpp tests/test-chat-template.cpp
# (commit c392e5094dea) holds it under the name "Llama-3".
LLAMA3 = (
    '{% set loop_messages = messages %}'
    '{% for message in loop_messages %}'
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    '{% if loop.index0 == 0 %}'
    '{% set content = bos_token + content %}'
    '{% endif %}'
    '{{ content }}{% endfor %}'
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)
PUBLISHED = {  # chat_templates key (or a template) -> (format smolforge recognises, BOS text, EOS text)
    "tinyllama-chat": ("zephyr", "<s>", "</s>"),  # TinyLlama's llama.cpp adds the BOS; its template has none
    "llama-3.2": ("llama3.2", "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": ("chatml", "", "<|im_end|>"),
    "smollm2": ("chatml", "", "<|im_end|>"),
    "phi-3": ("phi3", "<s>", "<|endoftext|>"),
    LLAMA3: ("llama3", "<|begin_of_text|>", "<|eot_id|>"),
}


@pytest.fixture(scope="module")
def go_render(tmp_path_factory):
    """render(TEMPLATE text, messages) -> what Go's text/template writes for them (built once per module)."""
    go = shutil.which("go")
    require(go is not None, "go (Go's text/template renders the Modelfile's TEMPLATE)",
            "apt-get install golang-go (.ci/run does it as root)")
    root = tmp_path_factory.mktemp("go")
    env = {**os.environ, "GOCACHE": str(root / "gocache"), "GOPATH": str(root / "gopath"), "GO111MODULE": "off"}
    (root / "render.go").write_text(GO_RENDER)
    build = subprocess.run([go, "build", "-o", str(root / "render"), str(root / "render.go")],
                           capture_output=True, text=True, timeout=240, env=env)
    assert build.returncode == 0, build.stderr

    def render(template: str, messages: list[dict]) -> str:
        (root / "template.txt").write_text(template)
        (root / "messages.json").write_text(json.dumps(messages))
        proc = subprocess.run([str(root / "render"), str(root / "template.txt"), str(root / "messages.json")],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    return render


def _template_of(modelfile_text: str) -> str:
    start = modelfile_text.index('TEMPLATE """') + len('TEMPLATE """')
    return modelfile_text[start: modelfile_text.index('"""', start)]


def _undated(rendered: str, day: str) -> str:
    """A Llama 3.2 rendering less its "Today Date" line: what Ollama's library template for llama3.2 writes."""
    assert f"Today Date: {day}\n" in rendered
    return rendered.replace(f"Today Date: {day}\n", "", 1)


def test_modelfile_templates_render_like_the_published_chat_templates(go_render):
    from smolforge.models.chat_templates import TEMPLATES
    from smolforge.models.export.ollama import modelfile, render_jinja, template_vars

    want = {}
    for key, (fmt, bos, eos) in PUBLISHED.items():
        # llama.cpp adds the BOS (add_bos_token) for TinyLlama and, here, for Phi-3: the TEMPLATE leaves it out
        adds = key in ("tinyllama-chat", "phi-3")
        tokens, template = template_vars(bos, eos, "26 Nov 2026", adds_bos=adds), TEMPLATES.get(key, key)
        key = fmt if template == key else key
        text, chosen = modelfile(template, tokens)
        assert chosen["chat_format"] == fmt, (key, chosen)
        for case, msgs in (("system", CONVERSATION), ("bare", CONVERSATION[1:])):
            jinja = render_jinja(template, msgs, tokens)
            want[f"{key}-{case}"] = jinja.removeprefix(bos) if adds else jinja
            # no date in a TEMPLATE (test_the_ollama_template_does_not_depend_on_the_export_day)
            expected = _undated(want[f"{key}-{case}"], "26 Nov 2026") if fmt == "llama3.2" else want[f"{key}-{case}"]
            assert go_render(_template_of(text), msgs) == expected, f"{key}-{case}"
    assert "You are Qwen" in want["qwen2.5-bare"] and "named SmolLM" in want["smollm2-bare"]
    assert "26 Nov 2026" in want["llama-3.2-system"]
    assert want["llama-3.2-bare"].startswith("<|begin_of_text|>") and not want["phi-3-bare"].startswith("<s>")


def test_the_ollama_template_does_not_depend_on_the_export_day(go_render, tmp_path, monkeypatch):
    """Llama 3.2's template dates its system header ("Today Date: " + strftime_now at use). Exported on
    two days (the clock faked, and the date given), the Modelfile is the same, and its TEMPLATE, rendered
    by Go's text/template, prints no date: Jinja's rendering less the "Today Date" line, as Ollama's own
    library template for llama3.2 writes it ("Cutting Knowledge Date: December 2023", then the system
    prompt). The GGUF carries the Jinja template itself, which llama.cpp renders with its own
    strftime_now at use (test_gguf_tokenizes_and_generates_like_hf_in_llama_cpp[llama-bpe] checks it
    is carried unchanged)."""
    import time

    from smolforge.models.chat_templates import TEMPLATES
    from smolforge.models.export.ollama import modelfile, render_jinja, template_vars, tokens_of

    template, days = TEMPLATES["llama-3.2"], ("26 Nov 2026", "03 Mar 2031")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True}))
    exported = []
    for day in days:
        monkeypatch.setattr(time, "strftime", lambda fmt, *when, day=day: day)  # the export's day, as it reads it
        exported.append(modelfile(template, tokens_of(tmp_path))[0])
    given = [modelfile(template, template_vars("<|begin_of_text|>", "<|eot_id|>", day, adds_bos=True))[0]
             for day in days]
    assert exported[0] == exported[1] == given[0] == given[1]
    assert not any(day in exported[0] for day in days) and "Today Date" not in exported[0]
    for msgs in (CONVERSATION, CONVERSATION[1:]):
        jinja = [render_jinja(template, msgs, template_vars("<|begin_of_text|>", "<|eot_id|>", day)) for day in days]
        assert jinja[0] != jinja[1]  # the Jinja template itself does print the day
        rendered = go_render(_template_of(exported[0]), msgs)
        assert rendered == _undated(jinja[0], days[0]).removeprefix("<|begin_of_text|>")
        assert rendered.startswith("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                                   "December 2023\n\n")


def test_a_template_no_format_reproduces_is_refused():
    from smolforge.errors import SmolforgeError
    from smolforge.models.chat_templates import TEMPLATES
    from smolforge.models.export.ollama import chat_format, template_vars

    with pytest.raises(SmolforgeError, match="does not render a conversation with a system prompt"):
        chat_format(TEMPLATES["gemma-2"], template_vars("<bos>", "<eos>"))  # Gemma 2 refuses system turns
    with pytest.raises(SmolforgeError, match="matches none of the formats"):
        chat_format("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
