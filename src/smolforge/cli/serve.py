"""`smolforge serve`: chat with a model (plus adapter) through an OpenAI-compatible API and a web page.

Imports stay inside the command so `smolforge --help` does not load torch or FastAPI.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from smolforge.cli.common import quiet_libraries, run_cli


def register(app: typer.Typer) -> None:
    @app.command()
    @run_cli
    def serve(
        model: str = typer.Option(..., help="HF id, local dir, Ollama name or preset (tiny-llama)"),
        adapter: Optional[str] = typer.Option(None, help="a lora/ia3/adapter directory from `smolforge train` "
                                              "(LoRA and IA3 are merged into the weights)"),
        host: str = typer.Option("127.0.0.1", help="address to listen on; 0.0.0.0 exposes it to your network"),
        port: int = typer.Option(8000, help="port to listen on (0: any free port)"),
        token_file: Optional[str] = typer.Option(None, "--token-file", help="a file holding the token clients must "
                                                 "send (else $SMOLFORGE_TOKEN, else one made into the state dir)"),
        state_dir: Optional[str] = typer.Option(None, help="where a made token is kept (default $SMOLFORGE_HOME/serve)"),
        max_batch: int = typer.Option(8, help="most requests generated together in one batch"),
        model_name: Optional[str] = typer.Option(None, help="the name clients use in `model` (default: --model as given)"),
        device: str = typer.Option("auto", help="auto|cpu|cuda"),
        num_threads: Optional[int] = typer.Option(None, help="torch threads (default: CPUs available)"),
    ):
        """Serve a model from this process: OpenAI-compatible /v1 API (streaming) and a chat page at /chat.

        No cluster or Ray needed. Clients send the token as `Authorization: Bearer <token>`; the
        chat page takes it from its URL fragment (`/chat#token=...`).

        Example: smolforge serve --model tiny-llama --adapter outputs/run/lora_adapter --port 8000
        """
        quiet_libraries()
        from smolforge.pipeline.serve.server import ServeOptions, serve as run

        def announce(line: str) -> None:
            typer.echo(line)
            sys.stdout.flush()

        run(ServeOptions(model=model, adapter=adapter, host=host, port=port, token_file=token_file,
                         state_dir=state_dir, max_batch=max_batch, model_name=model_name, device=device,
                         num_threads=num_threads), announce=announce)
