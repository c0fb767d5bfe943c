"""Rendering checked against the messages (issue 41, item 3): no message's text is lost silently.

- A system turn under a template without a system role (the Phi-3 twin's published template drops it)
  is folded into the user turn after it, `system + "\\n\\n" + user`, with one count line per run;
  `smolforge data show` shows the folded row, as training encodes it.
- A template that raises (Gemma 2's published template, "System role not supported", on a system turn
  with no user turn to fold into) is a bad line: `file:line`, the template's words, exit 2;
  `--skip-bad-lines` skips and counts it and the run goes on.
- Another loss (a turn the template leaves out) is a bad line too.
- `data show --json` marks exactly the assistant turns' tokens as trained.

Tokenizers only (the phi-3 twin, built once per session), except one 1-step train run on a copy of the
tiny-llama preset that carries Gemma 2's template (there is no gemma twin).
"""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from smolforge.models import load_tokenizer
from smolforge.models.chat_templates import TEMPLATES
from smolforge.models.families import abilities
from smolforge.models.tiny import preset_dir
from tests.helpers import write_jsonl

PHI3 = "twin:phi-3-mini-4k-instruct"
FOLDED = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2?"},
                       {"role": "assistant", "content": "4"}]}
TWO_TURNS = {"messages": [{"role": "user", "content": "What is 3+3?"}, {"role": "assistant", "content": "6"},
                          {"role": "user", "content": "and 4+4?"}, {"role": "assistant", "content": "8"}]}
# Gemma 2's template refuses a leading system turn; with no user turn after it, it cannot be folded
REFUSED = {"messages": [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "Hello!"}]}
TOOL_DROPPED = {"messages": [{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny, 21C"},
                             {"role": "assistant", "content": "Sunny."}]}


def _cli(*argv: str):
    from smolforge.cli.main import app

    return CliRunner().invoke(app, list(argv))


@pytest.fixture(scope="module")
def gemma_kind(tmp_path_factory):
    """The tiny-llama preset with Gemma 2's published chat template (models/chat_templates.py)."""
    where = tmp_path_factory.mktemp("gemma-kind") / "model"
    shutil.copytree(preset_dir("tiny-llama"), where)
    tok = load_tokenizer(str(where))
    tok.chat_template = TEMPLATES["gemma-2"]
    tok.save_pretrained(where)
    assert abilities(load_tokenizer(str(where))).system is False
    return where


def test_data_show_help_has_an_example():
    result = _cli("data", "show", "--help")
    assert result.exit_code == 0 and "Example: smolforge data show --model" in result.stdout


def test_data_show_folds_the_system_turn_and_counts_it(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [FOLDED, TWO_TURNS])
    result = _cli("data", "show", "--model", PHI3, "--data", str(data), "-n", "2")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "be brief\n\nWhat is 2+2?" in out  # the system text is in the row training sees
    assert out.count("folded the system turn into the first user turn in 1 row: "
                     f"the template of {PHI3} has no system role") == 1
    assert f"row 1: {data}:1" in out and f"row 2: {data}:2" in out and "legend: [[trained]]" in out


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The row's trained tokens, one list per contiguous run."""
    runs: list[list[int]] = []
    for i, (token, m) in enumerate(zip(ids, mask)):
        if m:
            (runs[-1].append(token) if i and mask[i - 1] else runs.append([token]))
    return runs


@pytest.mark.parametrize("model", [PHI3, "tiny-llama"])  # Phi-3 opens the assistant turn with the user's; ChatML apart
def test_data_show_json_marks_exactly_the_assistant_tokens(tmp_path, model):
    data = write_jsonl(tmp_path / "d.jsonl", [FOLDED, TWO_TURNS])
    result = _cli("data", "show", "--model", model, "--data", str(data), "--json")
    assert result.exit_code == 0, result.output
    view = json.loads(result.stdout)
    tok = load_tokenizer(model)
    eot = abilities(tok).end_of_turn
    assert len(view["rows"]) == 2 and view["folded_system"] == (0 if abilities(tok).system else 1)
    for row, record in zip(view["rows"], (FOLDED, TWO_TURNS)):
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(ids) == len(mask) and row["text"] == tok.decode(ids, skip_special_tokens=False)
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        # one trained run per assistant turn: its text and the end of turn, nothing of the prompt or the header
        runs = [tok.decode(run, skip_special_tokens=False) for run in _runs(ids, mask)]
        assert [run.replace(eot, "").strip() for run in runs] == answers and all(eot in run for run in runs)
        masked = tok.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False)
        assert all(m["content"] in masked for m in record["messages"] if m["role"] != "assistant")


def test_a_turn_the_template_leaves_out_is_a_bad_line(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [FOLDED, TOOL_DROPPED])
    result = _cli("data", "show", "--model", PHI3, "--data", str(data))
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert f"error: {data}:2: the tool turn 'sunny, 21C' does not reach the rendered row" in result.stderr
    skipped = _cli("data", "show", "--model", PHI3, "--data", str(data), "--skip-bad-lines", "--json")
    view = json.loads(skipped.stdout)
    assert [r["source"] for r in view["rows"]] == [f"{data}:1"] and len(view["skipped"]) == 1


def test_train_names_the_line_a_template_refuses(tmp_path, gemma_kind):
    data = write_jsonl(tmp_path / "d.jsonl", [FOLDED, REFUSED, TWO_TURNS])
    result = _cli("train", "--model", str(gemma_kind), "--data", str(data), "--max-steps", "1", "--num-threads", "1",
                  "--output-dir", str(tmp_path / "run"))
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr.startswith(f"error: {data}:2: the chat template refuses this record: System role not supported")
    assert "--skip-bad-lines" in result.stderr and "Traceback" not in result.output


def test_skip_bad_lines_skips_the_refused_line_and_trains(tmp_path, gemma_kind):
    data = write_jsonl(tmp_path / "d.jsonl", [FOLDED, REFUSED, TWO_TURNS, TWO_TURNS])
    args = ["train", "--model", str(gemma_kind), "--data", str(data), "--max-steps", "1", "--batch-size", "2",
            "--max-length", "128", "--num-threads", "1", "--set", "data.eval_fraction=0", "--skip-bad-lines"]
    result = _cli(*args, "--no-tensorboard", "--output-dir", str(tmp_path / "run"))  # in process: 1 thread, as here
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())  # the log wraps at the terminal's width
    assert said.count(f"folded the system turn into the first user turn in 1 row: the template of {gemma_kind} "
                      "has no system role") == 1
    assert "3 train / 0 eval sequences (chat); truncated 0, skipped lines 1" in said
    assert (tmp_path / "run" / "lora_adapter").is_dir()


def test_teachers_and_the_server_ask_a_system_less_template_as_training_folds_it():
    """A system prompt reaches a Phi-3 teacher and the server as it reaches training: folded into the first
    user turn (before issue 41 the teachers and serve rendered it away silently). The teachers'
    `prompt_ids` and serve's chat rendering share `train.rendering.render_prompt`; called here on the
    tokenizer alone (no weights: the methods read only `self.tokenizer`)."""
    from types import SimpleNamespace

    from smolforge.distill.prompts import PromptItem
    from smolforge.distill.teacher import HFTeacher
    from smolforge.distill.teacher_llamacpp import LlamaCppTeacher
    from smolforge.models.loading import load_tokenizer
    from smolforge.train.rendering import render_prompt

    tok = load_tokenizer(PHI3)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2"}]
    text = render_prompt(tok, messages)
    assert "be brief" in text and text.index("be brief") < text.index("what is 2+2")
    assert "be brief" not in tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    item = PromptItem(0, messages, None)
    for teacher in (HFTeacher, LlamaCppTeacher):
        ids = teacher.prompt_ids(SimpleNamespace(tokenizer=tok), item)
        assert "be brief" in tok.decode(ids), teacher.__name__
