"""Split training over real loopback gRPC (fp32 codec) equals one-process training.

Same seed, same data, same seeded LoRA initial weights: per-step losses and final LoRA weights
(bottom, trunk and top) agree within 1e-5 relative, and the trunk's LoRA really moved.
"""

from __future__ import annotations

import json

import pytest
import torch

from smolforge.config import DataSpec, PeftSpec
from smolforge.data import load_splits
from smolforge.models.loading import load_tokenizer
from smolforge.split import checkpoint as ckpt
from smolforge.split.local import build, canonical, train_local
from smolforge.split.server import ServeConfig, serve
from smolforge.split.trainer import SplitTrainConfig, train_split

TOKEN = "equivalence-token"
SP1, SP2 = 1, 3
STEPS = 6


def rel_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return float((a - b).abs().max()) <= tol * max(1e-3, float(b.abs().max()))


@pytest.fixture(scope="module")
def splits():
    tok = load_tokenizer("tiny-llama")
    return tok, load_splits(DataSpec(path="bundled", max_samples=48, max_length=64, max_eval_samples=8), tok)


def split_cfg(port: int, out, **kw) -> SplitTrainConfig:
    base = dict(model="tiny-llama", split_point_1=SP1, split_point_2=SP2, server_port=port, token=TOKEN,
                lora_rank=4, lora_alpha=8, lora_dropout=0.0, batch_size=4, gradient_accumulation_steps=2,
                learning_rate=5e-3, warmup_steps=2, max_grad_norm=0.5, max_steps=STEPS, output_dir=str(out),
                num_threads=1, quiet=True, seed=3)
    base.update(kw)
    return SplitTrainConfig(**base)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve(ServeConfig(model="tiny-llama", split_point_1=SP1, split_point_2=SP2, lora_rank=4, lora_alpha=8,
                            lora_dropout=0.0, port=0, token=TOKEN, num_threads=1,
                            checkpoint_dir=str(tmp_path_factory.mktemp("server-ckpt"))))
    yield srv
    srv.stop(0)


def test_split_training_equals_local_training(server, splits, tmp_path):
    tok, data = splits
    cfg = split_cfg(server.port, tmp_path / "split")
    result = train_split(cfg, splits=data, tokenizer=tok)
    assert result.steps == STEPS and len(result.losses) == STEPS

    spec = PeftSpec(r=4, alpha=8, dropout=0.0)
    local = build("tiny-llama", spec, seed=3)
    initial = {canonical(n): p.detach().clone() for n, p in local.named_parameters() if "lora_" in n}
    ref = train_local(local, data.train, tok.pad_token_id, steps=STEPS, batch_size=4, grad_accum=2, lr=5e-3,
                      warmup_steps=2, max_grad_norm=0.5, seed=3)

    for s, (a, b) in enumerate(zip(result.losses, ref.losses), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {s}: split loss {a} != local loss {b}"

    # Final weights: the client's bottom/top and the trunk copy the server sent with the last checkpoint.
    path, _ = ckpt.read(tmp_path / "split" / "checkpoints", STEPS)
    split_weights = {**ckpt.load_tensors(path, "client_lora"), **ckpt.load_tensors(path, "trunk_lora")}
    assert set(split_weights) == set(ref.lora)
    for name, value in ref.lora.items():
        assert rel_close(split_weights[name], value), name

    trunk_b = [n for n in split_weights if ".layers.1." in n or ".layers.2." in n]
    assert trunk_b and all(n in ckpt.load_tensors(path, "trunk_lora") for n in trunk_b)
    moved = [n for n in trunk_b if not torch.equal(split_weights[n], initial[n])]
    assert len(moved) == len(trunk_b), "every trunk LoRA weight should have changed"

    # The run's artefacts: a peft adapter covering every layer, and the log of losses.
    adapter = json.loads((tmp_path / "split" / "lora_adapter" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 4
    logged = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged if r["kind"] == "train"] == result.losses


def test_split_equals_smolforge_train_engine(server, splits, tmp_path):
    """The same run through `smolforge.train.engine.train` (the project's local trainer)."""
    from smolforge.config import TrainConfig
    from smolforge.train.engine import TrainHooks, train

    tok, data = splits
    result = train_split(split_cfg(server.port, tmp_path / "split", scheduler="cosine", seed=5,
                                   gradient_accumulation_steps=1), splits=data, tokenizer=tok)
    spec = PeftSpec(r=4, alpha=8, dropout=0.0)
    model = build("tiny-llama", spec, seed=5)
    losses: list[float] = []
    cfg = TrainConfig(model="tiny-llama", data=DataSpec(path="bundled"), peft=spec, output_dir=str(tmp_path / "local"),
                      max_steps=STEPS, batch_size=4, grad_accum=1, lr=5e-3, warmup_steps=2, scheduler="cosine",
                      max_grad_norm=0.5, seed=5, device="cpu", num_threads=1, quiet=True, tensorboard=False,
                      eval_accuracy=False, precision="fp32")
    train(cfg, TrainHooks(on_step=lambda info: losses.append(info.loss)), splits=data, model=model, tokenizer=tok)
    assert len(losses) == STEPS
    for s, (a, b) in enumerate(zip(result.losses, losses), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {s}: split {a} != engine {b}"


@pytest.mark.parametrize("codec,byte_ratio", [("fp16", 0.5), ("bf16", 0.5), ("int8", 0.27)])
def test_lossy_codecs_train_close_to_fp32(server, splits, tmp_path, codec, byte_ratio):
    tok, data = splits
    fp32 = train_split(split_cfg(server.port, tmp_path / "fp32", max_steps=4), splits=data, tokenizer=tok)
    lossy = train_split(split_cfg(server.port, tmp_path / codec, max_steps=4, codec=codec), splits=data, tokenizer=tok)
    assert lossy.codec == codec
    for a, b in zip(lossy.losses, fp32.losses):
        assert abs(a - b) <= 1e-2 * abs(b)
    assert lossy.bytes_per_step / fp32.bytes_per_step == pytest.approx(byte_ratio, abs=0.02)


def test_mixed_precision_runs_close_to_fp32(server, splits, tmp_path):
    tok, data = splits
    fp32 = train_split(split_cfg(server.port, tmp_path / "fp32", max_steps=3), splits=data, tokenizer=tok)
    mixed = train_split(split_cfg(server.port, tmp_path / "bf16", max_steps=3, mixed_precision=True), splits=data,
                        tokenizer=tok)
    for a, b in zip(mixed.losses, fp32.losses):
        assert a == a and abs(a - b) <= 5e-2 * abs(b)
    assert mixed.losses != fp32.losses  # autocast really ran


def no_dropout_copy(name: str, out) -> str:
    """A local checkpoint of preset `name` with dropout off, so a one-process run can match exactly."""
    from smolforge.models.loading import load_model

    model = load_model(name)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(model.config, key):
            setattr(model.config, key, 0.0)
    model.save_pretrained(out)
    load_tokenizer(name).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-qwen2"])
def test_other_families_match_too(preset, tmp_path):
    """GPT-2 (Conv1D LoRA, learned positions) and Qwen2 (rotary, biases), from a local model directory."""
    name = no_dropout_copy(preset, tmp_path / "model")
    tok = load_tokenizer(name)
    data = load_splits(DataSpec(path="bundled", max_samples=16, max_length=48, max_eval_samples=4), tok)
    srv = serve(ServeConfig(model=name, split_point_1=0, split_point_2=2, lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                            port=0, token=TOKEN, num_threads=1, checkpoint_dir=str(tmp_path / "ck")))
    try:
        result = train_split(split_cfg(srv.port, tmp_path / "run", model=name, max_steps=3, split_point_1=0,
                                       split_point_2=2, gradient_accumulation_steps=1), splits=data, tokenizer=tok)
    finally:
        srv.stop(0)
    ref = train_local(build(name, PeftSpec(r=4, alpha=8, dropout=0.0), seed=3), data.train, tok.pad_token_id,
                      steps=3, batch_size=4, lr=5e-3, warmup_steps=2, max_grad_norm=0.5, seed=3, total_steps=3)
    for s, (a, b) in enumerate(zip(result.losses, ref.losses), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{preset} step {s}: split {a} != local {b}"
    path, _ = ckpt.read(tmp_path / "run" / "checkpoints", 3)
    weights = {**ckpt.load_tensors(path, "client_lora"), **ckpt.load_tensors(path, "trunk_lora")}
    assert set(weights) == set(ref.lora)
    for key, value in ref.lora.items():
        assert rel_close(weights[key], value), key
