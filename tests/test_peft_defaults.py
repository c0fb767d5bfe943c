"""Per-method default learning rates and prompt tuning's initialisation.

The headline check: prompt tuning at its default lr, 30 steps, ends below the base's held-out eval
loss. tiny-llama is random, so the base is tiny-llama briefly fully fine-tuned on the bundled prompts
and answers as plain text (it knows the words, not the chat format), saved in a tmp dir: prompt
tuning then has something real to learn, as on a pretrained model (bench/peft_default_lr.py, the same
set-up, measures every method).
"""

from __future__ import annotations

import json

import pytest
import torch

from smolforge.config import DEFAULT_LR, DataSpec, PeftSpec, TrainConfig, validate
from smolforge.distill.settings import DistillSettings
from smolforge.distill.student import StudentConfig
from smolforge.errors import SmolforgeError
from smolforge.models import peft_methods as pm
from smolforge.models.loading import load_model, load_tokenizer

DATA = {"path": "bundled", "max_samples": 256, "max_eval_samples": 16}


def test_lr_defaults_per_method_and_explicit_lr_wins():
    for method, lr in DEFAULT_LR.items():
        cfg = validate(TrainConfig, {"model": "m", "data": {"path": "bundled"}, "peft": {"method": method}})
        assert cfg.lr == lr
        assert StudentConfig(base_model="m", output_dir="o", peft=PeftSpec(method=method)).lr == lr
        assert DistillSettings(teacher="t", students="s", data="bundled", peft=method).lr == lr
    assert min(DEFAULT_LR["prompt"], DEFAULT_LR["prefix"]) >= 5 * DEFAULT_LR["lora"] > 5 * DEFAULT_LR["none"]
    assert validate(TrainConfig, {"model": "m", "data": {"path": "bundled"}, "lr": 1e-5}).lr == 1e-5
    assert StudentConfig(base_model="m", output_dir="o", lr=1e-5).lr == 1e-5


def test_prompt_tuning_init_keys_as_the_seeds_write_them():
    spec = pm.peft_spec_from_cli("prompt", json.dumps({"num_virtual_tokens": 4, "prompt_tuning_init": "text",
                                                       "prompt_tuning_init_text": "Answer the question:"}))
    assert (spec.prompt_tuning_init, spec.prompt_tuning_init_text) == ("TEXT", "Answer the question:")
    assert PeftSpec(method="prompt").prompt_tuning_init == "SAMPLE_VOCAB"
    with pytest.raises(SmolforgeError, match="prompt_tuning_init_text"):
        pm.peft_spec_from_cli("prompt", '{"prompt_tuning_init": "TEXT"}')
    with pytest.raises(SmolforgeError, match="prompt_tuning_init"):
        pm.peft_spec_from_cli("prompt", '{"prompt_tuning_init": "ZEROS"}')


def test_virtual_tokens_start_as_real_token_embeddings():
    """SAMPLE_VOCAB: every virtual token is some vocabulary entry; TEXT: the text's tokens, in order."""
    torch.manual_seed(0)
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="prompt", num_virtual_tokens=6))
    vocab = model.get_input_embeddings().weight
    virtual = model.prompt_encoder["default"].embedding.weight
    assert all(bool((vocab == row).all(dim=1).any()) for row in virtual)

    text = "Answer the question:"
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="prompt", num_virtual_tokens=3,
                                                             prompt_tuning_init="TEXT", prompt_tuning_init_text=text))
    ids = load_tokenizer("tiny-llama")(text)["input_ids"][:3]
    assert torch.equal(model.prompt_encoder["default"].embedding.weight,
                       model.get_input_embeddings().weight[ids])


@pytest.fixture(scope="module")
def pretrained_base(tmp_path_factory):
    """(base model dir, its held-out eval loss on the bundled chat task)."""
    from smolforge.data.splits import load_splits
    from smolforge.data.synthetic import bundled_paths
    from smolforge.train.engine import build_model, evaluate, train

    root = tmp_path_factory.mktemp("peft-defaults")
    train_path, _ = bundled_paths()
    with open(train_path, encoding="utf-8") as src, open(root / "corpus.jsonl", "w", encoding="utf-8") as out:
        for line in list(src)[:512]:
            rec = json.loads(line)
            out.write(json.dumps({"text": f"{rec['prompt']} {rec['completion']}"}) + "\n")
    pre = TrainConfig(model="tiny-llama", data=DataSpec(path=str(root / "corpus.jsonl"), format="text",
                                                        max_eval_samples=4),
                      peft=PeftSpec(method="none"), lr=1e-3, max_steps=40, batch_size=8, num_threads=1, device="cpu",
                      eval_accuracy=False, quiet=True, tensorboard=False, output_dir=str(root / "base"))
    base = train(pre).adapter_dir
    cfg = TrainConfig(model=base, data=DataSpec(**DATA), peft=PeftSpec(method="none"), device="cpu",
                      eval_accuracy=False)
    tok = load_tokenizer(base)
    _, model = build_model(cfg, torch.device("cpu"), tok)
    loss = evaluate(model, tok, load_splits(cfg.data, tok), cfg, torch.device("cpu"), accuracy=False)["eval_loss"]
    return base, loss, root


def test_prompt_tuning_at_its_default_lr_ends_below_the_base(pretrained_base):
    from smolforge.train.engine import train

    base, base_loss, root = pretrained_base
    cfg = validate(TrainConfig, {"model": base, "data": DATA, "peft": {"method": "prompt"}, "max_steps": 30,
                                 "batch_size": 8, "num_threads": 1, "device": "cpu", "eval_accuracy": False,
                                 "quiet": True, "tensorboard": False, "output_dir": str(root / "prompt")})
    assert cfg.lr == DEFAULT_LR["prompt"]  # no lr given: the method's default
    res = train(cfg)
    print(f"base eval loss {base_loss:.4f}; prompt tuning 30 steps at lr {cfg.lr:g}: {res.eval['eval_loss']:.4f}")
    assert res.eval["eval_loss"] < base_loss - 0.2
