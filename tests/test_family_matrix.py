"""The families × features matrix (issue 30): every published-family twin through the features users
run on it, in process, each cell's outcome recorded.

A cell is ✔ when the feature ran and its check held, or the product's one-line refusal (a
SmolforgeError, exit 2) when it declines the family; anything else (a traceback, a failed check) is an
error the cell's test shows. The cells, per twin (`twin:<family>`, models/twins):
- train: `smolforge train` (the CLI in this process) with LoRA, 4 steps on generated rows: a finite
  loss and the adapter written;
- ddp-2-ranks: two gloo ranks (spawned processes) train the same LoRA run with `ddp`: their adapters equal
  one process's with the global batch;
- split: split learning over loopback gRPC (bottom and top here, the trunk in a server): its losses equal
  the same run in one piece (`split.local`);
- serve: the serve engine on the twin with that adapter merged: greedy tokens equal HF `generate`;
- serve-2-stages: the same model cut in 2 stages, each loading only its own tensors with the adapter
  merged into them (`models/stage_load.py`): the engine's greedy tokens equal the one-process engine's;
- distill: the twin as teacher (top-k logits into the store) and a LoRA student of the same twin trained
  from it: logit KD, a finite loss;
- distill-cross: the next family's twin as teacher (another tokenizer): the student falls back to
  sequence-level KD (the teacher's text) with its warning;
- export-hf / export-gguf / export-ollama: `smolforge export` with that adapter; GGUF at f16 is
  verified by the export itself in llama.cpp (greedy tokens equal HF's), Ollama writes the Modelfile
  with the family's TEMPLATE (verified again only when export-gguf refused: otherwise its GGUF is
  compared byte for byte with the one export-gguf verified).
The outcomes go to test-artifacts/family-matrix.json; scripts/family_matrix_table.py renders them as
the README's "Model families" table, and a test here keeps the README equal to that rendering.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

from smolforge.models.twins import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from family_matrix_table import ARTIFACT, CELLS, ERROR, OK, readme_table, render  # noqa: E402

pytestmark = pytest.mark.timeout(600)
# Cells the product refuses, with a text the refusal must contain (every other cell must be OK).
REFUSALS = {
    # GPT-2 publishes no chat template: a Modelfile would have no TEMPLATE.
    ("gpt2", "export-ollama"): "no chat template",
}
# The Modelfile format each family's published chat template must be written as (models/export/ollama.py).
FORMATS = {"qwen2.5-0.5b-instruct": "chatml", "llama-3.2-1b-instruct": "llama3.2",
           "tinyllama-1.1b-chat-v1.0": "zephyr", "smollm2-360m-instruct": "chatml",
           "phi-3-mini-4k-instruct": "phi3"}
SECONDS = ARTIFACT.with_name("family-matrix-seconds.json")  # per cell, to watch the module's CI budget
# The export's own llama.cpp check runs on this many chat prompts here (the product's default is 16, each
# ~2-3 s on a 150k-vocabulary twin: 86 of the module's 155 s were export-gguf). Every family's tokenizer
# texts are still compared, and 4 prompts x 8 greedy tokens still catch a wrongly written tensor or
# template; the 16-prompt default is tests/test_export.py's.
VERIFY_PROMPTS = 4


def _cli(argv: list[str]):
    """The CLI in this process, as tests/test_bad_input.py drives it: (exit code, stdout, stderr)."""
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    res = CliRunner().invoke(app, argv, env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None})
    if res.exit_code not in (0, 2) or (res.exit_code == 2 and not isinstance(res.exception, SystemExit)):
        raise AssertionError(f"{argv[0]} exited {res.exit_code}: {res.exception!r}\n{res.output[-3000:]}")
    return res.exit_code, res.stdout, res.stderr


def _refusal(stderr: str) -> str:
    """The refusal's first line (`error: what`), the text the matrix shows."""
    assert stderr.startswith("error:") and "Traceback" not in stderr and "fix:" in stderr, stderr[-2000:]
    return stderr.splitlines()[0].removeprefix("error:").strip()


def _rows(work: Path) -> Path:
    from smolforge.data.synthetic import generate

    data = work / "rows.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in generate(24, seed=0)))
    return data


def cell_train(family: str, work: Path) -> tuple[str, Path | None]:
    data = _rows(work)
    code, out, err = _cli(["train", "--model", f"twin:{family}", "--data", str(data), "--peft", "lora",
                           "--max-steps", "4", "--batch-size", "2", "--max-length", "96", "--lr", "5e-3",
                           "--seed", "0", "--device", "cpu", "--precision", "fp32", "--num-threads", "1",
                           "--no-tensorboard", "--output-dir", str(work / "train"), "--json"])
    if code:
        return _refusal(err), None
    summary = json.loads(out)
    assert summary["steps"] == 4 and math.isfinite(summary["final_loss"]), summary
    adapter = Path(summary["adapter_dir"])
    assert (adapter / "adapter_config.json").is_file() and any(adapter.glob("adapter_model.*")), sorted(adapter.iterdir())
    return OK, adapter


DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout")


def _deterministic(family: str, work: Path) -> str:
    """The twin with its dropout off (GPT-2 publishes 0.1): two ranks, or a split, draw other dropout masks
    than one process does, so equal weights need none. Every other key is the published config's."""
    import shutil

    src, dst = _twin_dir(family), work / "no-dropout"
    if not dst.exists():
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update({k: 0.0 for k in DROPOUT_KEYS if cfg.get(k)})
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(dst)


def _dp_cfg(family: str, work: Path, out: str, **kw) -> dict:
    cfg = {"model": _deterministic(family, work), "output_dir": str(work / out),
           "data": {"path": str(work / "rows.jsonl"), "max_eval_samples": 2, "max_length": 128},
           "max_steps": 2, "batch_size": 1, "grad_accum": 2, "lr": 5e-3, "seed": 3, "eval_every": 0,
           "max_new_tokens": 2, "device": "cpu", "precision": "fp32", "num_threads": 1, "quiet": True,
           "tensorboard": False, "eval_accuracy": False, "peft": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0}}
    return {**cfg, **kw}


def _dp_rank(rank: int, works: dict[str, Path]) -> dict[str, dict | str]:
    """One spawned ddp rank trains every family in turn (module level: spawn pickles it by name); one pair
    of processes for all families, since starting a process that imports torch costs more than a run."""
    from helpers import train_dict

    from smolforge.parallel.strategies import make_strategy

    out: dict[str, dict | str] = {}
    for family, work in works.items():
        try:
            out[family] = train_dict(_dp_cfg(family, work, "ddp"), make_strategy("ddp"))[0].to_dict()
        except Exception as exc:  # noqa: BLE001 - the family's cell shows it
            out[family] = f"{ERROR}{type(exc).__name__}: {str(exc)[:2000]}"
    return out


def _one_process(works: dict[str, Path]) -> dict[str, object]:
    """Each family's run in this process with the group's global batch (2 ranks x 1 row)."""
    from helpers import train_dict

    out: dict[str, object] = {}
    for family, work in works.items():
        try:
            out[family] = train_dict(_dp_cfg(family, work, "one", batch_size=2))[0]
        except Exception as exc:  # noqa: BLE001
            out[family] = f"{ERROR}{type(exc).__name__}: {str(exc)[:2000]}"
    return out


def run_ddp(works: dict[str, Path]) -> tuple[dict, dict]:
    """Both ranks' results and the one-process results, every family (see `_dp_rank`)."""
    from helpers import run_gloo_ranks

    return run_gloo_ranks(_dp_rank, 2, works, timeout=600, meanwhile=lambda: _one_process(works))


def cell_ddp(family: str, ranks: dict, one: dict) -> str:
    from helpers import adapter_weights, assert_same_weights

    r0, single = ranks[0][family], one[family]
    for got in (r0, ranks[1][family], single):
        if isinstance(got, str):
            return got
    assert r0["strategy"] == "ddp" and r0["steps"] == 2, r0
    assert_same_weights(adapter_weights(r0), adapter_weights(single), atol=1e-5)
    return OK


def cell_split(family: str, work: Path) -> str:
    from smolforge.config import DataSpec, PeftSpec
    from smolforge.data import load_splits
    from smolforge.models.loading import load_tokenizer
    from smolforge.split.local import build, train_local
    from smolforge.split.server import ServeConfig, serve
    from smolforge.split.trainer import SplitTrainConfig, train_split

    name, token = _deterministic(family, work), "matrix-token"
    tok = load_tokenizer(name)
    data = load_splits(DataSpec(path=str(work / "rows.jsonl"), max_samples=16, max_length=128, max_eval_samples=2), tok)
    server = serve(ServeConfig(model=name, split_point_1=1, split_point_2=2, lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                               port=0, token=token, num_threads=1, checkpoint_dir=str(work / "split-server")))
    try:
        cfg = SplitTrainConfig(model=name, split_point_1=1, split_point_2=2, server_port=server.port, token=token,
                               lora_rank=4, lora_alpha=8, lora_dropout=0.0, batch_size=2, gradient_accumulation_steps=1,
                               learning_rate=5e-3, warmup_steps=0, max_grad_norm=0.5, max_steps=2,
                               output_dir=str(work / "split"), num_threads=1, quiet=True, seed=3)
        result = train_split(cfg, splits=data, tokenizer=tok)
    finally:
        server.stop(0)
    local = build(name, PeftSpec(r=4, alpha=8, dropout=0.0), seed=3)
    ref = train_local(local, data.train, tok.pad_token_id, steps=2, batch_size=2, grad_accum=1, lr=5e-3,
                      warmup_steps=0, max_grad_norm=0.5, seed=3)
    assert len(result.losses) == 2 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(result.losses, ref.losses)), (
        result.losses, ref.losses)
    return OK


def _serve_prompts(tok) -> list[list[int]]:
    """Prompts of different lengths (left padding in one batch), one through the family's chat template
    (its special tokens, at ids far from zero)."""
    texts = ["What is 12 + 30?", "Reverse the word: smolforge, then say it twice please"]
    ids = [tok(t)["input_ids"] for t in texts]
    if tok.chat_template:
        chat = tok.apply_chat_template([{"role": "user", "content": texts[0]}], tokenize=False, add_generation_prompt=True)
        ids.append(tok(chat, add_special_tokens=False)["input_ids"])
    return ids


def cell_serve(family: str, adapter: Path) -> str:
    """The engine's greedy tokens, all prompts in one batch, equal HF `generate` on each alone; where HF
    goes on past an end token, the engine stopped there ("stop") and left it out."""
    from smolforge.serve.batch import DoneEvent, Request
    from smolforge.serve.engine import Engine
    from smolforge.serve.model import ServedModel
    from smolforge.serve.sampling import SamplingParams

    served = ServedModel.load(f"twin:{family}", str(adapter), name=family, device="cpu")
    prompts, done = _serve_prompts(served.tokenizer), {}
    Engine(served).run_batch([Request(ids, SamplingParams(max_tokens=12, temperature=0),
                                      (lambda i: lambda e: done.__setitem__(i, e) if isinstance(e, DoneEvent) else None)(i))
                              for i, ids in enumerate(prompts)])
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            hf = served.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       max_new_tokens=12, do_sample=False, pad_token_id=served.pad_id)
        want, got = hf[0, len(ids):].tolist(), done[i].token_ids
        stopped = len(got) < len(want) and want[len(got)] in served.eos_ids and done[i].finish_reason == "stop"
        assert got == want[: len(got)] and (got == want or stopped), f"prompt {i}: engine {got}, HF {want}"
    return OK


def _greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    from smolforge.serve.batch import DoneEvent, Request
    from smolforge.serve.engine import Engine
    from smolforge.serve.sampling import SamplingParams

    done: dict[int, DoneEvent] = {}
    Engine(model).run_batch([Request(ids, SamplingParams(max_tokens=12, temperature=0),
                                     (lambda i: lambda e: done.__setitem__(i, e) if isinstance(e, DoneEvent) else None)(i))
                             for i, ids in enumerate(prompts)])
    return [done[i].token_ids for i in range(len(prompts))]


def cell_serve_stages(family: str, adapter: Path) -> str:
    """Two stages in this process (the cluster places the same `StageServer`s as actors)."""
    from smolforge.serve.model import ServedModel
    from smolforge.serve.stages import local_stages, staged_model

    name = f"twin:{family}"
    single = ServedModel.load(name, str(adapter), name=family, device="cpu")
    layers = single.model.config.num_hidden_layers
    stages = local_stages(name, [0, layers // 2, layers], adapter=str(adapter))
    assert all(s.read.get("tensors") for s in stages), [s.read for s in stages]  # each read only its own
    prompts = _serve_prompts(single.tokenizer)
    got, want = _greedy(staged_model(name, stages), prompts), _greedy(single, prompts)
    assert got == want, f"2 stages {got}, one process {want}"
    return OK


def _distill(teacher: str, student: str, work: Path, data: Path) -> "object":
    from smolforge.config import PeftSpec
    from smolforge.distill.losses import KDConfig
    from smolforge.distill.shard_source import DirShardSource
    from smolforge.distill.student import StudentConfig, train_student
    from smolforge.distill.teacher import GenSettings, run_teacher_local

    store = work / "teacher_outputs"
    run_teacher_local(teacher, str(data), store, num_shards=1, max_samples=4, device="cpu",
                      settings=GenSettings(max_new_tokens=6, top_k=8, batch_size=4))
    cfg = StudentConfig(base_model=student, output_dir=str(work / "student"), max_steps=2, batch_size=2, lr=1e-3,
                        device="cpu", num_threads=1, peft=PeftSpec(method="lora", r=4, alpha=8, dropout=0.0),
                        kd=KDConfig(loss="forward_kl", kd_ratio=0.5), wait_timeout_s=60, poll_s=0.05,
                        precision="fp32")
    res = train_student(cfg, DirShardSource(store))
    assert res.steps == 2 and res.final_loss is not None and math.isfinite(res.final_loss) and res.adapter_dir, res
    return res


def cell_distill(family: str, work: Path) -> str:
    res = _distill(f"twin:{family}", f"twin:{family}", work / "distill", work / "rows.jsonl")
    assert res.mode == "logit" and not res.warnings, (res.mode, res.warnings)
    return OK


def cell_distill_cross(family: str, work: Path) -> str:
    names = list(FAMILIES)
    teacher = names[(names.index(family) + 1) % len(names)]
    with pytest.warns(UserWarning, match="sequence-level KD"):
        res = _distill(f"twin:{teacher}", f"twin:{family}", work / "distill-cross", work / "rows.jsonl")
    assert res.mode == "sequence" and res.warnings, (res.mode, res.warnings)
    return OK


def cell_export(family: str, adapter: Path, to: str, work: Path, gguf_verified: bool = False) -> str:
    """`smolforge export`; Ollama skips the llama.cpp check only when export-gguf has just verified the
    same GGUF (checked byte for byte below), so a GGUF the check refuses is refused here too."""
    argv = ["export", "--model", f"twin:{family}", "--adapter", str(adapter), "--to", to,
            "--output-dir", str(work / f"export-{to}"), "--json"]
    code, out, err = _cli(argv + (["--no-verify"] if gguf_verified else []))
    if code:
        return _refusal(err)
    summary = json.loads(out)
    if to == "hf":
        from transformers import AutoConfig

        merged = work / "export-hf"
        assert any(merged.glob("*.safetensors")) and (merged / "tokenizer.json").is_file(), sorted(merged.iterdir())
        assert AutoConfig.from_pretrained(merged).model_type == AutoConfig.from_pretrained(_twin_dir(family)).model_type
    elif to == "gguf":
        v = summary["verify"]
        assert v["prompts"] == VERIFY_PROMPTS and v["ok"] and v["tokenization_equal"] and v["greedy_agreement_with_ties"] == 1.0, v
    else:
        modelfile = (work / "export-ollama" / "Modelfile").read_text()
        assert 'TEMPLATE """' in modelfile and summary["ollama"]["chat_format"] == FORMATS[family], summary
        if gguf_verified:
            gguf = [(work / d / "model.gguf").read_bytes() for d in ("export-gguf", "export-ollama")]
            assert gguf[0] == gguf[1], "the Ollama export's GGUF is not the one export-gguf verified"
    return OK


def _twin_dir(family: str) -> Path:
    from smolforge.models.twins import twin_dir

    return twin_dir(f"twin:{family}")


def _guarded(seconds: dict, cell: str, run, *args):
    """A cell's outcome; an exception other than the product's refusal is kept as the cell's error,
    so one broken cell shows in its own test and does not hide the others."""
    t0 = time.perf_counter()
    try:
        return run(*args)
    except Exception as exc:  # noqa: BLE001 - recorded, and failed by test_cell with its text
        return f"{ERROR}{type(exc).__name__}: {str(exc)[:2000]}"
    finally:
        seconds[cell] = round(time.perf_counter() - t0, 1)


def run_family(family: str, work: Path, seconds: dict, ddp: tuple[dict, dict]) -> dict[str, str]:
    """Every cell of one family; a cell that needs the adapter is not run when training refused."""
    trained = _guarded(seconds, "train", cell_train, family, work)
    outcome, adapter = trained if isinstance(trained, tuple) else (trained, None)
    row = {"train": outcome}
    row["ddp-2-ranks"] = _guarded({}, "ddp-2-ranks", cell_ddp, family, *ddp)
    row["split"] = _guarded(seconds, "split", cell_split, family, work)
    if adapter is None:
        return {**row, **{c: "needs the train cell" for c in CELLS if c not in row}}
    row["serve"] = _guarded(seconds, "serve", cell_serve, family, adapter)
    row["serve-2-stages"] = _guarded(seconds, "serve-2-stages", cell_serve_stages, family, adapter)
    row["distill"] = _guarded(seconds, "distill", cell_distill, family, work)
    row["distill-cross"] = _guarded(seconds, "distill-cross", cell_distill_cross, family, work)
    for to in ("hf", "gguf", "ollama"):
        row[f"export-{to}"] = _guarded(seconds, f"export-{to}", cell_export, family, adapter, to, work,
                                       to == "ollama" and row["export-gguf"] == OK)
    return row


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, dict[str, str]]:
    """All families' outcomes (any selection of this module's tests needs them all for the table)."""
    from test_export import require_llama_cpp

    require_llama_cpp()
    from functools import partial

    from smolforge.models.export import verify

    patch = pytest.MonkeyPatch()
    patch.setattr(verify, "verify_gguf", partial(verify.verify_gguf, count=VERIFY_PROMPTS))  # see VERIFY_PROMPTS
    try:
        return _run_matrix(tmp_path_factory)
    finally:
        patch.undo()


def _run_matrix(tmp_path_factory) -> dict[str, dict[str, str]]:
    seconds: dict[str, dict] = {f: {} for f in FAMILIES}
    works = {f: tmp_path_factory.mktemp(f.replace(".", "_")) for f in FAMILIES}
    t0 = time.perf_counter()
    for f, work in works.items():  # made here once, not by two ranks at once
        _rows(work), _deterministic(f, work)
    ddp = run_ddp(works)
    for f in FAMILIES:  # one pair of ranks trained every family: its time, shared
        seconds[f]["ddp-2-ranks"] = round((time.perf_counter() - t0) / len(FAMILIES), 1)
    result = {f: run_family(f, works[f], seconds[f], ddp) for f in FAMILIES}
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    SECONDS.write_text(json.dumps(seconds, indent=2) + "\n", encoding="utf-8")
    return result


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cell(matrix, family, cell):
    got, refusal = matrix[family][cell], REFUSALS.get((family, cell))
    if refusal is None:
        assert got == OK, f"{family} × {cell}: {got}"
    else:
        assert refusal in got, f"{family} × {cell}: expected a refusal naming {refusal!r}, got {got!r}"


def test_readme_table_is_the_rendered_matrix(matrix):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_table(readme) == render(matrix), (
        "README's Model families table differs from the matrix: run tests/test_family_matrix.py, then "
        "python scripts/family_matrix_table.py --write")


def test_train_refuses_rows_whose_answer_max_length_cuts_off(tmp_path):
    """Qwen2.5's template adds a long default system prompt: at --max-length 32 no row keeps an answer
    token. That was a ZeroDivisionError in the step sampler; it is one message and exit 2."""
    from smolforge.data.synthetic import generate

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(8, seed=0)))
    code, _, err = _cli(["train", "--model", "twin:qwen2.5-0.5b-instruct", "--data", str(data), "--max-steps", "1",
                         "--max-length", "32", "--output-dir", str(tmp_path / "out"), "--quiet"])
    assert code == 2 and "no training example keeps an answer token within max_length 32" in _refusal(err), err
    assert "--max-length" in err.split("fix:", 1)[1]


def test_trains_cheap_check_names_a_twin_without_building_it(tmp_path, monkeypatch):
    """`smolforge train` checks the model before torch loads: a twin's name is checked there (an unknown
    one lists the known twins), its build (torch, seconds) waits for the engine."""
    from smolforge.cli.train import check_model_and_data
    from smolforge.config import TrainConfig
    from smolforge.errors import SmolforgeError

    monkeypatch.setenv("SMOLFORGE_HOME", str(tmp_path / "home"))
    cfg = lambda model: TrainConfig.model_validate({"model": model, "data": {"path": "bundled"}})  # noqa: E731
    assert check_model_and_data(cfg("twin:gpt2"))[0]  # the bundled rows, read
    assert not (tmp_path / "home" / "twins").exists(), "the cheap check built the twin (torch) before the engine"
    with pytest.raises(SmolforgeError, match="twin:phi-3-mini-4k-instruct"):
        check_model_and_data(cfg("twin:gpt-7"))
