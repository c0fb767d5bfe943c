"""`--dataset-name NAME [--dataset-config C] [--dataset-split S] [--dataset-column COL]` on every command
that reads a dataset (train, eval, launch, distill, split train): the named dataset resolved here, before
anything starts, by the one resolver (`smolforge.data.hub.by_name`) into one JSONL file that is then
passed as the command's file flag (--data/--dataset; a job uploads it to a coordinator as any JSONL).
Specs name it with the same keys (`config.NamedDataset`)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from smolforge.config import dataset_choice_problem, eval_split_problem
from smolforge.errors import SmolforgeError

DatasetNameOpt = Annotated[Optional[str], typer.Option(
    "--dataset-name", help="a Hugging Face dataset by name, read offline from the local HF cache, or a "
    "save_to_disk / Hub-layout directory (written once as JSONL), e.g. --dataset-name wikitext "
    "--dataset-config wikitext-2-raw-v1")]
DatasetConfigOpt = Annotated[Optional[str], typer.Option("--dataset-config", help="with --dataset-name: its config")]
DatasetSplitOpt = Annotated[Optional[str], typer.Option("--dataset-split", help="with --dataset-name: its split (default train)")]
DatasetEvalSplitOpt = Annotated[Optional[str], typer.Option(
    "--dataset-eval-split", help="with --dataset-name: its split held out for eval, in place of --eval-data "
    "(e.g. validation)")]
DatasetColumnOpt = Annotated[Optional[str], typer.Option(
    "--dataset-column", help="with --dataset-name: the text column (default: rows shaped as text/alpaca/chat)")]


def named_dataset(path: str | None, name: str | None, config: str | None, split: str | None,
                  column: str | None, flag: str) -> str | None:
    """The dataset to read: PATH (the --data/--dataset FLAG) as given, or NAME as `data.hub.by_name`
    reads it; None when neither is given.

    Raises SmolforgeError (exit 2) for both given, for --dataset-config/-split/-column without a name
    (`config.dataset_choice_problem`, the rule specs follow too), and as `by_name`."""
    from smolforge.data.hub import as_flag, by_name

    spell = lambda key: key if key.startswith("--") else as_flag(key)  # noqa: E731
    named = {"dataset_name": name, "dataset_config": config, "dataset_split": split, "dataset_column": column}
    problem = dataset_choice_problem(flag, path, named, spell)
    if problem:
        fix = f"pass one of {flag} and --dataset-name" if name is not None else "add --dataset-name NAME"
        raise SmolforgeError(problem, fix=fix)
    return path if name is None else by_name(name, config, split, column)


def named_eval(eval_path: str | None, name: str | None, config: str | None, eval_split: str | None,
                column: str | None, flag: str = "--eval-data") -> str | None:
    """The held-out set to read: EVAL_PATH (the FLAG) as given, or NAME's EVAL_SPLIT (`--dataset-eval-split`)
    as `data.hub.by_name` reads it. SmolforgeError (exit 2) for both, or the split without --dataset-name
    (`config.eval_split_problem`, the rule specs follow too)."""
    from smolforge.data.hub import as_flag, by_name

    spell = lambda key: key if key.startswith("--") else as_flag(key)  # noqa: E731
    problem = eval_split_problem(flag, eval_path, name, eval_split, spell)
    if problem:
        raise SmolforgeError(problem, fix=f"pass one of {flag} and --dataset-eval-split" if name is not None
                             else "add --dataset-name NAME")
    return eval_path if eval_split is None else by_name(str(name), config, eval_split, column)


def sets_a_dataset(sets: list[str]) -> bool:
    """Whether `--set` values name a dataset (`dataset_name=...`, or under a section: `train.data.dataset_name=...`),
    which then stands for the command's file flag (the spec's `config.NamedDataset` keys)."""
    return any(item.partition("=")[0].strip().split(".")[-1] == "dataset_name" for item in sets if "=" in item)
