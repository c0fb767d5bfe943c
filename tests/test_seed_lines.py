"""The seed documents' command lines, copied with only the program and the model names changed (gpt2 ->
tiny-gpt2, Qwen/Qwen2-0.5B -> tiny-qwen2, TinyLlama/… -> tiny-llama, meta-llama/Llama-2-13b-hf ->
small-llama): each is read through the seed spellings (`smolforge.cli.aliases`) into the settings it
means, asserted here value by value, or refused with one message naming what has no counterpart.

Sources: SplitLearn's `examples/README.md` (start_trunk_server.py, train_lora_distributed.py), SOLLOL /
LlamaForge's `TEACHER_STUDENT_GUIDE.md` and `DISTRIBUTED_TRAINING.md` (llamaforge_node.py,
launch_distributed_training.py), SmolCluster's `--override training.KEY=VALUE`.

Each command's work (the trunk server, the split client, the job submission, the worker join) is
replaced by a recorder: the settings are what the command would have run with."""

from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

ENV = {"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None, "SMOLFORGE_SPLIT_TOKEN": None}

# (id, the line after the program name, what it must mean: settings, or an error needle)
SPLITLEARN = [
    ("trunk-gpt2", "split serve --model-type gpt2 --model-name tiny-gpt2 --split-point-1 0 --split-point-2 6 "
     "--use-lora --lora-rank 8 --device cuda --port 50051",
     dict(model="tiny-gpt2", split_point_1=0, split_point_2=6, use_lora=True, lora_rank=8, device="cuda", port=50051)),
    ("trunk-qwen2", "split serve --model-type qwen2 --model-name tiny-qwen2 --split-point-1 0 --split-point-2 14 "
     "--use-lora --lora-rank 8 --device cuda --port 50051",
     dict(model="tiny-qwen2", split_point_2=14, use_lora=True, lora_rank=8, device="cuda")),
    ("trunk-ex2-rank16", "split serve --model-type qwen2 --model-name tiny-qwen2 --split-point-1 0 --split-point-2 14 "
     "--use-lora --lora-rank 16 --device cuda", dict(model="tiny-qwen2", lora_rank=16, port=50051)),
    ("trunk-ex3-remote", "split serve --model-type qwen2 --model-name tiny-qwen2 --split-point-1 0 --split-point-2 14 "
     "--host 0.0.0.0 --port 50051 --use-lora --device cuda", dict(host="0.0.0.0", port=50051, device="cuda")),
    ("client-gpt2-wikitext", "split train --model-type gpt2 --model-name tiny-gpt2 --split-point-1 0 --split-point-2 6 "
     "--server-host localhost --server-port 50051 --lora-rank 8 --batch-size 4 --learning-rate 1e-4 --num-epochs 3 "
     "--dataset-name wikitext --dataset-config wikitext-2-raw-v1 --max-train-samples 1000 --device cuda "
     "--output-dir ./checkpoints/gpt2_lora",
     # not cached here: refused with the command that caches it (cached, it trains: test_hub_datasets.py)
     "dataset wikitext (wikitext-2-raw-v1) split train is not in the local Hugging Face cache"),
    ("client-qwen2", "split train --model-type qwen2 --model-name tiny-qwen2 --split-point-1 0 --split-point-2 14 "
     "--server-host localhost --server-port 50051 --lora-rank 8 --batch-size 4 --learning-rate 1e-4 --num-epochs 3 "
     "--device cuda --output-dir ./checkpoints/qwen2_lora",
     dict(model="tiny-qwen2", split_point_1=0, split_point_2=14, server_host="localhost", server_port=50051,
          lora_rank=8, batch_size=4, learning_rate=1e-4, num_epochs=3.0, device="cuda",
          output_dir="./checkpoints/qwen2_lora", dataset="bundled")),
    ("client-ex1", "split train --model-type gpt2 --model-name tiny-gpt2 --split-point-1 0 --split-point-2 6 "
     "--lora-rank 8 --batch-size 8 --learning-rate 2e-4 --num-epochs 3 --max-train-samples 5000 "
     "--gradient-accumulation-steps 2 --device cuda",
     dict(model="tiny-gpt2", batch_size=8, learning_rate=2e-4, max_train_samples=5000, gradient_accumulation_steps=2)),
    ("client-ex2", "split train --model-type qwen2 --model-name tiny-qwen2 --split-point-1 0 --split-point-2 14 "
     "--lora-rank 16 --batch-size 4 --learning-rate 1e-4 --num-epochs 3 --max-train-samples 10000 "
     "--gradient-accumulation-steps 4 --mixed-precision --device cuda",
     dict(lora_rank=16, max_train_samples=10000, gradient_accumulation_steps=4, mixed_precision=True)),
    ("client-ex3-remote", "split train --model-type qwen2 --model-name tiny-qwen2 --split-point-1 0 --split-point-2 14 "
     "--server-host 192.168.1.100 --server-port 50051 --device cuda",
     dict(server_host="192.168.1.100", server_port=50051, token=None)),
]
SOLLOL = [
    ("node-teacher", "worker join --name teacher-gpu-01 --sollol-host 192.168.1.100 --sollol-port 5000",
     dict(coordinator="192.168.1.100:5000", name="teacher-gpu-01")),
    ("node-remote", "worker join --sollol-host 192.168.1.100", dict(coordinator="192.168.1.100")),
    ("launch-3-workers", "launch --model tiny-llama --dataset examples/datasets/claude_ultimate_with_tools_621k.jsonl "
     "--epochs 1 --batch-size 2 --max-length 512 --workers 3 --mode data_parallel",
     {"num_workers": 3, "train.model": "tiny-llama", "train.epochs": 1.0, "train.batch_size": 2,
      "train.data.max_length": 512, "train.data.path": "examples/datasets/claude_ultimate_with_tools_621k.jsonl"}),
    ("launch-lora-r", "launch --model tiny-llama --dataset examples/datasets/code_alpaca_full.jsonl --workers 2 "
     "--lora-r 16", {"num_workers": 2, "train.peft.r": 16}),
    ("launch-teacher-student", "launch --model small-llama --dataset "
     "examples/datasets/claude_ultimate_with_tools_621k.jsonl --workers 4 --mode teacher_student",
     "--mode teacher_student needs a student model, and no node holds a smaller model of the family of small-llama"),
]
SMOLCLUSTER = [
    ("override-learning-rate", "launch --model tiny-llama --dataset bundled --override training.learning_rate=3e-4",
     {"train.lr": 3e-4}),
    ("override-epochs", "launch --model tiny-llama --dataset bundled --override training.num_epochs=2",
     {"train.epochs": 2}),
]
LINES = SPLITLEARN + SOLLOL + SMOLCLUSTER


class Recorded(Exception):
    """What a command would have run with (raised by the recorders, so nothing runs)."""


@pytest.fixture
def record(monkeypatch, tmp_path):
    """Replace each command's work with a recorder of its settings."""
    import smolforge.cli.launch as launch
    import smolforge.cluster.face as face
    import smolforge.split.server as server
    import smolforge.split.trainer as trainer

    seen: dict = {}
    (tmp_path / "empty-hub").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))  # the machine's own models stay out

    def keep(**what):
        seen.update(what)
        return SimpleNamespace(describe=lambda: "recorded", wait=lambda: None, stop=lambda *_: None,
                               run=lambda: 0, steps=0, final_loss=0.0, adapter_dir="-")

    monkeypatch.setattr(server, "serve", lambda cfg, **_: keep(**vars(cfg)))
    monkeypatch.setattr(trainer, "train_split", lambda cfg: keep(**cfg.model_dump()))
    from smolforge.cluster.control.kinds import parse  # the job as the coordinator would take it

    monkeypatch.setattr(launch, "_submit_and_follow", lambda spec, *_, **__: keep(spec=parse(spec).model_dump()))
    monkeypatch.setattr(face, "WorkerNode", lambda opts, **_: keep(**vars(opts)))
    return seen


def _value(seen: dict, key: str):
    node = seen["spec"] if "spec" in seen else seen
    for part in key.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize("line,means", [row[1:] for row in LINES], ids=[row[0] for row in LINES])
def test_a_seed_line_means_what_the_seed_says(line, means, record, tmp_path, monkeypatch):
    from smolforge.cli.main import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, shlex.split(line), env=ENV)
    if isinstance(means, str):
        assert result.exit_code == 2 and means in result.stderr, (result.exit_code, result.output[-2000:])
        assert result.stderr.count("error:") == 1 and "\n  fix:" in result.stderr and "Traceback" not in result.output
        return
    assert result.exit_code == 0, (result.exit_code, result.exception, result.output[-2000:])
    got = {key: _value(record, key) for key in means}
    assert got == means


def test_seed_spellings_are_listed_in_help():
    from smolforge.cli.main import app

    out = CliRunner().invoke(app, ["split", "train", "--help"], env={**ENV, "COLUMNS": "200"}).output
    assert "Seed spellings" in out and "--model-name" in out and "--dataset-name" in out
    out = CliRunner().invoke(app, ["worker", "join", "--help"], env={**ENV, "COLUMNS": "200"}).output
    assert "--sollol-host" in out and "--sollol-port" in out


REFUSED = [  # (id, argv, the one message)
    ("model-type of another family", "split serve --model-type llama --model-name tiny-gpt2 --split-point-1 0 "
     "--split-point-2 2", "--model-type llama, but tiny-gpt2 is a gpt2 model"),
    ("unknown model-type", "split serve --model-type gtp2 --model-name tiny-gpt2 --split-point-1 0 --split-point-2 2",
     "did you mean 'gpt2'?"),
    ("model-type without a model", "split serve --model-type qwen2 --split-point-1 0 --split-point-2 14",
     "--model-type qwen2 names a family, not a model"),
    ("a seed key close to a seed's name", "launch --model tiny-llama --dataset bundled --set training.learning_rat=3e-4",
     "did you mean 'lr'? the seeds' 'learning_rate'"),
]


@pytest.mark.parametrize("line,needle", [row[1:] for row in REFUSED], ids=[row[0] for row in REFUSED])
def test_a_seed_spelling_without_a_counterpart_is_one_message(line, needle, record):
    from smolforge.cli.main import app

    result = CliRunner().invoke(app, shlex.split(line), env=ENV)
    assert result.exit_code == 2 and needle in result.stderr, (result.exit_code, result.output[-2000:])
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.output


def test_the_trunk_line_as_written_runs_to_the_device_on_this_machine(tmp_path, monkeypatch):
    """Not recorded: the SplitLearn trunk line runs for real. Every flag is read; on a machine without
    CUDA it ends at the seed's own `--device cuda` with one message (a GPU machine starts serving)."""
    import torch

    from smolforge.cli.main import app

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the line starts a server (covered by the recorded rows)")
    monkeypatch.chdir(tmp_path)
    line = shlex.split(SPLITLEARN[0][1].replace("--port 50051", "--port 0"))
    result = CliRunner().invoke(app, line, env=ENV)
    assert result.exit_code == 2 and "--device cuda asked for, but no CUDA GPU is visible" in result.stderr, \
        result.output[-2000:]


def _cached(cache, name: str, config: dict) -> None:
    """A model in a Hugging Face cache layout (models--org--name/snapshots/<rev>/config.json)."""
    snap = cache / f"models--{name.replace('/', '--')}" / "snapshots" / "0"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))


@pytest.mark.soak  # sizes build models on the meta device: importing the model classes costs ~20 s under load
def test_teacher_student_without_student_takes_the_teacher_family_s_smallest_held_model(record, tmp_path, monkeypatch):
    """SOLLOL's line names no student: the smallest model of the teacher's family that a node holds is the
    student (here the embedded cluster's one node: this machine's HF cache), said as the plan's first line;
    a smaller model of another family and a bigger one of the teacher's are passed over."""
    from smolforge.cli.main import app

    llama = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024)
    cache = tmp_path / "hub"
    _cached(cache, "org/mini-llama", llama)
    _cached(cache, "org/big-llama", {**llama, "hidden_size": 512, "num_hidden_layers": 8})
    _cached(cache, "org/nano-gpt2", dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=1024))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    line = SOLLOL[-1][1]
    (tmp_path / line.split("--dataset ")[1].split()[0]).parent.mkdir(parents=True)
    (tmp_path / line.split("--dataset ")[1].split()[0]).write_text('{"text": "hello"}\n')
    result = CliRunner().invoke(app, shlex.split(line), env={**ENV, "HF_HUB_CACHE": str(cache)})
    assert result.exit_code == 0, (result.exception, result.output[-2000:])
    assert record["spec"]["distill"]["students"] == ["org/mini-llama"]
    assert "plan: student org/mini-llama" in result.stderr and "the smallest model of the teacher's family" in result.stderr


def test_the_client_line_finds_the_token_the_trunk_line_wrote(record, tmp_path, monkeypatch):
    """The seeds' two lines name no token: `split serve` writes one for its clients ($SMOLFORGE_HOME/
    split/token), and `split train` to a server on this machine reads it; to another machine, not."""
    from smolforge.cli.main import app

    monkeypatch.setenv("SMOLFORGE_HOME", str(tmp_path))
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "token").write_text("t0ken-written-by-serve\n")
    monkeypatch.chdir(tmp_path)
    local = CliRunner().invoke(app, shlex.split(dict((r[0], r[1]) for r in SPLITLEARN)["client-qwen2"]), env=ENV)
    assert local.exit_code == 0 and record["token"] == "t0ken-written-by-serve", local.output[-2000:]
    assert "using the token `split serve` wrote" in local.stderr
    record.clear()
    remote = CliRunner().invoke(app, shlex.split(dict((r[0], r[1]) for r in SPLITLEARN)["client-ex3-remote"]), env=ENV)
    assert remote.exit_code == 0 and record["token"] is None, remote.output[-2000:]
