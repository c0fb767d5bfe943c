"""What smolforge reads for a dataset, named or a file (`smolforge data show`): where the name resolved,
its columns and the shape detected, its rows, the columns training uses, the first rows as training
text, and the held-out set training would use.

Read by the readers training uses: `data.hub.by_name` (the name into one JSONL file, offline) and
`data.splits.read_spec` (the file into examples, split as `train` splits it); nothing here reads a
dataset another way.
"""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any

from smolforge.config import EVAL_SPLIT_KEY, DataSpec
from smolforge.data.formats import Example, jsonl_records
from smolforge.data.hub import Spell, _is_saved, as_flag, by_name, load_rows
from smolforge.data.synthetic import BUILTIN_DATASETS

# the columns (a record's keys) each row shape reads (data/formats.py's formats)
SHAPE_COLUMNS: dict[str, tuple[str, ...]] = {"alpaca": ("instruction", "input", "output"), "chat": ("messages", "tools"),
                                             "prompt_completion": ("prompt", "completion"), "text": ("text",)}
BUILT_IN, FILE, SAVED, LOCAL_DIR, HF_CACHE = ("built-in set", "JSONL file", "save_to_disk directory",
                                              "local directory (Hub layout)", "Hugging Face cache")
SAMPLE_CHARS = 200  # a sample row's text is cut here


def locate(name: str) -> tuple[str, str]:
    """(how NAME is read, where): a built-in set, a JSONL file, a save_to_disk directory, a local
    directory laid out like a Hub dataset, or a Hub name read from the local Hugging Face cache (its
    directory is known once read: `describe`). Paths absolute."""
    path = Path(name).expanduser()
    if name in BUILTIN_DATASETS:
        return BUILT_IN, name
    if path.is_file():
        return FILE, str(path.resolve())
    if path.is_dir():
        return (SAVED if _is_saved(path) else LOCAL_DIR), str(path.resolve())
    return HF_CACHE, name


def training_text(example: Example, limit: int = SAMPLE_CHARS) -> str:
    """One example as the text training learns from, before a chat template: a text row's text, a
    conversation's turns as `role: content` lines (a record's tools first, an assistant's calls as
    `name(arguments)`); cut at LIMIT characters (`…` marks a cut)."""
    if example.text is not None:
        text = example.text
    else:
        tools = [f"tools: {', '.join(t['function']['name'] for t in example.tools)}"] if example.tools else []
        text = "\n".join(tools + [f"{turn['role']}: {turn['content']}" + "".join(
            f" {c['function']['name']}({json.dumps(c['function']['arguments'])})" for c in turn.get("tool_calls", ()))
            for turn in example.messages or []])
    return text if len(text) <= limit else text[:limit] + "…"


def _first_keys(path: str) -> list[str]:
    """The keys of a JSONL file's first record ([] when it has none or the line is bad: the reader says why)."""
    for _line, record in jsonl_records(path):
        return list(record) if isinstance(record, dict) else []
    return []


def describe(name: str, config: str | None = None, split: str | None = None, column: str | None = None,
             eval_split: str | None = None, samples: int = 2, spell: Spell = as_flag, fmt: str = "auto",
             skip_bad_lines: bool = False) -> dict[str, Any]:
    """What training reads for NAME (a dataset name or directory, a JSONL file, a built-in set) with its
    CONFIG, SPLIT, COLUMN and held-out EVAL_SPLIT, as JSON-able values: {name, kind and where (`locate`;
    a cached name: its cache directory), file (the JSONL read), columns (the dataset's), format (the
    shape detected, or FMT as forced), columns_used, rows (train + held out), train_rows, held_out {how, rows}, samples
    [{source, text}] (the first SAMPLES training rows, `training_text`)}.

    Raises SmolforgeError (exit 2) as `by_name` (a name not cached: the command that caches it) and as
    `read_spec` (a bad line: file:line; skipped and counted in `skipped` with SKIP_BAD_LINES)."""
    from smolforge.data.splits import read_spec

    kind, where = locate(name)
    file = by_name(name, config, split, column, spell)
    held = by_name(name, config, eval_split, column, spell, EVAL_SPLIT_KEY) if eval_split is not None else None
    if kind in (SAVED, LOCAL_DIR, HF_CACHE):
        loaded = load_rows(name, config, split or "train", spell)  # datasets' own cache: read, not built again
        columns = list(loaded.column_names)
        if kind == HF_CACHE and loaded.cache_files:
            where = str(Path(loaded.cache_files[0]["filename"]).parent)
    else:
        columns = _first_keys(file) if kind == FILE else []
    spec = DataSpec(path=file, eval_path=held, max_eval_samples=None, format=fmt, skip_bad_lines=skip_bad_lines)
    train, eval_ex, fmt, skipped = read_spec(spec)
    how = (f"split {eval_split}, whole" if held else f"{name}'s own held-out set" if kind == BUILT_IN
           else f"a {spec.eval_fraction:.0%} split of the rows (eval_fraction)")
    return {"name": name, "kind": kind, "where": where, "file": str(file), "columns": columns, "format": fmt,
            "columns_used": [column] if column else [c for c in SHAPE_COLUMNS.get(fmt, ()) if c in columns or not columns],
            "rows": len(train) + (0 if held or kind == BUILT_IN else len(eval_ex)), "train_rows": len(train),
            "held_out": {"how": how, "rows": len(eval_ex), "file": held}, "skipped": skipped,
            "samples": [{"source": ex.source, "text": training_text(ex)} for ex in train[:samples]]}
