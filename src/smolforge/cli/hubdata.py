"""`--dataset-name NAME [--dataset-config C] [--dataset-split S] [--dataset-column COL] [--dataset-eval-split E]`
on every command that reads a dataset (train, eval, launch, distill, split train): the named dataset resolved
here, before anything starts, by the one resolver (`smolforge.data.hub.by_name`) into one JSONL file that is
then passed as the command's file flag (--data/--dataset; a job uploads it to a coordinator as any JSONL),
and its held-out split (`--dataset-eval-split`, TRL's `dataset_test_split`) into the held-out file.
Specs name it with the same keys (`config.NamedDataset`). The options are one table (`DATASET_OPTIONS`),
read the one way (`dataset_files`)."""

from __future__ import annotations

from typing import Annotated, Any, Mapping, Optional

import typer

from smolforge.config import EVAL_SPLIT_KEY, dataset_choice_problem, eval_split_problem
from smolforge.errors import SmolforgeError

DatasetNameOpt = Annotated[Optional[str], typer.Option(
    "--dataset-name", help="a Hugging Face dataset by name, read offline from the local HF cache, or a "
    "save_to_disk / Hub-layout directory (written once as JSONL), e.g. --dataset-name wikitext "
    "--dataset-config wikitext-2-raw-v1")]
DatasetConfigOpt = Annotated[Optional[str], typer.Option("--dataset-config", help="with --dataset-name: its config")]
DatasetSplitOpt = Annotated[Optional[str], typer.Option("--dataset-split", help="with --dataset-name: its split (default train)")]
DatasetEvalSplitOpt = Annotated[Optional[str], typer.Option(
    "--dataset-eval-split", help="with --dataset-name: its split held out for evaluation, in place of a held-out "
    "file (e.g. validation; TRL's dataset_test_split)")]
# `--eval-data FILE`: a held-out JSONL, read whole (train and distill: one definition)
EvalDataOpt = Annotated[Optional[str], typer.Option(
    "--eval-data", help="held-out JSONL, read whole: the eval loss and accuracy are over it ('bundled': the "
    "generated task set's held-out file; default: a 10% split of --data)")]
DatasetColumnOpt = Annotated[Optional[str], typer.Option(
    "--dataset-column", help="with --dataset-name: the text column (default: rows shaped as text/alpaca/chat)")]

# The dataset options of every command that reads a dataset, by parameter name: the one table. A command
# declares each (`dataset_name: DatasetNameOpt = None`, ...: typer reads the parameters) and reads them with
# `dataset_files`; tests/test_dataset_options.py finds a command with --dataset-name that lacks one.
DATASET_OPTIONS: dict[str, Any] = {"dataset_name": DatasetNameOpt, "dataset_config": DatasetConfigOpt,
                                   "dataset_split": DatasetSplitOpt, "dataset_column": DatasetColumnOpt,
                                   "dataset_eval_split": DatasetEvalSplitOpt}


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
    return eval_path if eval_split is None else by_name(str(name), config, eval_split, column, split_key=EVAL_SPLIT_KEY)


def dataset_files(options: Mapping[str, Any], file_key: str, flag: str, eval_key: str | None = None,
                  eval_flag: str = "--eval-data") -> tuple[str | None, str | None]:
    """(the dataset file, the held-out file) that a command's OPTIONS (its parameters by name: FILE_KEY,
    the file flag FLAG's; EVAL_KEY, its held-out file flag EVAL_FLAG's, where it has one; and every
    `DATASET_OPTIONS` key) name: the files as given, or the named dataset's split and eval split as
    `data.hub.by_name` reads them (JSONL paths). The held-out file is None unless given or
    `--dataset-eval-split` names one. The eval split is checked first, so a refusal writes nothing.

    Raises SmolforgeError (exit 2) as `named_eval` and `named_dataset` (the rules specs follow too)."""
    name, config, column = options["dataset_name"], options["dataset_config"], options["dataset_column"]
    held_out = named_eval(options.get(eval_key) if eval_key else None, name, config, options["dataset_eval_split"],
                          column, eval_flag)
    return named_dataset(options[file_key], name, config, options["dataset_split"], column, flag), held_out


def sets_a_dataset(sets: list[str]) -> bool:
    """Whether `--set` values name a dataset (`dataset_name=...`, or under a section: `train.data.dataset_name=...`),
    which then stands for the command's file flag (the spec's `config.NamedDataset` keys)."""
    return any(item.partition("=")[0].strip().split(".")[-1] == "dataset_name" for item in sets if "=" in item)
