"""`--dtype auto|bf16|fp16|fp32`: what each model load ends up in, and that bf16 still learns and serves.

In-process and short (tiny-llama, tens of steps): the claims are about the dtypes the mechanism
chose, not about speed. The memory claim is the bench at the end (off the CI tier).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from smolforge.config import DataSpec, PeftSpec, TrainConfig
from smolforge.errors import SmolforgeError
from smolforge.models import dtypes
from smolforge.models.tiny import preset_dir


def _cfg(tmp: Path, **kw) -> TrainConfig:
    base = dict(model="tiny-llama", data=DataSpec(path="bundled", max_length=48, max_eval_samples=8, max_samples=200),
                peft=PeftSpec(method="lora", r=4, alpha=8, dropout=0.0), output_dir=str(tmp), max_steps=20,
                batch_size=4, lr=1e-2, warmup_steps=0, quiet=True, tensorboard=False, eval_accuracy=False,
                num_threads=1, seed=3, precision="fp32", log_every=1)
    base.update(kw)
    return TrainConfig(**base)


def _bf16_checkpoint(tmp: Path) -> Path:
    """tiny-llama, its config.json declaring bf16 (as most released checkpoints do)."""
    out = tmp / "tiny-bf16"
    shutil.copytree(preset_dir("tiny-llama"), out)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_lora_on_a_bf16_base_keeps_fp32_adapters_and_learns(tmp_path):
    from smolforge.train.engine import TrainHooks, train

    seen: dict[str, dict] = {}

    def on_model(model):  # the model train() built, as it trains
        seen["base"] = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
        seen["adapter"] = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}

    losses: list[float] = []
    train(_cfg(tmp_path, dtype="bf16"), hooks=TrainHooks(on_step=lambda info: losses.append(info.loss),
                                                         on_model=on_model))
    assert seen["adapter"] and all("lora_" in n for n in seen["adapter"])
    assert set(seen["base"].values()) == {torch.bfloat16}, seen["base"]
    assert set(seen["adapter"].values()) == {torch.float32}, seen["adapter"]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses


def test_a_bf16_teacher_writes_topk_rows(tmp_path):
    from smolforge.distill.teacher import GenSettings, HFTeacher, prompts_from_dataset

    teacher = HFTeacher("tiny-llama", device="cpu", dtype="bf16")
    assert next(teacher.model.parameters()).dtype == torch.bfloat16
    recs = teacher.generate(prompts_from_dataset("bundled", max_samples=4), GenSettings(max_new_tokens=5, top_k=8))
    assert len(recs) == 4
    for r in recs:
        assert r.has_topk and r.topk_logprobs.shape == (len(r.response_ids), 8)
        assert r.topk_logprobs.dtype.name == "float32" and (r.topk_logprobs <= 0).all()
        assert ((r.tail_mass >= -1e-3) & (r.tail_mass <= 1)).all()


def test_serve_loads_bf16_and_generates_greedily():
    from smolforge.serve.model import ServedModel

    served = ServedModel.load("tiny-llama", device="cpu", dtype="bf16")
    assert {p.dtype for p in served.model.parameters()} == {torch.bfloat16}
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        out = served.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=served.pad_id)
    assert out.shape == (1, 10)
    again = served.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=served.pad_id)
    assert torch.equal(out, again)  # greedy: the same tokens twice


def test_auto_takes_the_checkpoints_dtype_only_where_bf16_is_fast(tmp_path, monkeypatch):
    from smolforge.models import cpu_bf16 as precision

    declared = _bf16_checkpoint(tmp_path)
    cpu = torch.device("cpu")
    monkeypatch.delenv("SMOLFORGE_CPU_BF16", raising=False)  # the measurement decides, not the override
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 1.6)
    assert dtypes.pick_dtype("auto", str(declared), cpu) is torch.bfloat16
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 0.7)
    assert dtypes.pick_dtype("auto", str(declared), cpu) is torch.float32
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 1.6)
    # a checkpoint saying fp32 stays fp32 even where bf16 is fast; an explicit choice is taken as is
    assert dtypes.pick_dtype("auto", str(preset_dir("tiny-llama")), cpu) is torch.float32
    assert dtypes.pick_dtype("fp32", str(declared), cpu) is torch.float32


def test_export_to_hf_writes_the_dtype_asked_for(tmp_path):
    from safetensors import safe_open

    from smolforge.models.export.run import export

    summary = export("tiny-llama", "hf", tmp_path / "hf", dtype="bf16")
    assert summary["dtype"] == "bf16"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert dtypes.checkpoint_dtype(str(tmp_path / "hf")) == "bf16"  # what `auto` reads back


def test_fp16_refuses_to_train_on_a_cpu_and_serves_there():
    cpu = torch.device("cpu")
    tiny = str(preset_dir("tiny-llama"))
    with pytest.raises(SmolforgeError, match="fp16 cannot train on a CPU"):
        dtypes.pick_dtype("fp16", tiny, cpu, training=True)
    assert dtypes.pick_dtype("fp16", tiny, cpu) is torch.float16


def test_specs_take_the_spellings_and_name_the_choices():
    from smolforge.cluster.control.specs import ExportJob, ServeJob
    from smolforge.config import validate
    from smolforge.distill.settings import DistillSettings

    assert _cfg(Path("x"), dtype="bfloat16").dtype == "bf16"
    settings = DistillSettings(teacher="t", students=["s"], data="bundled", teacher_dtype="bf16")
    assert (settings.teacher_dtype, settings.student_dtype) == ("bf16", "fp32")
    assert ServeJob(model="tiny-llama", dtype="half").dtype == "fp16"
    for cls, data in ((TrainConfig, {"model": "m", "data": {"path": "bundled"}}),
                      (ServeJob, {"kind": "serve", "model": "m"})):
        with pytest.raises(SmolforgeError, match="'int8' is not a dtype: use one of auto, bf16, fp16, fp32"):
            validate(cls, {**data, "dtype": "int8"})
    with pytest.raises(SmolforgeError, match="applies to to: hf"):
        validate(ExportJob, {"model": "m", "to": "gguf", "dtype": "bf16"})


@pytest.mark.parametrize("argv", [
    ["train", "--model", "tiny-llama", "--data", "bundled", "--dtype", "int8"],
    ["serve", "--model", "tiny-llama", "--dtype", "int8"],
    ["generate", "--model", "tiny-llama", "--prompt", "hi", "--dtype", "int8"],
    ["export", "--model", "tiny-llama", "--to", "hf", "--output-dir", "{tmp}/x", "--dtype", "int8"],
    ["distill", "--teacher", "tiny-llama", "--student", "tiny-llama", "--data", "bundled", "--output-dir",
     "{tmp}/d", "--teacher-dtype", "int8"],
])
def test_a_bad_dtype_is_one_message_and_exit_2(tmp_path, argv):
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    res = CliRunner().invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in argv],
                             env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None})
    assert res.exit_code == 2, res.output
    assert res.output.count("error:") == 1 and "int8" in res.output and "Traceback" not in res.output, res.output
    assert "bf16" in res.output  # the message names the choices


def test_help_shows_the_flag_with_an_example():
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    for command in ("train", "serve", "export", "generate", "launch"):
        out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"}).output
        assert "--dtype" in out and "--dtype bf16" in out, command
    out = CliRunner().invoke(app, ["distill", "--help"], env={"COLUMNS": "400"}).output
    assert "--teacher-dtype bf16" in out and "--student-dtype" in out


# -- bench (off the CI tier): peak memory fp32 vs bf16 ------------------------------------------------

_PEAK = """
import json, sys, torch
from smolforge.config import DataSpec, PeftSpec, TrainConfig
kind, model, dtype, out = sys.argv[1:5]
torch.set_num_threads(2)
if kind == "lora":
    from smolforge.train.engine import train
    train(TrainConfig(model=model, data=DataSpec(path="bundled", max_length=128, max_eval_samples=4,
          max_samples=64), peft=PeftSpec(method="lora", r=8), output_dir=out, max_steps=4, batch_size=4,
          quiet=True, tensorboard=False, eval_accuracy=False, precision="fp32", dtype=dtype))
else:
    from smolforge.distill.teacher import GenSettings, HFTeacher, prompts_from_dataset
    HFTeacher(model, device="cpu", dtype=dtype).generate(prompts_from_dataset("bundled", max_samples=8),
                                                         GenSettings(max_new_tokens=16, top_k=32))
# VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's (pytest's, holding the models it built)
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss_mib": int(hwm.split()[1]) / 1024}))
"""


@pytest.fixture(scope="module")
def full_twin():
    """Qwen2.5-0.5B-Instruct's twin at the published shapes (494M parameters), stored in bf16 as the
    published checkpoint is; built once under SMOLFORGE_HOME (~1 GB)."""
    from smolforge.models.twins import twin_dir

    return twin_dir("twin:qwen2.5-0.5b-instruct@full")


@pytest.mark.bench
@pytest.mark.parametrize("kind", ["lora", "teacher"])
def test_bench_bf16_peak_memory(tmp_path, kind, full_twin):
    """Peak RSS of a whole LoRA run (4 steps) / teacher pass (8 prompts) on the full-size Qwen2.5-0.5B
    twin, loaded with --dtype fp32 and bf16 (BENCHMARKS.md, "Weights dtype")."""
    import subprocess
    import sys

    peaks = {}
    for dtype in ("fp32", "bf16"):
        proc = subprocess.run([sys.executable, "-c", _PEAK, kind, str(full_twin), dtype, str(tmp_path / dtype)],
                              capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-2000:]
        peaks[dtype] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mib"]
    print(f"{kind}: peak RSS fp32 {peaks['fp32']:.0f} MiB, bf16 {peaks['bf16']:.0f} MiB")
    assert peaks["bf16"] < peaks["fp32"]
