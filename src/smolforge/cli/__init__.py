"""The `smolforge` command: a typer app with one module per command group."""
