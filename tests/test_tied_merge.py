"""Tied weights (issue 41, item 4): an adapter on the tied head or input embedding, merged by every path.

A tiny preset ties its input embedding and its head (the SmolLM2 kind). A LoRA on `lm_head` changes
the head only (peft trains and applies it so, unmerged); folding it into the one shared matrix used to
change the input embedding too: `serve` answered with other tokens at every position, and `export`
refused the adapter. Every merge now unties (`models/tied.py`); each path is checked here against the
unmerged peft model: logits within 1e-4 and the same greedy text.

The adapters: one trained by `train` (a few steps, LoRA on lm_head of tiny-llama: also the proof that
`train` says once that it unties, and that training changes the head only), and ones built in-process
with nonzero LoRA matrices (an embedding target on tiny-llama; lm_head on tiny-gpt2, whose adapter
config says fan_in_fan_out for its Conv1D blocks but whose head is a plain Linear; lm_head and q_proj on
the SmolLM2-360M twin: the published tied config and vocabulary, two narrow layers).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(600)

PROMPT = "What is 2 + 3? The answer is"
NEW_TOKENS = 8


def _train_head_lora(out: Path) -> tuple[Path, str, dict]:
    """`train` with LoRA on lm_head only: the adapter, what it said on stderr, its summary."""
    from smolforge.config import TrainConfig
    from smolforge.train.engine import train

    cfg = TrainConfig.model_validate({
        "model": "tiny-llama", "output_dir": str(out), "max_steps": 3, "batch_size": 4, "lr": 5e-2, "seed": 0,
        "data": {"path": "bundled", "max_samples": 16, "max_eval_samples": 2, "max_length": 48},
        "eval_accuracy": False, "device": "cpu", "precision": "fp32", "num_threads": 1, "quiet": False,
        "tensorboard": False, "save_every": 0,
        "peft": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["lm_head"]}})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = train(cfg)
    return Path(result.adapter_dir), err.getvalue(), result.to_dict()


def _built_lora(model: str, targets: list[str], out: Path) -> Path:
    """A LoRA on `targets` with every LoRA matrix random (nonzero), saved as `train` saves one."""
    from smolforge.config import PeftSpec
    from smolforge.models.loading import load_model
    from smolforge.models.peft_methods import apply_peft, save_adapter

    torch.manual_seed(0)
    net = apply_peft(load_model(model), PeftSpec(method="lora", r=4, alpha=8, dropout=0.0, target_modules=targets))
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    return save_adapter(net, out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train_head_lora(tmp_path_factory.mktemp("tied-train") / "run")


@pytest.fixture(scope="module")
def cases(tmp_path_factory, trained) -> dict[str, tuple[str, Path]]:
    """case -> (model, adapter dir)."""
    root = tmp_path_factory.mktemp("tied-adapters")
    return {"llama-lm_head-trained": ("tiny-llama", trained[0]),
            "llama-embed_tokens": ("tiny-llama", _built_lora("tiny-llama", ["embed_tokens"], root / "embed")),
            "gpt2-lm_head": ("tiny-gpt2", _built_lora("tiny-gpt2", ["lm_head"], root / "gpt2-head")),
            "smollm2-lm_head": (SMOLLM2, _built_lora(SMOLLM2, ["lm_head", "q_proj"], root / "smollm2-head"))}


SMOLLM2 = "twin:smollm2-360m-instruct"  # the published config (tied, 49152 tokens), 2 narrow layers
CASES = ["llama-lm_head-trained", "llama-embed_tokens", "gpt2-lm_head", "smollm2-lm_head"]


def _ids(model: str) -> torch.Tensor:
    from smolforge.models.loading import load_tokenizer

    return load_tokenizer(model)(PROMPT, return_tensors="pt")["input_ids"]


def _greedy(step, ids: torch.Tensor) -> list[int]:
    """NEW_TOKENS greedy picks of `step` (ids [1, n] -> logits [1, n, vocab]), recomputing the whole row."""
    out = ids
    for _ in range(NEW_TOKENS):
        nxt = step(out)[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, nxt], dim=1)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def unmerged(cases) -> dict[str, tuple[torch.Tensor, list[int]]]:
    """case -> (logits [1, n, vocab], greedy ids) of the unmerged peft model: what every merge must give."""
    from smolforge.models.loading import load_model
    from smolforge.models.peft_methods import load_adapter

    out = {}
    with torch.no_grad():
        for case, (model, adapter) in cases.items():
            net = load_adapter(load_model(model), adapter).eval()
            base = load_model(model).eval()
            ids = _ids(model)
            logits = net(ids).logits
            assert (logits - base(ids).logits).abs().max() > 1e-2, case  # the adapter matters
            out[case] = (logits, _greedy(lambda x: net(x).logits, ids))
    return out


def _assert_same(case: str, model: str, step, unmerged) -> None:
    """`step` (ids [1, n] -> logits [1, n, vocab]) gives the unmerged adapter's logits (1e-4) and greedy ids."""
    want_logits, want_ids = unmerged[case]
    ids = _ids(model)
    with torch.no_grad():
        got = step(ids)
        assert (got - want_logits).abs().max().item() < 1e-4, case
        assert _greedy(step, ids) == want_ids, case


def test_train_says_once_that_it_unties_and_trains_the_head_only(trained):
    from safetensors.torch import load_file

    from smolforge.models.loading import load_model

    adapter, stderr, summary = trained
    said = " ".join(stderr.split())  # the console wraps long lines
    assert said.count("lm_head.weight is tied to model.embed_tokens.weight and the adapter changes lm_head: "
                      "merging unties them") == 1, stderr
    assert summary["untied"] == ["lm_head.weight"]
    # what training made: a delta on the head only; the shared matrix peft saved with it is the base's
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    base = load_model("tiny-llama").get_input_embeddings().weight
    assert torch.equal(saved["base_model.model.lm_head.base_layer.weight"], base)
    assert saved["base_model.model.lm_head.lora_B.weight"].abs().max() > 0
    assert not any("embed_tokens" in key for key in saved)


@pytest.mark.parametrize("case", CASES)
def test_serve_merges_a_tied_module_adapter_into_an_untied_model(case, cases, unmerged, tmp_path):
    """serve's one-process model (peft's merge, `merge_adapter`); saved as `split merge` saves it, it
    reloads the same with plain transformers."""
    from transformers import AutoModelForCausalLM

    from smolforge.serve.model import ServedModel

    model, adapter = cases[case]
    net = ServedModel.load(model, str(adapter)).model
    assert not any("lora" in n for n, _ in net.named_parameters())  # merged, not applied
    _assert_same(case, model, lambda x: net(x).logits, unmerged)
    assert net.get_output_embeddings().weight is not net.get_input_embeddings().weight
    assert net.config.tie_word_embeddings is False
    net.save_pretrained(str(tmp_path / "merged"))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    _assert_same(case, model, lambda x: again(x).logits, unmerged)


@pytest.mark.parametrize("case", CASES)
def test_hf_export_writes_the_untied_head_and_equals_the_unmerged_adapter(case, cases, unmerged, tmp_path):
    from transformers import AutoModelForCausalLM

    from smolforge.models.export.run import export

    model, adapter = cases[case]
    export(model, "hf", tmp_path / "hf", adapters=[str(adapter)], dtype="fp32")  # the twin is stored in bf16
    net = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    _assert_same(case, model, lambda x: net(x).logits, unmerged)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert config["tie_word_embeddings"] is False and "lm_head.weight" in index["weight_map"]


@pytest.mark.parametrize("case", CASES)
def test_two_stages_merge_a_tied_module_adapter_like_the_unmerged_one(case, cases, unmerged):
    from smolforge.models.stage_load import load_stage

    from smolforge.models.loading import load_model

    model, adapter = cases[case]
    layers = load_model(model).config.num_hidden_layers
    first, _ = load_stage(model, [0, layers // 2, layers], 0, adapters=[str(adapter)])
    last, _ = load_stage(model, [0, layers // 2, layers], 1, adapters=[str(adapter)])

    def step(x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1])[None]
        return last(first(x, None, pos), None, pos)

    _assert_same(case, model, step, unmerged)


def test_export_refuses_an_adapter_whose_saved_base_matrix_is_not_the_base(cases, tmp_path):
    """Untying is impossible only when the adapter carries another base's shared matrix (peft's saved
    embedding layer: a resized vocabulary, another checkpoint): refused, with the base to use."""
    import shutil

    from safetensors.torch import load_file, save_file

    from smolforge.errors import SmolforgeError
    from smolforge.models.export.merge import MergedModel
    from smolforge.models.export.run import model_dir

    _, adapter = cases["llama-lm_head-trained"]
    other = tmp_path / "other"
    shutil.copytree(adapter, other)
    tensors = load_file(str(other / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.base_layer.weight"] += 1.0
    save_file(tensors, str(other / "adapter_model.safetensors"))
    merged = MergedModel(model_dir("tiny-llama"), [str(other)])
    with pytest.raises(SmolforgeError, match="differs from the base model") as err:
        merged.tensor("lm_head.weight")
    assert "--model" in err.value.fix


@pytest.mark.parametrize("case", [CASES[0], *(pytest.param(c, marks=pytest.mark.soak) for c in CASES[1:])])
def test_gguf_export_writes_its_own_output_tensor_and_verifies_in_llama_cpp(case, cases, tmp_path):
    """Export used to refuse this adapter. Its GGUF holds an explicit output.weight, and the export's
    own check in llama.cpp (models/export/verify.py: greedy picks and logits against the unmerged peft
    model on 16 prompts) passes. The lm_head case is CI tier; the others are second instances (soak)."""
    from test_export import require_llama_cpp

    require_llama_cpp()
    import gguf

    from smolforge.models.export.run import export

    model, adapter = cases[case]
    summary = export(model, "gguf", tmp_path / "gguf", adapters=[str(adapter)], quant="f16", threads=1)
    v = summary["verify"]
    # every pick HF's, counting a near-tie (HF's own top two closer than f16's rounding) as agreeing
    assert v["ok"] and v["tokenization_equal"] and v["greedy_agreement_with_ties"] == 1.0 and v["logits_nmse"] <= 1e-4, v
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "gguf" / "model.gguf")).tensors}
    assert {"output.weight", "token_embd.weight"} <= names
