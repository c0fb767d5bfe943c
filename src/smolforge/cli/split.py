"""`smolforge split serve | train | merge | generate | info`: split learning from the command line.

The flags are the seed project's (SplitLearn's `start_trunk_server.py` and
`train_lora_distributed.py`), so its users' commands carry over. Run as
`python -m smolforge.cli.split <command>` too, which is what the tests start as a real process.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
from typing import Any, Optional

import typer

from smolforge.cli.aliases import seed_command
from smolforge.cli.common import bounded, check_port, cli_token, print_json, quiet_libraries, run_cli
from smolforge.cli.hubdata import (DatasetColumnOpt, DatasetConfigOpt, DatasetEvalSplitOpt, DatasetNameOpt, DatasetSplitOpt,
                                   dataset_files)
from smolforge.errors import SmolforgeError

TOKEN_ENV = "SMOLFORGE_SPLIT_TOKEN"  # = smolforge.split.protocol.TOKEN_ENV (kept import-free for --help speed)

split_app = typer.Typer(
    name="split",
    help="Split learning: a trunk server runs the middle layers; the client keeps the data, the labels and "
    "the first and last layers. All three parts train LoRA.\n\n"
    "Example: smolforge split serve --model tiny-llama --split-point-1 1 --split-point-2 3 --token-file split.token",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


SPLIT_POINT_1 = typer.Option(..., "--split-point-1", help="bottom = embeddings + layers [0, A); 0: embeddings only")
SPLIT_POINT_2 = typer.Option(..., "--split-point-2", help="trunk = layers [A, B); top = layers [B, n) + norm + head")


@split_app.command("serve", cls=seed_command("split serve"))
@run_cli
def serve_cmd(
    model: str = typer.Option(..., help="HF id, local dir, Ollama name or preset (tiny-llama)"),
    split_point_1: int = SPLIT_POINT_1,
    split_point_2: int = SPLIT_POINT_2,
    use_lora: bool = typer.Option(True, "--use-lora/--no-lora", help="train a LoRA on the trunk (default on)"),
    lora_rank: int = bounded(8, ge=1, help="trunk LoRA rank"),
    lora_alpha: float = bounded(16.0, gt=0, help="trunk LoRA alpha"),
    lora_dropout: float = bounded(0.05, ge=0, lt=1, help="trunk LoRA dropout"),
    device: str = typer.Option("cpu", help="cpu|cuda|auto"),
    host: str = typer.Option("127.0.0.1", help="address to bind; 0.0.0.0 exposes it to your network"),
    port: int = typer.Option(50051, help="port to listen on (0: any free port)"),
    token: Optional[str] = typer.Option(None, envvar=TOKEN_ENV, help=f"clients must send it (default: ${TOKEN_ENV}, "
                                        "else a random one, written to $SMOLFORGE_HOME/split/token)"),
    token_file: Optional[str] = typer.Option(None, "--token-file", help="a file holding the token (never in `ps`)"),
    no_token: bool = typer.Option(False, "--no-token", help="accept calls without a token (trusted loopback only)"),
    tls_cert: Optional[str] = typer.Option(None, help="PEM certificate: serve over TLS"),
    tls_key: Optional[str] = typer.Option(None, help="PEM private key of --tls-cert"),
    checkpoint_dir: Optional[str] = typer.Option(None, help="where per-session trunk checkpoints go "
                                                 "(default $SMOLFORGE_HOME/split/server-checkpoints)"),
    session_timeout: float = bounded(900.0, gt=0, help="free a session idle this many seconds (vanished client)"),
    max_sessions: int = bounded(8, ge=1, help="most concurrent client sessions"),
    generation_timeout: float = bounded(300.0, gt=0, help="free a `split generate` session (and its KV cache) "
                                             "idle this many seconds"),
    num_threads: Optional[int] = bounded(None, ge=1, help="torch threads (default: CPUs available)"),
):
    """Run the trunk server: layers [A, B) of MODEL, one LoRA and optimizer per client session.

    Example: smolforge split serve --model tiny-llama --split-point-1 1 --split-point-2 3 --port 50051 --token-file split.token
    """
    check_port(port, "--port", zero_picks=True)
    quiet_libraries()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    from smolforge.split.server import ServeConfig, serve

    token = cli_token(token, token_file)
    token_path = None
    if not token and not no_token:  # a fresh token, written 0600 for the clients: never printed
        from smolforge.auth import write_token
        from smolforge.paths import home

        token, token_path = secrets.token_urlsafe(24), home() / "split" / "token"
        write_token(token_path, token)
    cfg = ServeConfig(model=model, split_point_1=split_point_1, split_point_2=split_point_2, use_lora=use_lora,
                      lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, device=device, host=host,
                      port=port, token=None if no_token else token, tls_cert=tls_cert, tls_key=tls_key,
                      checkpoint_dir=checkpoint_dir, session_timeout=session_timeout, max_sessions=max_sessions,
                      num_threads=num_threads, generation_timeout=generation_timeout)
    if token_path:  # said before the port opens: a client that sees it open can already find the token
        typer.echo(f"token written to {token_path} (mode 0600); clients: --token-file {token_path} "
                   "(on another machine, a copy of it)", err=True)
    server = serve(cfg, allow_no_token=no_token)
    typer.echo(server.describe())
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, lambda *_: server.stop(2.0))
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop(1.0)


@split_app.command("train", cls=seed_command("split train"))
@run_cli
def train_cmd(
    model: str = typer.Option(..., help="the same model the server was started with"),
    split_point_1: int = SPLIT_POINT_1,
    split_point_2: int = SPLIT_POINT_2,
    server_host: str = typer.Option("127.0.0.1", help="trunk server address"),
    server_port: int = typer.Option(50051, help="trunk server port"),
    token: Optional[str] = typer.Option(None, envvar=TOKEN_ENV, help=f"the server's token (default: ${TOKEN_ENV})"),
    token_file: Optional[str] = typer.Option(None, "--token-file", help="a file holding the server's token (never in `ps`)"),
    tls_ca: Optional[str] = typer.Option(None, help="PEM CA bundle that signed the server's certificate: use TLS"),
    tls_server_name: Optional[str] = typer.Option(None, help="expected name in the server certificate"),
    lora_rank: int = bounded(8, ge=1, help="bottom/top LoRA rank"),
    lora_alpha: float = bounded(16.0, gt=0),
    lora_dropout: float = bounded(0.05, ge=0, lt=1),
    batch_size: int = bounded(4, ge=1, help="micro-batch size"),
    learning_rate: float = bounded(2e-4, gt=0),
    weight_decay: float = bounded(0.0, ge=0),
    num_epochs: float = bounded(1.0, gt=0),
    max_steps: Optional[int] = bounded(None, ge=1, help="optimizer steps (overrides --num-epochs)"),
    dataset: Optional[str] = typer.Option(None, help="JSONL file, or 'bundled' for the generated task set (default)"),
    dataset_name: DatasetNameOpt = None,
    dataset_config: DatasetConfigOpt = None,
    dataset_split: DatasetSplitOpt = None,
    dataset_column: DatasetColumnOpt = None,
    dataset_eval_split: DatasetEvalSplitOpt = None,
    data_format: str = typer.Option("auto", help="auto|alpaca|chat|prompt_completion|text"),
    max_train_samples: Optional[int] = bounded(None, ge=1, help="use only the first N training examples"),
    max_eval_samples: int = bounded(64, ge=0, help="held-out examples for Val Loss (0: no evaluation)"),
    gradient_accumulation_steps: int = bounded(1, ge=1, help="micro-batches per optimizer step"),
    mixed_precision: bool = typer.Option(False, "--mixed-precision", help="bf16 autocast on both sides"),
    max_seq_length: int = bounded(256, ge=1, help="truncate sequences to this many tokens"),
    warmup_steps: int = bounded(0, ge=0),
    max_grad_norm: float = bounded(1.0, ge=0, help="clip the global (client + trunk) gradient norm; 0: off"),
    scheduler: str = typer.Option("linear", help="linear|cosine|constant"),
    save_interval: int = bounded(0, ge=0, help="checkpoint both sides every N steps (0: at the end)"),
    eval_interval: int = bounded(0, ge=0, help="evaluate every N steps (0: at the end)"),
    log_interval: int = bounded(10, ge=1, help="print a Step line every N steps"),
    output_dir: str = typer.Option("outputs/split", help="checkpoints, metrics, lora_adapter/"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint both sides hold"),
    codec: str = typer.Option("fp32", help="activations/gradients on the wire: fp32|fp16|bf16|int8"),
    seed: int = bounded(0, ge=0),
    device: str = typer.Option("cpu", help="cpu|cuda|auto"),
    session_name: Optional[str] = typer.Option(None, help="names this run on the server (default: from --output-dir)"),
    reconnect_timeout: float = bounded(300.0, gt=0, help="keep retrying an unreachable server this many seconds"),
    num_threads: Optional[int] = bounded(None, ge=1, help="torch threads (default: CPUs available)"),
    tensorboard: bool = typer.Option(False, "--tensorboard", help="also write TensorBoard logs (OUTPUT_DIR/tensorboard)"),
    wandb: Optional[str] = typer.Option(None, "--wandb", metavar="PROJECT",
                                        help="also log to W&B, offline, in OUTPUT_DIR/wandb (the package's wandb extra)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar or log lines"),
    json_out: bool = typer.Option(False, "--json", help="print the result summary as JSON"),
):
    """Train the bottom and top here, the trunk on the server, all with LoRA.

    Example: smolforge split train --model tiny-llama --split-point-1 1 --split-point-2 3 --server-port 50051
    --token-file split.token --dataset bundled --max-steps 50

    Example: smolforge split train --model tiny-llama --split-point-1 1 --split-point-2 3 --dataset-name wikitext
    --dataset-config wikitext-2-raw-v1 --dataset-eval-split validation --max-steps 50  (offline, from the HF cache;
    Val Loss on its validation split)
    """
    check_port(server_port, "--server-port")
    dataset, eval_dataset = dataset_files(locals(), "dataset", "--dataset")
    dataset = dataset or "bundled"
    quiet_libraries()
    from smolforge.config import validate
    from smolforge.split.trainer import SplitTrainConfig, train_split

    values: dict[str, Any] = dict(
        model=model, split_point_1=split_point_1, split_point_2=split_point_2, server_host=server_host,
        server_port=server_port, token=cli_token(token, token_file) or local_token(server_host), tls_ca=tls_ca, tls_server_name=tls_server_name, lora_rank=lora_rank,
        lora_alpha=lora_alpha, lora_dropout=lora_dropout, batch_size=batch_size, learning_rate=learning_rate,
        weight_decay=weight_decay, num_epochs=num_epochs, max_steps=max_steps, dataset=dataset,
        eval_dataset=eval_dataset, data_format=data_format,
        max_train_samples=max_train_samples, max_eval_samples=max_eval_samples,
        gradient_accumulation_steps=gradient_accumulation_steps, mixed_precision=mixed_precision,
        max_seq_length=max_seq_length, warmup_steps=warmup_steps, max_grad_norm=max_grad_norm or None,
        scheduler=scheduler, save_interval=save_interval, eval_interval=eval_interval, log_interval=log_interval,
        output_dir=output_dir, resume=resume, codec=codec, seed=seed, device=device, session_name=session_name,
        reconnect_timeout=reconnect_timeout, num_threads=num_threads, tensorboard=tensorboard, wandb=wandb, quiet=quiet)
    cfg = validate(SplitTrainConfig, values, where="smolforge split train")
    if not quiet:
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    result = train_split(cfg)
    if json_out:
        print_json(result.to_dict())
    elif not quiet:
        typer.echo(f"done: {result.steps} steps, final loss {result.final_loss}, adapter {result.adapter_dir}",
                   err=True)


def local_token(server_host: str) -> str | None:
    """For a trunk server on this machine given no token: the one `split serve` wrote for its clients
    ($SMOLFORGE_HOME/split/token), so the seeds' two lines, which name no token, work as written; said
    on stderr. None elsewhere (the client then says the server wants a token)."""
    from smolforge.net import is_loopback
    from smolforge.paths import home

    path = home() / "split" / "token"
    if os.environ.get(TOKEN_ENV) or not is_loopback(server_host) or not path.is_file():
        return None
    from smolforge.auth import read_token_file

    typer.echo(f"using the token `split serve` wrote to {path} (the server is on this machine)", err=True)
    return read_token_file(str(path))


@split_app.command("merge")
@run_cli
def merge_cmd(
    output_dir: str = typer.Option(..., help="the --output-dir of `smolforge split train`"),
    merged_dir: Optional[str] = typer.Option(None, help="where the merged model goes "
                                             "(default <output-dir>/merged_model)"),
    model: Optional[str] = typer.Option(None, help="base model (default: the one the run used)"),
    step: Optional[int] = bounded(None, ge=0, help="merge this checkpoint instead of the final adapter"),
):
    """Fold bottom + trunk + top LoRA into one full HF model directory (loads with `smolforge generate`).

    Example: smolforge split merge --output-dir outputs/split --merged-dir outputs/split/merged_model
    """
    quiet_libraries()
    from smolforge.split.merge import merge_run

    path = merge_run(output_dir, merged_dir, model=model, step=step)
    typer.echo(f"merged model written to {path}")


@split_app.command("info")
@run_cli
def info_cmd(
    server_host: str = typer.Option("127.0.0.1"),
    server_port: int = typer.Option(50051),
    token: Optional[str] = typer.Option(None, envvar=TOKEN_ENV),
    token_file: Optional[str] = typer.Option(None, "--token-file", help="a file holding the server's token"),
    tls_ca: Optional[str] = typer.Option(None, help="PEM CA bundle that signed the server's certificate: use TLS"),
    tls_server_name: Optional[str] = typer.Option(None, help="expected name in the server certificate"),
    session_name: str = typer.Option("", help="also list the server checkpoints of this session"),
):
    """Ask a trunk server what it serves (model, split points, sessions, checkpoints) as JSON.

    Example: smolforge split info --server-port 50051 --token-file split.token
    """
    from google.protobuf.json_format import MessageToDict

    from smolforge.split.client import TrunkClient

    with TrunkClient(server_host, server_port, cli_token(token, token_file), tls_ca, tls_server_name,
                     reconnect_timeout=5.0) as client:
        print_json(MessageToDict(client.info(session_name), preserving_proto_field_name=True))


def parse_server(text: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets) -> (host, port); one message when it is anything else."""
    from urllib.parse import urlsplit

    fix = "pass the trunk server's address as HOST:PORT, e.g. --server 192.168.1.10:50051 ([::1]:50051 for IPv6)"
    try:
        parts = urlsplit(f"//{text.strip()}")
        port = parts.port
    except ValueError as err:  # '[::1' (no closing bracket), a port that is not a number or past 65535
        raise SmolforgeError(f"--server {text!r} is not HOST:PORT ({err})", where="--server", fix=fix) from None
    if not parts.hostname or port is None or parts.path or parts.query or parts.fragment \
            or parts.username is not None:
        raise SmolforgeError(f"--server {text!r} is not HOST:PORT", where="--server", fix=fix)
    check_port(port, "--server")
    return parts.netloc.rpartition(":")[0], port  # an IPv6 host keeps its brackets: gRPC targets need them


@split_app.command("generate")
@run_cli
def generate_cmd(
    server: str = typer.Option(..., "--server", help="the trunk server's HOST:PORT (same model and split points)"),
    run_dir: str = typer.Option(..., "--run-dir", help="the --output-dir of `smolforge split train`"),
    prompt: str = typer.Option(..., help="the user message"),
    max_new_tokens: int = bounded(64, ge=1, help="stop after this many new tokens (or at end of sequence)"),
    temperature: float = bounded(0.0, ge=0, help="0 = greedy (the merged model's tokens); > 0 samples"),
    seed: int = bounded(0, ge=0, help="sampling seed (with --temperature > 0)"),
    step: Optional[int] = bounded(None, ge=0, help="use this checkpoint of the run (default: the newest)"),
    raw: bool = typer.Option(False, "--raw", help="send the prompt as is, without the chat template"),
    token: Optional[str] = typer.Option(None, envvar=TOKEN_ENV, help=f"the server's token (default: ${TOKEN_ENV})"),
    token_file: Optional[str] = typer.Option(None, "--token-file", help="a file holding the server's token"),
    tls_ca: Optional[str] = typer.Option(None, help="PEM CA bundle that signed the server's certificate: use TLS"),
    tls_server_name: Optional[str] = typer.Option(None, help="expected name in the server certificate"),
    codec: str = typer.Option("fp32", help="hidden states on the wire: fp32|fp16|bf16|int8 (fp32 is exact)"),
    device: str = typer.Option("cpu", help="cpu|cuda|auto"),
    num_threads: Optional[int] = bounded(None, ge=1, help="torch threads (default: CPUs available)"),
    json_out: bool = typer.Option(False, "--json", help="print the reply, its tokens and the cache counters as JSON"),
):
    """Reply to a prompt with a split-trained model, without merging it: bottom and top run here, the trunk
    on the server, each side with its own KV cache.

    Example: smolforge split generate --server 127.0.0.1:50051 --run-dir outputs/split --prompt "What is 2 + 3?"
    --token-file split.token
    """
    host, port = parse_server(server)
    quiet_libraries()
    from smolforge.config import validate
    from smolforge.split.generate import SplitGenerateConfig, generate

    values: dict[str, Any] = dict(
        run_dir=run_dir, prompt=prompt, server_host=host, server_port=port, token=cli_token(token, token_file),
        tls_ca=tls_ca, tls_server_name=tls_server_name, step=step, max_new_tokens=max_new_tokens,
        temperature=temperature, seed=seed, raw=raw, codec=codec, device=device, num_threads=num_threads)
    result = generate(validate(SplitGenerateConfig, values, where="smolforge split generate"))
    if json_out:
        print_json(result.to_dict())
    else:
        typer.echo(result.text)


def register(app: typer.Typer) -> None:
    app.add_typer(split_app, name="split")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    split_app()
