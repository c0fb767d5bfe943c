"""PEFT methods: apply, train, save, reload identical, merge, CLI parsing, gradient checkpointing.

Everything runs on the offline tiny presets (real transformers models, real HF peft, real files).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from smolforge.config import PeftSpec
from smolforge.errors import SmolforgeError
from smolforge.models import houlsby
from smolforge.models import peft_methods as pm
from smolforge.models.loading import load_model, load_tokenizer

# lr per method: big enough that 3 steps visibly move the few parameters of prompt/ia3,
# small enough that full fine-tuning does not overshoot on one batch.
LR = {"lora": 5e-3, "prefix": 1e-2, "prompt": 1e-2, "ia3": 1e-2, "adapter": 5e-3, "none": 1e-3}
CASES = [(m, meth) for m in ("tiny-llama", "tiny-gpt2") for meth in pm.METHODS] + [("tiny-qwen2", "lora")]


def _batch(seed: int = 0, batch: int = 4, seq: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _no_dropout(model):
    """GPT-2 has dropout in its config; zero it so train-mode comparisons are exact."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


@torch.no_grad()
def _logits(model, batch) -> torch.Tensor:
    model.eval()
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@torch.no_grad()
def _loss(model, batch) -> float:
    model.eval()
    return model(**batch).loss.item()


def _train(model, batch, lr: float, steps: int = 3) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("model_name,method", CASES, ids=[f"{m}-{meth}" for m, meth in CASES])
def test_train_save_reload_identical(model_name, method, tmp_path):
    torch.manual_seed(0)
    base_params = {n: p.detach().clone() for n, p in load_model(model_name).named_parameters()}
    model = pm.apply_peft(load_model(model_name), PeftSpec(method=method))
    assert pm.model_method(model) == method

    trainable, total = pm.trainable_summary(model)
    if method == "none":
        assert trainable == total
    else:
        assert 0 < trainable < 0.10 * total, pm.trainable_message(model)

    batch = _batch()
    before_loss = _loss(model, batch)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(model, batch, LR[method])
    after_loss = _loss(model, batch)
    assert after_loss < before_loss, (before_loss, after_loss)

    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "no trainable parameter moved"
    if method != "none":
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        assert frozen
        for n, p in frozen:
            assert torch.equal(p, before[n]), f"frozen {n} changed"
        # the base model's own tensors (under whatever prefix peft adds) are untouched
        base_now = {n: p for n, p in pm.base_transformer(model).named_parameters()}
        for n, p in base_now.items():
            key = n.replace(".base_layer", "")
            if key in base_params:
                assert torch.equal(p, base_params[key]), f"base weight {n} changed"

    expected = _logits(model, batch)
    tokenizer = load_tokenizer(model_name) if method == "none" else None
    out = pm.save_adapter(model, pm.adapter_dir(tmp_path, method), tokenizer=tokenizer)
    assert out == tmp_path / f"{method}_adapter"
    files = {p.name for p in out.iterdir()}
    if method == "none":
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    else:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert [p.name for p in tmp_path.iterdir()] == [out.name], "temp dirs left behind"
    assert pm.adapter_method(out) == method

    reloaded = pm.load_adapter(load_model(model_name), out)
    assert pm.model_method(reloaded) == method
    assert torch.equal(_logits(reloaded, batch), expected)
    assert pm.trainable_summary(reloaded)[0] == 0  # loaded for inference by default


@pytest.mark.parametrize("method", pm.METHODS)
def test_virtual_token_offset_lines_logits_up_with_labels(method):
    batch = _batch(4)
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method=method, num_virtual_tokens=5))
    logits = _logits(model, batch)
    offset = pm.virtual_token_offset(model)
    assert offset == (5 if method == "prompt" else 0)
    assert logits.shape[1] == batch["input_ids"].shape[1] + offset
    # logits[:, offset + i] predicts input_ids[:, i + 1]; peft's labels= loss (which also scores the
    # first real token from the last virtual position) is reproduced from that alignment
    start = offset - 1 if offset else 0
    targets = batch["labels"] if offset else batch["labels"][:, 1:]
    shifted = logits[:, start:-1].reshape(-1, logits.shape[-1])
    manual = torch.nn.functional.cross_entropy(shifted, targets.reshape(-1))
    torch.testing.assert_close(manual, torch.tensor(_loss(model, batch)), rtol=1e-5, atol=1e-5)


def test_trainable_message_format():
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="lora", r=4))
    msg = pm.trainable_message(model)
    trainable, total = pm.trainable_summary(model)
    assert re.fullmatch(r"trainable params: [\d,]+ \|\| all params: [\d,]+ \|\| trainable%: \d+\.\d\d", msg), msg
    assert f"{trainable:,}" in msg and f"{total:,}" in msg
    assert f"{100 * trainable / total:.2f}" in msg


def test_lora_default_targets_gpt2_conv1d():
    from transformers.pytorch_utils import Conv1D

    model = pm.apply_peft(load_model("tiny-gpt2"), PeftSpec(method="lora", r=4))
    config = model.peft_config["default"]
    assert config.fan_in_fan_out is True
    wrapped = {n.split(".")[-1] for n, m in model.named_modules() if hasattr(m, "lora_A") and isinstance(m.base_layer, Conv1D)}
    assert wrapped == {"c_attn", "c_proj", "c_fc"}
    assert not any("lm_head" in n and "lora" in n for n, _ in model.named_parameters())


def test_lora_default_targets_llama_all_linear():
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="lora", r=4))
    wrapped = {n.split(".")[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("model_name,targets,ff", [
    ("tiny-llama", {"k_proj", "v_proj", "down_proj"}, {"down_proj"}),
    ("tiny-gpt2", {"c_attn", "mlp.c_proj"}, {"mlp.c_proj"}),
])
def test_ia3_targets_per_family(model_name, targets, ff):
    model = pm.apply_peft(load_model(model_name), PeftSpec(method="ia3"))
    config = model.peft_config["default"]
    assert set(config.target_modules) == targets
    assert set(config.feedforward_modules) == ff
    scaled = [n for n, _ in model.named_parameters() if "ia3_l" in n]
    n_layers = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer
    assert len(scaled) == len(targets) * n_layers
    if model_name == "tiny-gpt2":  # mlp.c_proj only, not attn.c_proj
        assert not any("attn.c_proj" in n for n in scaled)


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2", "tiny-qwen2"])
def test_houlsby_identity_at_init(model_name):
    batch = _batch(1)
    base_logits = _logits(load_model(model_name), batch)
    model = pm.apply_peft(load_model(model_name), PeftSpec(method="adapter", adapter_size=8))
    assert torch.equal(_logits(model, batch), base_logits)
    adapters = [m for m in model.modules() if isinstance(m, houlsby.BottleneckAdapter)]
    n_layers = getattr(model.config, "num_hidden_layers", None) or model.config.n_layer
    assert len(adapters) == 2 * n_layers  # one after attention, one after the MLP, per block
    assert all(a.down.out_features == 8 for a in adapters)
    # and the adapter really is in the forward path: perturbing `up` changes the output
    with torch.no_grad():
        adapters[0].up.bias.fill_(0.5)
    assert not torch.equal(_logits(model, batch), base_logits)


def test_houlsby_config_and_wrong_base(tmp_path):
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="adapter", adapter_size=8))
    out = pm.save_adapter(model, tmp_path / "adapter_adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "HOULSBY"
    assert config["adapter_size"] == 8 and config["hidden_size"] == 128
    assert config["base_model_name_or_path"].endswith("tiny-llama")
    assert config["num_adapters"] == 8
    # base parameter names are untouched, so a plain state dict still matches the base
    assert "model.layers.0.self_attn.o_proj.weight" in model.state_dict()
    with pytest.raises(SmolforgeError, match="tiny-llama"):
        pm.load_adapter(load_model("tiny-gpt2"), out)
    other = load_model("small-llama")
    batch = _batch()
    other_logits = _logits(other, batch)
    with pytest.raises(SmolforgeError, match="tiny-llama"):
        pm.load_adapter(other, out)
    assert not houlsby.is_houlsby(other), "a failed load left adapters on the base model"
    assert torch.equal(_logits(other, batch), other_logits)


def test_peft_adapter_wrong_base_is_clear(tmp_path):
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="lora", r=4))
    out = pm.save_adapter(model, tmp_path / "lora_adapter")
    with pytest.raises(SmolforgeError, match="base model"):
        pm.load_adapter(load_model("small-llama"), out)


@pytest.mark.parametrize("method", ["lora", "ia3"])
@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2"])
def test_merge_matches_unmerged(model_name, method):
    torch.manual_seed(0)
    model = _no_dropout(pm.apply_peft(load_model(model_name), PeftSpec(method=method, dropout=0.0)))
    batch = _batch()
    _train(model, batch, 1e-2)
    unmerged = _logits(model, batch)
    merged = pm.merge_adapter(model)
    assert pm.model_method(merged) == "none"
    assert not any("lora_" in n or "ia3_" in n for n, _ in merged.named_parameters())
    assert type(merged).__module__.startswith("transformers.")
    torch.testing.assert_close(_logits(merged, batch), unmerged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["prefix", "prompt"])
def test_merge_refuses_prompt_methods(method):
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method=method))
    with pytest.raises(SmolforgeError, match=f"cannot merge {method} tuning; keep the adapter") as err:
        pm.merge_adapter(model)
    assert err.value.fix


def test_merge_houlsby_plain_refused_but_kept_on_request():
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="adapter"))
    with pytest.raises(SmolforgeError, match="Houlsby") as err:
        pm.merge_adapter(model)
    assert "lora" in err.value.fix
    assert pm.merge_adapter(model, plain=False) is model


def test_unknown_target_modules_is_clear():
    with pytest.raises(SmolforgeError, match="cannot apply lora") as err:
        pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="lora", target_modules=["no_such_proj"]))
    assert "target_modules" in err.value.fix


def test_apply_twice_refused():
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="adapter"))
    with pytest.raises(SmolforgeError, match="already"):
        pm.apply_peft(model, PeftSpec(method="lora"))


@pytest.mark.parametrize("method", pm.METHODS)
@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2"])
def test_gradient_checkpointing_same_gradients(model_name, method):
    """Checkpointing recomputes activations; the gradients must be those of a plain backward."""
    batch = _batch(2)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = _no_dropout(pm.apply_peft(load_model(model_name), PeftSpec(method=method, dropout=0.0)))
        if method == "adapter":  # make `down` receive gradient too (up is zero at init)
            with torch.no_grad():
                for m in model.modules():
                    if isinstance(m, houlsby.BottleneckAdapter):
                        m.up.weight.normal_(std=0.02)
        if checkpointing:
            pm.enable_gradient_checkpointing(model)
            assert pm.base_transformer(model).is_activation_checkpointing
        model.train()
        model(**batch).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    plain, ckpt = grads
    assert plain.keys() == ckpt.keys() and plain
    assert any(g.abs().sum() > 0 for g in plain.values())
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-4, atol=1e-6)


def test_prefix_with_checkpointing_either_order_and_generation():
    """peft refuses prefix tuning on a checkpointing model; apply_peft handles either order,
    and generation (eval mode, growing KV cache) is unaffected by the training-time fix."""
    batch = _batch(3)
    prompt = batch["input_ids"][:2, :6]
    torch.manual_seed(0)
    plain = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="prefix"))
    torch.manual_seed(0)
    base = load_model("tiny-llama")
    pm.enable_gradient_checkpointing(base)
    ckpt = pm.apply_peft(base, PeftSpec(method="prefix"))
    assert pm.base_transformer(ckpt).is_activation_checkpointing
    ckpt.train()
    loss = ckpt(**batch).loss
    loss.backward()
    plain.train()
    torch.testing.assert_close(loss, plain(**batch).loss)
    grad = ckpt.prompt_encoder["default"].embedding.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    plain.eval()
    ckpt.eval()
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        assert torch.equal(ckpt.generate(input_ids=prompt, **kwargs), plain.generate(input_ids=prompt, **kwargs))


def test_save_is_atomic_and_replaces(tmp_path):
    out = tmp_path / "lora_adapter"
    first = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="lora", r=4))
    pm.save_adapter(first, out)
    before = (out / "adapter_model.safetensors").read_bytes()

    class Broken:
        def save_pretrained(self, path):
            raise OSError("disk full")

    torch.manual_seed(1)
    second = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="lora", r=4))
    with pytest.raises(OSError, match="disk full"):
        pm.save_adapter(second, out, tokenizer=Broken())
    assert (out / "adapter_model.safetensors").read_bytes() == before, "old adapter damaged by a failed save"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora_adapter"], "temp dir left behind"

    pm.save_adapter(second, out)
    assert (out / "adapter_model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora_adapter"]


def test_adapter_method_errors(tmp_path):
    with pytest.raises(SmolforgeError, match="does not exist"):
        pm.adapter_method(tmp_path / "missing")
    with pytest.raises(SmolforgeError, match="neither"):
        pm.adapter_method(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "VERA"}')
    with pytest.raises(SmolforgeError, match="unsupported peft_type"):
        pm.adapter_method(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(SmolforgeError, match="not valid JSON"):
        pm.adapter_method(tmp_path)


def test_load_trainable_for_resume(tmp_path):
    model = pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="adapter"))
    out = pm.save_adapter(model, tmp_path / "a")
    again = pm.load_adapter(load_model("tiny-llama"), out, is_trainable=True)
    assert pm.trainable_summary(again) == pm.trainable_summary(model)
    lora = pm.save_adapter(pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="lora")), tmp_path / "l")
    again = pm.load_adapter(load_model("tiny-llama"), lora, is_trainable=True)
    assert pm.trainable_summary(again)[0] > 0


# --------------------------------------------------------------------------- CLI parsing


def test_peft_spec_from_cli_json_and_flags():
    spec = pm.peft_spec_from_cli("lora", '{"r": 4, "alpha": 8, "dropout": 0.1}')
    assert (spec.method, spec.r, spec.alpha, spec.dropout) == ("lora", 4, 8, 0.1)
    # peft's own key names work too, and explicit flags win over the JSON
    spec = pm.peft_spec_from_cli("lora", '{"lora_alpha": 32, "lora_dropout": 0.0, "target_modules": ["q_proj"]}',
                                 lora_r=2, lora_alpha=4)
    assert (spec.r, spec.alpha, spec.dropout, spec.target_modules) == (2, 4, 0.0, ["q_proj"])
    spec = pm.peft_spec_from_cli("prefix", '{"num_virtual_tokens": 12}')
    assert (spec.method, spec.num_virtual_tokens) == ("prefix", 12)
    spec = pm.peft_spec_from_cli("adapter", None)
    assert spec == PeftSpec(method="adapter")


@pytest.mark.parametrize("text,match", [
    ("{'r': 8}", "not valid JSON"),
    ('{"r": 8,', "not valid JSON"),
    ("[8, 16]", "must be a JSON object"),
    ('{"r": 0}', "r: Input should be greater than or equal to 1"),
    ('{"rank_of_lora": 8}', "rank_of_lora"),
    ('{"method": "ia3"}', "--peft is 'lora'"),
    ('{"r": 4, "lora_r": 8}', "twice"),
])
def test_peft_spec_from_cli_bad_config(text, match):
    with pytest.raises(SmolforgeError, match=re.escape(match)) as err:
        pm.peft_spec_from_cli("lora", text)
    assert err.value.fix


def test_peft_spec_from_cli_bad_method():
    with pytest.raises(SmolforgeError, match="unknown --peft") as err:
        pm.peft_spec_from_cli("qlora", None)
    assert "lora" in err.value.fix


@pytest.mark.parametrize("method", ["lora", "adapter"])
def test_an_adapter_on_a_base_of_another_shape_is_refused(tmp_path, method):
    """tiny-llama and tiny-qwen2 have the same layer names and sizes: a LoRA of one loads onto the
    other without a peft error and gives nonsense, so the base's shape is recorded and checked."""
    out = tmp_path / f"{method}_adapter"
    pm.save_adapter(pm.apply_peft(load_model("tiny-llama"), PeftSpec(method=method, r=4)), out)
    assert json.loads((out / pm.BASE_FILE).read_text())["model_type"] == "llama"
    pm.load_adapter(load_model("tiny-llama"), out)  # its own base: fine
    with pytest.raises(SmolforgeError, match="trained on another base model") as err:
        pm.load_adapter(load_model("tiny-qwen2"), out)
    assert "model_type llama vs qwen2" in str(err.value.what) and "tiny-llama" in err.value.render()
