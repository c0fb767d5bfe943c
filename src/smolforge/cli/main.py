"""The `smolforge` command. Each command group lives in its own module with a `register(app)`."""

from __future__ import annotations

import typer

from smolforge.cli import cluster, data, demo, distill, export, launch, logs, serve, split, train

app = typer.Typer(
    name="smolforge",
    help="Train, fine-tune and distill small language models on the machines you already have.\n\n"
    "Example: smolforge demo",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _group in (train, data, demo, cluster, logs, launch, distill, split, serve, export):
    _group.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
