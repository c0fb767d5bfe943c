"""`--dataset-name NAME [--dataset-config C] [--dataset-split S] [--dataset-column COL]` on train and
launch: the named dataset (smolforge.data.hub) resolved here, at submit, into one JSONL file that is
then passed as --data/--dataset (and so uploaded to a coordinator as any JSONL)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from smolforge.errors import SmolforgeError

DatasetNameOpt = Annotated[Optional[str], typer.Option(
    "--dataset-name", help="a Hugging Face dataset by name, read offline from the local HF cache, or a "
    "save_to_disk / Hub-layout directory (written once as JSONL)")]
DatasetConfigOpt = Annotated[Optional[str], typer.Option("--dataset-config", help="with --dataset-name: its config")]
DatasetSplitOpt = Annotated[Optional[str], typer.Option("--dataset-split", help="with --dataset-name: its split (default train)")]
DatasetColumnOpt = Annotated[Optional[str], typer.Option(
    "--dataset-column", help="with --dataset-name: the text column (default: rows shaped as text/alpaca/chat)")]


def named_dataset(path: str | None, name: str | None, config: str | None, split: str | None,
                  column: str | None, flag: str) -> str | None:
    """The dataset to read: PATH (the --data/--dataset FLAG) as given, or NAME as `by_name` reads it.

    Raises SmolforgeError (exit 2) for both given, for --dataset-config/-split/-column without a name,
    and as `by_name`."""
    extras = {"--dataset-config": config, "--dataset-split": split, "--dataset-column": column}
    if name is None:
        given = [k for k, v in extras.items() if v is not None]
        if given:
            raise SmolforgeError(f"{given[0]} needs --dataset-name", fix="add --dataset-name NAME")
        return path
    if path is not None:
        raise SmolforgeError(f"both {flag} {path} and --dataset-name {name}", fix=f"pass one of {flag} and --dataset-name")
    return by_name(name, config, split, column)


def by_name(name: str, config: str | None = None, split: str | None = None, column: str | None = None) -> str:
    """`--dataset-name NAME`: 'bundled' or a local JSONL file as it is (no config, split or column);
    else a Hub name or dataset directory written once as JSONL (`smolforge.data.hub.dataset_to_jsonl`),
    its path returned. SmolforgeError (exit 2) for a name not cached, with the command that caches it."""
    if name == "bundled" or Path(name).expanduser().is_file():
        given = [k for k, v in (("--dataset-config", config), ("--dataset-split", split),
                                ("--dataset-column", column)) if v is not None]
        if given:
            raise SmolforgeError(f"{given[0]}: {name} is a local dataset, which has none",
                                 fix=f"drop {given[0]}")
        return name
    from smolforge.data.hub import dataset_to_jsonl

    return str(dataset_to_jsonl(name, config, split, column))
