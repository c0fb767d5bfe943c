"""The `smolforge` command. Each command group lives in its own module with a `register(app)`."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="smolforge",
    help="Train, fine-tune and distill small language models on the machines you already have.\n\n"
    "Example: smolforge demo",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

GROUPS = ("train", "demo", "cluster", "distill", "split")

for _name in GROUPS:
    try:
        _module = importlib.import_module(f"smolforge.cli.{_name}")
    except ModuleNotFoundError as _err:  # a group still being written by a teammate
        if _err.name != f"smolforge.cli.{_name}":
            raise
        continue
    _module.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
