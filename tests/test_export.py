"""`smolforge export`: LoRAs trained on the three tiny families, exported and checked.

One module-scoped fixture trains a LoRA on tiny-llama, tiny-qwen2 and tiny-gpt2 (a few steps each);
every test reuses them:
- GGUF f16 and q8_0, loaded in llama.cpp (llama-cpp-python): tokenization equal to HF's, greedy
  tokens on 16 prompts equal at f16 (>= 90% at q8_0), logits NMSE <= 1e-4 at f16;
- `--to hf` loads with plain AutoModelForCausalLM and gives the peft model's logits;
- `--to ollama`: the Modelfile's TEMPLATE rendered by Go's text/template equals the tokenizer's
  chat template for a two-turn conversation (needs `go`);
- Houlsby/prefix/prompt adapters refused by the CLI with one message, exit 2; for prefix/prompt tuning
  (which `serve` refuses too) the command each refusal's fix names runs the adapter;
- `train --export gguf`, and the `export` job kind on an embedded cluster (subprocesses).
Without llama-cpp-python or `go` those tests skip, or fail under CI (CI=true): see helpers.require.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import last_json, require, require_module, smolforge, smolforge_here

pytestmark = pytest.mark.timeout(600)

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-gpt2"]
TWO_TURNS = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Reverse \"abc\" please\nthanks"},
]


def require_llama_cpp() -> None:
    """These tests are the only proof of the GGUF export in llama.cpp: under CI a missing or broken
    llama-cpp-python build fails them (helpers.require), never skips them."""
    __tracebackhide__ = True
    require_module("llama_cpp", "llama-cpp-python (smolforge[export])",
                   "make install (pip install -e '.[export]' with the Makefile's CMAKE_ARGS; builds llama.cpp)")


def _train(model: str, out: Path) -> Path:
    from smolforge.config import TrainConfig
    from smolforge.train.engine import train

    cfg = TrainConfig.model_validate({
        "model": model, "output_dir": str(out), "max_steps": 4, "batch_size": 4, "lr": 5e-3, "seed": 0,
        "data": {"path": "bundled", "max_samples": 32, "max_eval_samples": 4, "max_length": 64},
        "eval_accuracy": False, "device": "cpu", "precision": "fp32", "num_threads": 1, "quiet": True,
        "tensorboard": False, "save_every": 0, "peft": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0}})
    return Path(train(cfg).adapter_dir)


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export-loras")
    return {m: _train(m, root / m) for m in FAMILIES}


def _peft_model(model: str, adapter: Path):
    from smolforge.models.loading import load_model
    from smolforge.models.peft_methods import load_adapter

    return load_adapter(load_model(model), adapter).eval()


@pytest.mark.parametrize("model", FAMILIES)
def test_gguf_in_llama_cpp_matches_hf(model, loras, tmp_path):
    require_llama_cpp()
    from smolforge.models.export.run import export

    f16 = export(model, "gguf", tmp_path / "f16", adapters=[str(loras[model])], quant="f16", threads=1)
    v = f16["verify"]
    assert f16["gguf"]["pre_tokenizer"] == "starcoder"  # digits split singly, then GPT-2's byte-level regex
    assert v["prompts"] == 16 and v["tokenization_equal"], v
    assert v["greedy_agreement"] == 1.0, v  # exact: every pick is HF's, no near-tie allowance needed
    assert v["logits_nmse"] <= 1e-4, v
    q8 = export(model, "gguf", tmp_path / "q8", adapters=[str(loras[model])], quant="q8_0", threads=1)
    assert q8["verify"]["greedy_agreement"] >= 0.9, q8["verify"]  # exact, without the near-ties
    assert q8["gguf"]["bytes"] < 0.75 * f16["gguf"]["bytes"]
    # what each format costs the logits, against HF fp32 on every verified position: q8_0 rounds more than f16
    assert v["kl_positions"] > 16 and 0 <= v["kl_vs_fp32"] < q8["verify"]["kl_vs_fp32"], (v, q8["verify"])
    assert (tmp_path / "f16" / "model.gguf").is_file() and (tmp_path / "f16" / "export.json").is_file()


def test_kl_to_fp32_is_zero_for_equal_logits_and_the_closed_form_otherwise():
    import numpy as np
    from smolforge.models.export.verify import _kl_sum

    p = np.array([[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]])
    assert _kl_sum(p, p + 3.0) == pytest.approx(0.0, abs=1e-12)  # a shift is the same distribution
    q = np.array([[0.0, 0.0, 0.0]])
    probs = np.exp(p[:1]) / np.exp(p[:1]).sum()
    assert _kl_sum(p[:1], q) == pytest.approx(float((probs * np.log(probs * 3)).sum()), rel=1e-9)


@pytest.mark.parametrize("model", FAMILIES)
def test_hf_export_loads_with_plain_transformers_and_equals_peft(model, loras, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from smolforge.models.export.run import export
    from smolforge.models.loading import load_model

    export(model, "hf", tmp_path / "hf", adapters=[str(loras[model])])
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = tok.apply_chat_template(TWO_TURNS, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        want = _peft_model(model, loras[model])(ids).logits
        got = merged(ids).logits
        base = load_model(model).eval()(ids).logits
    assert (got - want).abs().max() < 1e-4
    assert (base - want).abs().max() > 1e-3  # the LoRA changed the model: the check above means something


GO_RENDER = textwrap.dedent('''
    package main

    import (
        "encoding/json"
        "os"
        "text/template"
    )

    type Message struct {
        Role    string `json:"role"`
        Content string `json:"content"`
    }

    func main() {
        src, _ := os.ReadFile(os.Args[1])
        var msgs []Message
        data, _ := os.ReadFile(os.Args[2])
        if err := json.Unmarshal(data, &msgs); err != nil { panic(err) }
        t := template.Must(template.New("m").Parse(string(src)))
        if err := t.Execute(os.Stdout, map[string]any{"Messages": msgs}); err != nil { panic(err) }
    }
''')


def _modelfile_template(text: str) -> str:
    start = text.index('TEMPLATE """') + len('TEMPLATE """')
    return text[start: text.index('"""', start)]


def test_ollama_modelfile_template_renders_like_the_chat_template(loras, tmp_path):
    from smolforge.models.export.run import export
    from smolforge.models.loading import load_tokenizer

    go = shutil.which("go")
    summary = export("tiny-qwen2", "ollama", tmp_path / "ollama", adapters=[str(loras["tiny-qwen2"])], verify=False,
                     name="tiny-qwen2-lora")
    text = (tmp_path / "ollama" / "Modelfile").read_text()
    assert text.startswith("FROM ./model.gguf\n") and (tmp_path / "ollama" / "model.gguf").is_file()
    assert 'PARAMETER stop "<|im_end|>"' in text
    assert summary["ollama"]["create"] == f"ollama create tiny-qwen2-lora -f {tmp_path / 'ollama' / 'Modelfile'}"
    require(go is not None, "go (Go's text/template renders the Modelfile's TEMPLATE)",
            "apt-get install golang-go (.ci/run does it as root)")
    (tmp_path / "render.go").write_text(GO_RENDER)
    (tmp_path / "template.txt").write_text(_modelfile_template(text))
    (tmp_path / "messages.json").write_text(json.dumps(TWO_TURNS))
    env = {**os.environ, "GOCACHE": str(tmp_path / "gocache"), "GOPATH": str(tmp_path / "gopath"), "GO111MODULE": "off"}
    proc = subprocess.run([go, "run", str(tmp_path / "render.go"), str(tmp_path / "template.txt"),
                           str(tmp_path / "messages.json")], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    tok = load_tokenizer("tiny-qwen2")
    want = tok.apply_chat_template(TWO_TURNS, tokenize=False, add_generation_prompt=True)
    assert proc.stdout == want


@pytest.fixture(scope="module")
def unmergeable(tmp_path_factory) -> dict[str, Path]:
    from smolforge.config import PeftSpec
    from smolforge.models.loading import load_model
    from smolforge.models.peft_methods import apply_peft, save_adapter

    root = tmp_path_factory.mktemp("unmergeable")
    return {m: save_adapter(apply_peft(load_model("tiny-llama"), PeftSpec(method=m)), root / f"{m}_adapter")
            for m in ("adapter", "prefix", "prompt")}


@pytest.mark.parametrize("method", ["adapter", "prefix", "prompt"])
def test_unmergeable_adapters_are_refused_before_any_work(method, unmergeable, tmp_path):
    from smolforge.errors import SmolforgeError
    from smolforge.models.export.run import export

    for to in ("gguf", "ollama", "hf"):
        with pytest.raises(SmolforgeError) as err:
            export("tiny-llama", to, tmp_path / "out", adapters=[str(unmergeable[method])])
        assert "cannot export" in err.value.what and "--peft lora" in err.value.fix
    assert not (tmp_path / "out").exists()


def _advised_command(stderr: str) -> list[str]:
    """The command a refusal's fix names (in backticks; the older wording put it in parentheses)."""
    fix = stderr.split("fix:", 1)[1]
    found = re.search(r"`(smolforge [^`]+)`|\((smolforge [^)]+)\)", fix)
    assert found, fix
    return shlex.split(found.group(1) or found.group(2))


@pytest.mark.parametrize("method", ["prefix", "prompt"])
def test_each_refusal_of_a_virtual_token_adapter_names_a_command_that_runs_it(method, unmergeable, tmp_path):
    """Prefix/prompt tuning can be neither merged (`export`) nor served (their virtual tokens do not fit the
    server's KV cache): both refuse it, exit 2, and the command each refusal's fix names runs the adapter
    (exit 0, a reply), never another refusal. In-process, as the CLI runs them."""
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    adapter, runner = str(unmergeable[method]), CliRunner()
    refusals = {
        "export": runner.invoke(app, ["export", "--model", "tiny-llama", "--adapter", adapter, "--to", "gguf",
                                      "--output-dir", str(tmp_path / "out")]),
        "serve": runner.invoke(app, ["serve", "--model", "tiny-llama", "--adapter", adapter, "--port", "0",
                                     "--device", "cpu"]),
    }
    for command, res in refusals.items():
        assert res.exit_code == 2 and res.stderr.startswith("error:"), (command, res.stderr, res.exception)
        advised = _advised_command(res.stderr)
        ran = runner.invoke(app, [*advised[1:], "--max-new-tokens", "4", "--device", "cpu"])
        assert ran.exit_code == 0, (command, advised, ran.stderr, ran.exception)
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_houlsby_adapter_with_one_message_exit_2(unmergeable, tmp_path):
    proc = smolforge("export", "--model", "tiny-llama", "--adapter", str(unmergeable["adapter"]), "--to", "gguf",
                     "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: cannot export") and "Houlsby" in proc.stderr and "fix:" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_train_export_gguf_writes_a_verified_gguf(tmp_path):
    require_llama_cpp()
    proc = smolforge_here("train", "--model", "tiny-gpt2", "--data", "bundled", "--max-samples", "32", "--max-steps",
                          "2", "--batch-size", "4", "--max-length", "64", "--set", "eval_accuracy=false",
                          "--set", "data.max_eval_samples=4", "--num-threads", "1", "--output-dir",
                          str(tmp_path / "run"), "--export", "gguf", "--json")  # in this process: no torch to import again
    assert proc.exit_code == 0, proc.output[-3000:]
    out = last_json(proc.stdout)
    assert out["export"]["verify"]["ok"] and out["export"]["verify"]["greedy_agreement_with_ties"] == 1.0
    assert (tmp_path / "run" / "export" / "model.gguf").is_file()


EMBEDDED_JOB = textwrap.dedent('''
    import json, sys
    from smolforge.cluster.embedded import EmbeddedCluster
    adapter, dest = sys.argv[1], sys.argv[2]
    with EmbeddedCluster(num_cpus=1) as c:
        job = c.submit_job({"kind": "export", "model": "tiny-llama", "adapters": [adapter], "to": "ollama",
                            "verify": False, "model_name": "job-export"})
        st = c.wait_for_job(job, timeout=300)
        events = [e["kind"] for e in c.job_events(job)]
        path = c.download_artifact(job, "export", "ollama", dest) if st["state"] == "completed" else None
        print(json.dumps({"state": st["state"], "error": st.get("error"), "events": events, "path": str(path)}))
''')


def test_export_job_kind_on_the_embedded_cluster(loras, tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="sfx", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    for k in ("SMOLFORGE_COORDINATOR", "SMOLFORGE_TOKEN", "SMOLFORGE_RAY_ADDRESS", "RAY_ADDRESS",
              "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(k, None)
    try:
        proc = subprocess.run([sys.executable, "-c", EMBEDDED_JOB, str(loras["tiny-llama"]), str(tmp_path / "dl")],
                              capture_output=True, text=True, timeout=400, env=env, start_new_session=True)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["state"] == "completed", out
    assert "exported" in out["events"]
    got = Path(out["path"])
    assert (got / "model.gguf").is_file() and (got / "Modelfile").is_file()
    assert json.loads((got / "export.json").read_text())["name"] == "job-export"


def test_an_f32_gguf_keeps_every_weight_unrounded(tmp_path):
    """`--quant f32`: every tensor written as F32 (the file type ALL_F32), the weights the checkpoint's own
    to the bit: the export to compare an engine against the fp32 model exactly (issue 46: llama-server on it
    gives the hf teacher's top-k at every position, tests/serve/test_teacher_openai_topk.py)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from smolforge.models.export.run import export
    from smolforge.models.tiny import preset_dir

    export("tiny-llama", "gguf", tmp_path / "f32", quant="f32", verify=False, threads=1)
    reader = gguf.GGUFReader(tmp_path / "f32" / "model.gguf")
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert int(reader.fields["general.file_type"].parts[-1][0]) == gguf.LlamaFileType.ALL_F32
    emb = load_file(preset_dir("tiny-llama") / "model.safetensors")["model.embed_tokens.weight"]
    written = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert np.array_equal(np.asarray(written.data).reshape(emb.shape), emb)
