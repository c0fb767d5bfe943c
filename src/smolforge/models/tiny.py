"""Offline tiny presets: small decoder models built from config with a locally trained tokenizer.

Tests and the demo must not download anything, yet they should exercise the same loader that
hub models use. So a preset is written once as an ordinary HF directory (config, safetensors,
tokenizer files, chat template) under `$SMOLFORGE_HOME/presets/<name>` and then loaded through
`from_pretrained` like any local checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


from smolforge.paths import home

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_VOCAB = 1024

# name -> (family, config kwargs). Sizes are chosen so a CPU step takes milliseconds.
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny-gpt2": ("gpt2", dict(n_embd=128, n_layer=4, n_head=4, n_positions=512)),
    "tiny-llama": (
        "llama",
        dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.1),
    ),
    "tiny-qwen2": (
        "qwen2",
        dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.1),
    ),
    # A larger tiny model: the demo's teacher and the one students learn from.
    "small-llama": (
        "llama",
        dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.1),
    ),
    # ~100M parameters, for benchmarks only (vocab padded to a realistic 32k).
    "llama-100m": (
        "llama",
        dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=12, max_position_embeddings=1024, tie_word_embeddings=True,
             vocab_size=32000),
    ),
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def _tokenizer_corpus() -> list[str]:
    """Text that covers what the bundled tasks and chat turns contain; bytes cover the rest."""
    rng = random.Random(0)
    words = (
        "the of and to in is you that it he was for on are as with his they at be this have from "
        "or one had by word but not what all were we when your can said there use an each which "
        "she do how their if will up other about out many then them these so some her would make "
        "like him into time has look two more write go see number no way could people my than "
        "first water been call who oil its now find long down day did get come made may part "
        "add sum reverse uppercase lowercase sort letters word answer question what is plus minus "
        "times count vowels first last character string code python def return print list len "
        "user assistant system instruction input output response prompt completion text"
    ).split()
    lines = []
    for _ in range(4000):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"What is {a} + {b}? {a + b}. {a} - {b} = {a - b}.")
        s = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        lines.append(f"Reverse {s}: {s[::-1]}. Uppercase {s}: {s.upper()}.")
    return lines


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE (digits split singly, as in Llama 3) with our chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "right"
    return fast


def build_preset(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write preset `name` as an HF directory at out_dir (deterministic for a given seed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    family, kwargs = PRESETS[name]
    tokenizer = train_tokenizer()
    kwargs = dict(kwargs)
    vocab = max(kwargs.pop("vocab_size", 0), len(tokenizer))
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|pad|>")
    config = AutoConfig.for_model(family, vocab_size=vocab, eos_token_id=eos, pad_token_id=pad, bos_token_id=eos, **kwargs)
    # Its own RNG stream: a preset built on first use inside `train` must not reset the caller's
    # seeded RNG (the first run of a preset gave other LoRA weights than every later run).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = pad
    model.generation_config.eos_token_id = eos
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _complete(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "tokenizer.json").exists() and any(path.glob("*.safetensors"))


def atomic_build(final: Path, build: Callable[[Path], object], complete: Callable[[Path], bool], what: str) -> Path:
    """`final`, built by `build(tmp_dir)` on first use. Safe when several processes race to build it:
    each builds in its own temporary sibling and renames it into place; a loser keeps the winner's copy."""
    if complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        build(tmp)
        if not complete(tmp):
            # transformers 5 writes weights on rank 0 only once torch.distributed is initialised.
            raise RuntimeError(f"building {what} wrote no weights; build it before "
                               "init_process_group (or on rank 0)")
        if final.exists() and not complete(final):
            shutil.rmtree(final, ignore_errors=True)  # a broken earlier build
        try:
            os.rename(tmp, final)
        except OSError:
            if not complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def preset_dir(name: str) -> Path:
    """The preset's directory, built on first use. Safe when several processes race to build it."""
    return atomic_build(home() / "presets" / name, lambda tmp: build_preset(name, tmp), _complete, f"preset {name}")
