"""`smolforge data show`: a dataset as training will read it.

`data show SOURCE` (a Hub name read offline from the local cache, a save_to_disk or Hub-layout directory,
a JSONL file, 'bundled'; `--dataset-config/-split/-column/-eval-split` as every command takes them) says
what smolforge would read (`data.hubinfo.describe`): where the name resolved, the shape detected, the
rows and columns, the columns used, the first rows as training text and the held-out set; no tokenizer.

With `--model`, the rows come from the function training encodes with (`data.encode.encode_all`, told the chat
template's system role by `train.rendering.system_role`, as `load_checked_splits` tells it), one
example at a time so each row keeps its `file:line`: the chat template applied (a system turn folded
into the next user turn where the template has none), tokenized, truncated to `--max-length`, and
the tokens the loss covers marked. The view is axolotl's `preprocess --debug`: the prompt (masked)
plain, the trained tokens in colour on a terminal and between `[[` `]]` otherwise, with a legend;
`--json` gives per row the text, the token ids and the loss mask.
"""

from __future__ import annotations

import os
import sys
from itertools import pairwise
from typing import Any, Optional

import typer

from smolforge.cli.common import print_json, quiet_libraries, run_cli
from smolforge.cli.hubdata import DatasetColumnOpt, DatasetConfigOpt, DatasetEvalSplitOpt, DatasetSplitOpt
from smolforge.config import DataSpec, validate
from smolforge.errors import SmolforgeError

data_app = typer.Typer(help="Look at a dataset as training will see it.\n\n"
                       "Example: smolforge data show wikitext --dataset-config wikitext-2-raw-v1\n\n"
                       "Example: smolforge data show --model tiny-llama --data mydata.jsonl -n 3",
                       no_args_is_help=True)
OPEN, CLOSE = "[[", "]]"
_MAX_LENGTH = DataSpec.model_fields["max_length"].default


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")


@data_app.command("show")
@run_cli
def show(
    source: Optional[str] = typer.Argument(None, help="the dataset: a Hugging Face name (read offline from the local "
                                           "cache), a save_to_disk / Hub-layout directory, a JSONL file, or 'bundled'"),
    dataset_config: DatasetConfigOpt = None,
    dataset_split: DatasetSplitOpt = None,
    dataset_column: DatasetColumnOpt = None,
    dataset_eval_split: DatasetEvalSplitOpt = None,
    model: Optional[str] = typer.Option(None, help="whose tokenizer and chat template (HF id, local dir, Ollama name, "
                                        "preset or twin): the rows tokenized, the trained tokens marked"),
    data: Optional[str] = typer.Option(None, help="JSONL file, or 'bundled' (as SOURCE)"),
    rows: int = typer.Option(3, "-n", "--rows", min=1, help="how many rows to show (the file's first)"),
    format: str = typer.Option("auto", "--format", help="auto|alpaca|chat|prompt_completion|text"),
    max_length: int = typer.Option(_MAX_LENGTH, help="truncate rows to this many tokens, as training does"),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="skip bad lines (listed), as training does"),
    json_out: bool = typer.Option(False, "--json", help="per row: text, token ids and the loss mask, as one JSON object"),
):
    """Say what training would read from a dataset; with --model, its first rows as training sees them.

    Without --model: where the name resolved (cache directory, save_to_disk or local directory, file),
    the shape detected (text/alpaca/chat/prompt_completion), rows, columns and the columns used, two
    rows as training text (cut), and the held-out set (--dataset-eval-split's split, or a split of the
    rows). A name not in the local cache: exit 2 with the command that caches it.

    With --model: the chat template applied (a system turn folded into the next user turn where the
    template has no system role), tokenized and truncated by the function training uses, the tokens the
    loss covers marked.

    Example: smolforge data show wikitext --dataset-config wikitext-2-raw-v1 --dataset-eval-split validation

    Example: smolforge data show mydata.jsonl --json

    Example: smolforge data show --model twin:phi-3-mini-4k-instruct --data mydata.jsonl -n 3

    Example: smolforge data show --model tiny-llama --data bundled -n 1 --json
    """
    if (source is None) == (data is None):
        raise SmolforgeError("both SOURCE and --data given" if source else "no dataset given",
                             fix="give one: smolforge data show NAME|FILE.jsonl (or --data FILE)")
    name = source if source is not None else str(data)
    if model is None:
        named = {"config": dataset_config, "split": dataset_split, "column": dataset_column, "eval_split": dataset_eval_split}
        _show_source(name, named, {"fmt": format, "skip_bad_lines": skip_bad_lines}, json_out)
        return
    from smolforge.data.hub import by_name

    data = by_name(name, dataset_config, dataset_split, dataset_column)
    spec = validate(DataSpec, {"path": data, "format": format, "max_length": max_length, "eval_fraction": 0,
                               "max_eval_samples": None, "skip_bad_lines": skip_bad_lines}, where="smolforge data show")
    from smolforge.data.splits import read_spec

    examples, _eval, fmt, _skipped = read_spec(spec)  # bad JSON lines: file:line and exit 2, before a tokenizer loads
    quiet_libraries()
    from smolforge.models.loading import load_tokenizer

    tok = load_tokenizer(model)
    view = preview(tok, examples, spec, rows)
    if json_out:
        print_json({"model": model, "data": data, "format": fmt, **view})
    else:
        _print(tok, model, data, fmt, view)


def _show_source(name: str, named: dict[str, Any], reading: dict[str, Any], json_out: bool) -> None:
    """`data show SOURCE` without --model: `hubinfo.describe`'s answer (NAMED: config, split, column,
    eval_split; READING: fmt, skip_bad_lines) as text or one JSON object."""
    from smolforge.data.hub import as_flag
    from smolforge.data.hubinfo import describe

    def spell(key: str) -> str:  # the name is this command's argument, not --dataset-name
        return "SOURCE (the argument)" if key == "dataset_name" else as_flag(key)

    info = describe(name, **named, **reading, spell=spell)
    if json_out:
        print_json(info)
        return
    used = ", ".join(info["columns_used"]) or "-"
    typer.echo(f"{name}: {info['kind']}, {info['where']}")
    typer.echo(f"reads:     {info['file']}")
    typer.echo(f"shape:     {info['format']} (columns used: {used}; columns: {', '.join(info['columns']) or '-'})")
    skipped = f", {info['skipped']} bad lines skipped" if info["skipped"] else ""
    typer.echo(f"rows:      {info['rows']} ({info['train_rows']} trained on{skipped})")
    held = info["held_out"]
    rows = f"{held['rows']} row{'' if held['rows'] == 1 else 's'}"
    typer.echo(f"held out:  {rows}, {held['how']}" + (f" ({held['file']})" if held["file"] else ""))
    for i, row in enumerate(info["samples"], start=1):
        typer.echo(f"\n--- row {i}: {row['source']} (as training text, before the chat template) ---")
        typer.echo(row["text"])


def preview(tok: Any, examples: list, spec: DataSpec, n: int) -> dict[str, Any]:
    """The first `n` rows training makes of `examples` (encode_all, one example at a time): {"rows":
    [{source, text, input_ids, loss_mask (1 where the loss covers the token), folded, truncated}],
    "system_role", "folded_system" (rows folded), "skipped" and "dropped" ("file:line: why")}."""
    from smolforge.data.encode import IGNORE, encode_all
    from smolforge.train.rendering import system_role

    role = system_role(tok)
    out: dict[str, Any] = {"system_role": role, "folded_system": 0, "rows": [], "skipped": [], "dropped": []}
    for ex in examples:
        if len(out["rows"]) >= n:
            break
        encoded, stats = encode_all(tok, [ex], spec.max_length, system_role=role, skip_bad_lines=spec.skip_bad_lines)
        out["skipped"] += stats.problems
        out["folded_system"] += stats.folded
        if stats.dropped_no_target:
            out["dropped"].append(f"{ex.source}: no answer token within max-length {spec.max_length}")
        for row in encoded:
            ids, labels = row["input_ids"], row["labels"]
            mask = [int(i > 0 and label != IGNORE) for i, label in enumerate(labels)]  # labels[0] predicts nothing
            out["rows"].append({"source": ex.source, "text": tok.decode(ids, skip_special_tokens=False),
                                "input_ids": ids, "loss_mask": mask, "folded": bool(stats.folded),
                                "truncated": bool(stats.truncated)})
    return out


def segments(tok: Any, ids: list[int], mask: list[int]) -> list[tuple[str, bool]]:
    """The row's text cut where the mask changes: [(text, trained)], in order. Each piece is the
    difference of two prefix decodings, so a piece keeps the spaces a tokenizer puts at a word's start."""
    bounds = [0] + [i for i in range(1, len(ids)) if mask[i] != mask[i - 1]] + [len(ids)]
    texts = [tok.decode(ids[:b], skip_special_tokens=False) for b in bounds]
    pieces = []
    for (a, b), (ta, tb) in zip(pairwise(bounds), pairwise(texts)):
        piece = tb[len(ta):] if tb.startswith(ta) else tok.decode(ids[a:b], skip_special_tokens=False)
        pieces.append((piece, bool(mask[a]) if a < len(mask) else False))
    return pieces


def _print(tok: Any, model: str, data: str, fmt: str, view: dict[str, Any]) -> None:
    """The rows as text: a legend, the fold line, then each row's text with its trained tokens marked."""
    from smolforge.data.encode import fold_note

    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    mark = (typer.style("trained", fg="green", bold=True) if color else f"{OPEN}trained{CLOSE}")
    typer.echo(f"{model} on {data} ({fmt}): {len(view['rows'])} rows as training sees them")
    typer.echo(f"legend: {mark} = tokens the loss covers; the rest (the prompt, the template's markup) is masked")
    if view["folded_system"]:
        typer.echo(fold_note(view["folded_system"], model))
    for line in view["skipped"]:
        typer.echo(f"skipped (bad line): {line}")
    for line in view["dropped"]:
        typer.echo(f"dropped: {line}")
    for i, row in enumerate(view["rows"], start=1):
        trained = sum(row["loss_mask"])
        notes = "".join(f", {k}" for k in ("folded", "truncated") if row[k])
        typer.echo(f"\n--- row {i}: {row['source']}, {len(row['input_ids'])} tokens, {trained} trained{notes} ---")
        parts = []
        for text, is_trained in segments(tok, row["input_ids"], row["loss_mask"]):
            if color:
                parts.append(typer.style(text, fg="green", bold=True) if is_trained else typer.style(text, dim=True))
            else:
                parts.append(f"{OPEN}{text}{CLOSE}" if is_trained else text)
        typer.echo("".join(parts))


if __name__ == "__main__":
    data_app()
