"""The families × features matrix (issue 30): every published-family twin through the features users
run on it, in process, each cell's outcome recorded.

A cell is ✔ when the feature ran and its check held, or the product's one-line refusal (a
SmolforgeError, exit 2) when it declines the family; anything else (a traceback, a failed check) is an
error the cell's test shows. The cells, per twin (`twin:<family>`, models/twins):
- train: `smolforge train` (the CLI in this process) with LoRA, 4 steps on generated rows: a finite
  loss and the adapter written;
- serve: the serve engine on the twin with that adapter merged: greedy tokens equal HF `generate`;
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
    # The GGUF exporter writes llama, qwen2 and gpt2 only (Phi-3's fused qkv_proj / gate_up_proj: not yet).
    ("phi-3-mini-4k-instruct", "export-gguf"): "not 'phi3'",
    ("phi-3-mini-4k-instruct", "export-ollama"): "not 'phi3'",
}
# The Modelfile format each family's published chat template must be written as (models/export/ollama.py).
FORMATS = {"qwen2.5-0.5b-instruct": "chatml", "llama-3.2-1b-instruct": "llama3.2",
           "tinyllama-1.1b-chat-v1.0": "zephyr", "smollm2-360m-instruct": "chatml"}
SECONDS = ARTIFACT.with_name("family-matrix-seconds.json")  # per cell, to watch the module's CI budget


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


def cell_train(family: str, work: Path) -> tuple[str, Path | None]:
    from smolforge.data.synthetic import generate

    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(24, seed=0)))
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
        assert v["ok"] and v["tokenization_equal"] and v["greedy_agreement_with_ties"] == 1.0, v
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


def run_family(family: str, work: Path, seconds: dict) -> dict[str, str]:
    """Every cell of one family; a cell that needs the adapter is not run when training refused."""
    trained = _guarded(seconds, "train", cell_train, family, work)
    outcome, adapter = trained if isinstance(trained, tuple) else (trained, None)
    row = {"train": outcome}
    if adapter is None:
        return {**row, **{c: "needs the train cell" for c in CELLS[1:]}}
    row["serve"] = _guarded(seconds, "serve", cell_serve, family, adapter)
    for to in ("hf", "gguf", "ollama"):
        row[f"export-{to}"] = _guarded(seconds, f"export-{to}", cell_export, family, adapter, to, work,
                                       to == "ollama" and row["export-gguf"] == OK)
    return row


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, dict[str, str]]:
    """All families' outcomes (any selection of this module's tests needs them all for the table)."""
    from test_export import require_llama_cpp

    require_llama_cpp()
    seconds: dict[str, dict] = {f: {} for f in FAMILIES}
    result = {f: run_family(f, tmp_path_factory.mktemp(f.replace(".", "_")), seconds[f]) for f in FAMILIES}
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
