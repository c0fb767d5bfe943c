"""Data formats, masking, truncation, packing, and the bad-input messages."""

from __future__ import annotations

import pytest

from smolforge.config import DataSpec
from smolforge.data import load_splits, read_examples
from smolforge.data.encode import IGNORE, encode_all, encode_example, prompt_text
from smolforge.data.formats import Example
from smolforge.data.synthetic import bundled_paths, generate
from smolforge.errors import SmolforgeError
from smolforge.models import load_tokenizer
from tests.helpers import smolforge, write_jsonl

ALPACA = [{"instruction": "Add", "input": "2 and 3", "output": "5"}, {"instruction": "Say hi", "output": "hi"}]
CHAT = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                      {"role": "assistant", "content": "6"}]}]
PC = [{"prompt": "What is 1 + 1?", "completion": "2"}]
TEXT = [{"text": "the cat sat on the mat"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


@pytest.mark.parametrize("records,fmt", [(ALPACA, "alpaca"), (CHAT, "chat"), (PC, "prompt_completion"), (TEXT, "text")])
def test_each_format_is_detected_and_normalised(tmp_path, records, fmt):
    res = read_examples(write_jsonl(tmp_path / "d.jsonl", records))
    assert res.format == fmt
    assert len(res.examples) == len(records)
    assert res.examples[0].source.endswith("d.jsonl:1")
    if fmt == "text":
        assert res.examples[0].text == "the cat sat on the mat" and res.examples[0].answer is None
    else:
        assert res.examples[0].messages[-1]["role"] == "assistant"


def test_alpaca_input_joins_instruction(tmp_path):
    ex = read_examples(write_jsonl(tmp_path / "d.jsonl", ALPACA)).examples[0]
    assert ex.messages[0]["content"] == "Add\n\n2 and 3" and ex.answer == "5"


def test_forced_format_rejects_other_shapes(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", PC)
    with pytest.raises(SmolforgeError, match='missing field "text"'):
        read_examples(path, "text")


def test_loss_covers_only_assistant_tokens(tok):
    ex = Example("x:1", messages=CHAT[0]["messages"])
    ids, labels = encode_example(tok, ex)
    assert len(ids) == len(labels)
    target = tok.decode([t for t in labels if t != IGNORE])
    assert target == "4<|im_end|>\n6<|im_end|>\n"
    # The whole sequence decodes to exactly the rendered template: no tokens lost at the seams.
    assert tok.decode(ids) == tok.apply_chat_template(CHAT[0]["messages"], tokenize=False)


def test_text_format_trains_on_everything(tok):
    ids, labels = encode_example(tok, Example("x:1", text="hello world"))
    assert ids == labels and ids[-1] == tok.eos_token_id


def test_prompt_text_ends_with_generation_prompt(tok):
    ex = Example("x:1", messages=PC and [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert prompt_text(tok, ex).endswith("<|im_start|>assistant\n")


def test_truncation_is_counted_and_empty_targets_dropped(tok):
    long = Example("x:1", messages=[{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}])
    short = Example("x:2", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 50}])
    rows, stats = encode_all(tok, [long, short], max_length=32)
    assert stats.truncated == 2
    assert stats.dropped_no_target == 1  # the long prompt left no response tokens
    assert len(rows) == 1 and len(rows[0]["input_ids"]) == 32


def test_packing_fills_sequences(tok):
    exs = [Example(f"x:{i}", messages=[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}])
           for i in range(20)]
    plain, _ = encode_all(tok, exs, max_length=64)
    packed, stats = encode_all(tok, exs, max_length=64, packing=True)
    assert len(packed) < len(plain)
    assert all(len(r["input_ids"]) <= 64 for r in packed)
    assert sum(len(r["input_ids"]) for r in packed) == sum(len(r["input_ids"]) for r in plain)
    assert stats.sequences == len(packed)


def test_bundled_split_is_disjoint_and_answerable(tok):
    train_p, eval_p = bundled_paths()
    train = {e.messages[0]["content"] for e in read_examples(train_p).examples}
    held = read_examples(eval_p).examples
    assert not train & {e.messages[0]["content"] for e in held}
    assert all(e.answer for e in held)
    splits = load_splits(DataSpec(path="bundled", max_eval_samples=50), tok)
    assert len(splits.eval_examples) == 50 and splits.stats["train_sequences"] > 1000


def test_generated_tasks_are_correct():
    for rec in generate(300, seed=5):
        p, a = rec["prompt"], rec["completion"]
        if p.startswith("What is") and "+" in p:
            x, y = p[len("What is "):-1].split(" + ")
            assert int(a) == int(x) + int(y)
        elif p.startswith("Reverse the word: "):
            assert a == p.split(": ")[1][::-1]
        elif p.startswith("Uppercase: "):
            assert a == p.split(": ")[1].upper()


def test_eval_fraction_split(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(50)])
    splits = load_splits(DataSpec(path=str(path), eval_fraction=0.2), tok)
    assert len(splits.eval) == 10 and len(splits.train) == 40


def test_the_held_out_file_may_be_the_bundled_sets():
    """`eval_path: bundled` (`--eval-data bundled`, `distill.eval_data: bundled`): the generated task set's
    held-out file, read whole beside any training file, as a file path would be."""
    from smolforge.data.splits import read_spec

    train_file, held_file = bundled_paths()
    _train, held, _fmt, _skipped = read_spec(DataSpec(path=str(train_file), eval_path="bundled", max_eval_samples=None))
    assert held and held == read_examples(held_file).examples


# ---- bad input: one clear message, file:line, the fix, exit code 2, no traceback -------------

BAD_CASES = {
    "malformed": (b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion"\n', ":2", "malformed JSON"),
    "missing_field": (b'{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n', ":2", 'missing field "completion"'),
    "empty": (b"\n\n", "d.jsonl", "empty"),
    "non_utf8": (b'{"prompt": "a", "completion": "b"}\n{"prompt": "\xff\xfe", "completion": "b"}\n', ":2", "UTF-8"),
    "not_object": (b'{"prompt": "a", "completion": "b"}\n[1, 2]\n', ":2", "expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_cli_message(tmp_path, case):
    content, where, what = BAD_CASES[case]
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    proc = smolforge("train", "--model", "tiny-llama", "--data", str(path), "--max-steps", "1",
                     "--output-dir", str(tmp_path / "out"), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ")
    assert what in proc.stderr and where in proc.stderr
    assert "fix:" in proc.stderr


def test_missing_path_cli_message(tmp_path):
    proc = smolforge("train", "--model", "tiny-llama", "--data", str(tmp_path / "nope.jsonl"), "--quiet")
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_skip_bad_lines_counts(tmp_path):
    good = [{"prompt": f"q{i}", "completion": "a"} for i in range(5)]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(__import__("json").dumps(r).encode() + b"\n" for r in good) + b"{broken\n" + b'{"prompt": 1}\n')
    res = read_examples(path, skip_bad_lines=True)
    assert len(res.examples) == 5 and res.skipped == 2
    assert any(":6" in p for p in res.problems)


def test_a_file_with_a_byte_order_mark_and_crlf_trains_on_every_record(tmp_path, tok):
    """A JSONL saved by a Windows editor (UTF-8 BOM, CRLF line ends) is the same data as without them:
    every record read (the first one too), the same token rows, file:line kept; --skip-bad-lines skips none."""
    records = [{"prompt": f"q{i} \u00e9\r\nline two", "completion": f"a{i}"} for i in range(6)]
    plain = write_jsonl(tmp_path / "plain.jsonl", records)
    windows = tmp_path / "windows.jsonl"
    windows.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes().replace(b"\n", b"\r\n"))
    spec = lambda p: DataSpec(path=str(p), eval_fraction=0.0, skip_bad_lines=True)  # noqa: E731
    got, want = load_splits(spec(windows), tok), load_splits(spec(plain), tok)
    assert got.skipped == 0 and len(got.train) == len(records)
    assert [dict(r) for r in got.train] == [dict(r) for r in want.train]
    res = read_examples(windows)
    assert [e.messages for e in res.examples] == [e.messages for e in read_examples(plain).examples]
    assert [e.source.rsplit(":", 1)[1] for e in res.examples] == [str(i) for i in range(1, 7)]


def test_bundled_prompts_are_the_labelled_ones_then_new_questions_without_answers(tmp_path, monkeypatch):
    """`bundled-prompts` (the distill demo's pool): the first 512 training prompts, then prompts that are
    neither training nor held-out prompts (the teacher was fine-tuned on the first and is scored on
    the second), none with an answer; `read_spec` reads it with the bundled held-out split."""
    import json

    from smolforge.data.splits import read_spec
    from smolforge.data.synthetic import BUNDLED_PROMPTS, bundled_prompts_path

    monkeypatch.setenv("SMOLFORGE_HOME", str(tmp_path))
    path = bundled_prompts_path(n=1000)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 1000 and all(list(r) == ["prompt"] for r in records)
    prompts = [r["prompt"] for r in records]
    train, eval_ = bundled_paths()
    train_prompts = [json.loads(line)["prompt"] for line in train.read_text().splitlines()]
    eval_prompts = {json.loads(line)["prompt"] for line in eval_.read_text().splitlines()}
    assert prompts[:512] == train_prompts[:512] and len(set(prompts)) == 1000
    assert not set(prompts[512:]) & (set(train_prompts) | eval_prompts)
    assert bundled_prompts_path(n=1000).read_text() == path.read_text()  # written once, then reused
    with pytest.raises(SmolforgeError, match="completion"):  # training needs answers
        read_spec(DataSpec(path=BUNDLED_PROMPTS))
    pool, held_out, _fmt, _skipped = read_spec(DataSpec(path=BUNDLED_PROMPTS), prompts_only=True)
    assert len(pool) == 4000 and all(e.answer is None for e in pool)
    assert {e.prompt_messages[-1]["content"] for e in held_out} == eval_prompts
