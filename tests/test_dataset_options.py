"""The dataset options are one table (`cli.hubdata.DATASET_OPTIONS`, issue 46 item 3): every command that
takes `--dataset-name` takes every option of the table, `--dataset-eval-split` included, declared from
the table itself (not a copy). Read from the Typer app, so a new command that forgets one fails here."""

from __future__ import annotations

from typing import Any

import pytest


def _commands() -> dict[str, Any]:
    """Every command of the `smolforge` app by its path ("train", "split train"), groups walked (typer's own
    click: a group is what has `commands`)."""
    import typer.main

    from smolforge.cli.main import app

    def walk(cmd: Any, path: list[str]):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])
        else:
            yield " ".join(path), cmd

    return dict(walk(typer.main.get_command(app), []))


COMMANDS = _commands()
WITH_NAME = sorted(path for path, cmd in COMMANDS.items()
                   if any("--dataset-name" in param.opts for param in cmd.params))


def test_the_commands_that_read_a_dataset_by_name_are_all_found():
    assert {"train", "eval", "launch", "distill", "split train"} <= set(WITH_NAME), WITH_NAME


@pytest.mark.parametrize("command", WITH_NAME)
def test_every_command_with_a_dataset_name_takes_every_dataset_option_from_the_one_table(command):
    from smolforge.cli.hubdata import DATASET_OPTIONS
    from smolforge.data.hub import as_flag

    params = {opt: param for param in COMMANDS[command].params for opt in param.opts}
    for key, declared in DATASET_OPTIONS.items():
        flag = as_flag(key)
        assert flag in params, f"smolforge {command} lacks {flag}"
        assert params[flag].help == declared.__metadata__[0].help, f"smolforge {command} {flag} is a copy"


@pytest.mark.parametrize("command", ["train", "distill", "launch"])
def test_the_held_out_file_flag_is_one_definition(command):
    """`--eval-data FILE` (a held-out JSONL, read whole) is declared from `cli.hubdata.EvalDataOpt` by
    every command that takes it, not a copy with its own help."""
    from smolforge.cli.hubdata import EvalDataOpt

    params = {opt: param for param in COMMANDS[command].params for opt in param.opts}
    assert "--eval-data" in params, f"smolforge {command} lacks --eval-data"
    assert params["--eval-data"].help == EvalDataOpt.__metadata__[0].help, f"smolforge {command} --eval-data is a copy"
