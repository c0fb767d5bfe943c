"""What every command shares: one-line errors with exit code 2, config assembly, JSON output."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, Callable

import typer

from smolforge.errors import SmolforgeError


def quiet_libraries() -> None:
    """Keep library chatter (weight-loading bars, hub warnings) out of the user's terminal.

    Through the libraries' own environment variables when they are not imported yet, so that a
    command that then refuses its input has not paid for importing them."""
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:  # read its environment at import: tell it directly
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        transformers = sys.modules["transformers"]
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def run_cli(fn: Callable) -> Callable:
    """Turn SmolforgeError into `error: ...` on stderr and exit 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SmolforgeError as err:
            typer.echo(f"error: {err.render()}", err=True)
            raise typer.Exit(err.exit_code)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130)

    return wrapper


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def parse_json_option(raw: str | None, flag: str, example: str) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise SmolforgeError(f"{flag} is not valid JSON: {err.msg} at column {err.colno}",
                             fix=f"quote it for the shell, e.g. {flag} '{example}'") from None
    if not isinstance(value, dict):
        raise SmolforgeError(f"{flag} must be a JSON object", fix=f"e.g. {flag} '{example}'")
    return value


def set_nested(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


PEFT_KEYS = {"r": "r", "rank": "r", "lora_r": "r", "alpha": "alpha", "lora_alpha": "alpha",
             "dropout": "dropout", "lora_dropout": "dropout", "target_modules": "target_modules",
             "num_virtual_tokens": "num_virtual_tokens", "adapter_size": "adapter_size"}


def peft_section(method: str | None, peft_config: str | None, lora_r: int | None, lora_alpha: float | None,
                 lora_dropout: float | None) -> dict[str, Any]:
    """The `peft:` config section from --peft, --peft-config JSON and the --lora-* shorthands."""
    out: dict[str, Any] = {}
    if method:
        out["method"] = method
    for key, value in parse_json_option(peft_config, "--peft-config", '{"r": 8, "alpha": 16, "dropout": 0.05}').items():
        if key not in PEFT_KEYS:
            raise SmolforgeError(f"--peft-config has unknown key {key!r}",
                                 fix=f"use keys among {', '.join(sorted(set(PEFT_KEYS)))}")
        out[PEFT_KEYS[key]] = value
    for key, value in (("r", lora_r), ("alpha", lora_alpha), ("dropout", lora_dropout)):
        if value is not None:
            out[key] = value
    return out


def console():
    import sys

    from rich.console import Console

    # Piped output (scripts, tests) gets wide lines instead of an 80-column wrap.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def fmt_eta(s: float | None) -> str:
    if s is None:
        return "–"
    s = int(max(0, round(s)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


PRIORITY_HELP = ("queue order when the cluster is busy: high | normal | low (first submitted first within one); "
                 "a waiting job is `pending` with the reason in `smolforge jobs`")
TOKEN_FILE_HELP = ("a file holding the cluster token (or $SMOLFORGE_TOKEN_FILE): unlike --token, it never shows "
                   "in `ps` or shell history")


def cli_token(token: str | None, token_file: str | None) -> str | None:
    """--token, else the token in --token-file; None lets the client look further ($SMOLFORGE_TOKEN,
    $SMOLFORGE_TOKEN_FILE, the local coordinator's token file)."""
    if token or not token_file:
        return token
    from smolforge.cluster.auth import read_token_file

    return read_token_file(token_file)
