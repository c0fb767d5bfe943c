"""What every command shares: one-line errors with exit code 2, config assembly, JSON output."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, Callable

import click
import typer
from typer.core import TyperCommand

from smolforge.cluster.face import check_port  # noqa: F401  (every command's port flags: before anything starts)
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


def bounded(default: Any, *param_decls: str, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, **kw: Any) -> Any:
    """`typer.Option` for a number with bounds (a count, a rate, a probability): `run_cli` checks them
    with the input rules (`smolforge.input_rules.number_problem`) before the command runs, and refuses
    a value outside as one message, exit 2. Every float option is finite and every int 64-bit anyway;
    this adds the flag's own range. E.g. `max_new_tokens: int = bounded(64, ge=1)`."""
    option = typer.Option(default, *param_decls, **kw)
    option.bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return option


def _flags(fn: Callable) -> dict[str, tuple[str, dict[str, float]]]:
    """Each parameter of a command: how the user writes it (`--max-new-tokens`, `the job-id argument`)
    and the bounds `bounded` declared for it."""
    import inspect

    from typer.models import ArgumentInfo, ParameterInfo

    out = {}
    for name, param in inspect.signature(fn).parameters.items():
        info = param.default if isinstance(param.default, ParameterInfo) else None
        decls = [d.split("/")[0] for d in (getattr(info, "param_decls", None) or ()) if d.startswith("--")]
        flag = decls[0] if decls else f"--{name.rstrip('_').replace('_', '-')}"
        if isinstance(info, ArgumentInfo):
            flag = f"the {name.rstrip('_').replace('_', '-')} argument"
        out[name] = (flag, getattr(info, "bounds", {}))
    return out


def check_options(options: dict[str, Any], flags: dict[str, tuple[str, dict[str, float]]]) -> None:
    """The input rules on a command's options and arguments (smolforge.input_rules): text that is UTF-8
    without NUL and at most MAX_ARGUMENT characters, numbers finite, 64-bit and within a `bounded`
    flag's range. One message naming the flag, exit 2."""
    from smolforge.input_rules import MAX_ARGUMENT, number_problem, text_problem

    check_utf8(options)
    for name, value in options.items():
        flag, bounds = flags.get(name, (f"--{name.replace('_', '-')}", {}))
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, (int, float)):
                what = number_problem(item, **bounds)
                shown = str(item) if len(str(item)) <= 24 else f"{str(item)[:12]}…"
                fix = f"give {flag} a value in its range (see --help)" if bounds else f"give {flag} a finite, 64-bit number"
            elif isinstance(item, (str, os.PathLike)):
                what, shown, fix = text_problem(os.fspath(item), MAX_ARGUMENT), "", "shorten it, or drop the NUL byte"
            else:
                continue
            if what:
                raise SmolforgeError(f"{flag} {shown} {what}".replace("  ", " "), fix=fix)


def run_cli(fn: Callable) -> Callable:
    """Turn SmolforgeError into `error: ...` on stderr and exit 2, never a traceback; so too an
    argument that breaks the input rules (check_options: not UTF-8, a NUL, NaN, a number out of its
    flag's range) and a file the system refuses (a name too long, a directory that cannot be made),
    wherever in the command it is met."""
    flags = _flags(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            check_options(kwargs, flags)
            return fn(*args, **kwargs)
        except SmolforgeError as err:
            typer.echo(f"error: {err.render()}", err=True)
            raise typer.Exit(err.exit_code)
        except ValueError as err:
            if not _is_validation_error(err):
                raise
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in err.errors())
            typer.echo(f"error: invalid {err.title}: {problems}\n  fix: give values in the ranges `--help` states",
                       err=True)
            raise typer.Exit(2)
        except OSError as err:
            if err.filename is None:  # not about a path the user named: a bug to see whole
                raise
            name = os.fsdecode(err.filename)
            name = name if len(name) <= 120 else f"{name[:60]}…{name[-40:]}"
            typer.echo(f"error: {name!r}: {err.strerror}\n  fix: check the path (it must fit the file system, and "
                       "be writable where the command writes)", err=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130)

    return wrapper


def _is_validation_error(err: BaseException) -> bool:
    """A pydantic ValidationError (settings built from the flags refused a value), without importing
    pydantic for commands that never load it."""
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and isinstance(err, pydantic.ValidationError)


def check_utf8(options: dict[str, Any]) -> None:
    """Refuse arguments that are not UTF-8 (Python keeps such bytes as lone surrogates, which
    fail later, anywhere: an HTTP request, a JSON spec, the terminal)."""
    for name, value in options.items():
        for text in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(text, (str, os.PathLike)):
                try:
                    os.fspath(text).encode("utf-8")
                except UnicodeEncodeError as err:
                    byte = ord(os.fspath(text)[err.start]) & 0xFF  # surrogateescape keeps byte b as U+DC00 + b
                    raise SmolforgeError(f"the {name.rstrip('_').replace('_', '-')} argument is not UTF-8 text "
                                         f"(byte 0x{byte:02x} at character {err.start})",
                                         fix="use UTF-8 names (rename the file or directory, or check the "
                                             "terminal's encoding)") from None


def make_output_dir(path: str, flag: str = "--output-dir") -> None:
    """Make the directory a command writes into now, before any model loads: a path that cannot be
    one (a file, a place without write access) is one message at once, not an error minutes later."""
    from pathlib import Path

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SmolforgeError(f"cannot make the directory {path}: {err.strerror}", where=flag,
                             fix="give a directory you can write to (nothing was started)") from None


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def parse_json_option(raw: str | None, flag: str, example: str) -> dict[str, Any]:
    if not raw:
        return {}
    from smolforge.config import MAX_NESTING, check_nesting

    try:
        value = check_nesting(json.loads(raw), flag)
    except json.JSONDecodeError as err:
        raise SmolforgeError(f"{flag} is not valid JSON: {err.msg} at column {err.colno}",
                             fix=f"quote it for the shell, e.g. {flag} '{example}'") from None
    except RecursionError:  # the parser recurses per level: thousands of `[` end here
        raise SmolforgeError(f"{flag} nests deeper than {MAX_NESTING} levels", fix=f"e.g. {flag} '{example}'") from None
    if not isinstance(value, dict):
        raise SmolforgeError(f"{flag} must be a JSON object", fix=f"e.g. {flag} '{example}'")
    return value


def strategy_choices(able: Callable[[Any], bool] | None = None, default: str = "ddp") -> str:
    """The strategy registry's names as a flag's help lists them ('ddp (default) | zero1 | ...'), all of
    them or those whose class has a capability (which imports every strategy: seconds)."""
    from smolforge.parallel.strategies import STRATEGIES, names_where

    names = list(STRATEGIES) if able is None else names_where(able)
    return " | ".join(f"{name} (default)" if name == default else name for name in names)


# `{name}` in an option's help of a `RegistryHelp` command: what fills it, read when the help is shown
REGISTRY_HELP: dict[str, Callable[[], str]] = {
    "{strategies}": strategy_choices,
    "{student_strategies}": lambda: strategy_choices(lambda cls: cls.distill_students),
}


class RegistryHelp(TyperCommand):
    """A command whose option help names what a registry holds (`REGISTRY_HELP`), filled in when the
    help is shown, not when the CLI starts: a strategy's capabilities are class attributes, and
    importing every strategy costs seconds that `smolforge jobs` should not pay. A strategy added to
    the registry (a new file, a plug-in) then shows in `--help` with no edit here."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for param in self.get_params(ctx):
            text = getattr(param, "help", None)  # click's own arguments have none
            if not text:
                continue
            for key, fill in REGISTRY_HELP.items():
                if key in text:
                    text = text.replace(key, fill())
            param.help = text  # type: ignore[attr-defined]
        super().format_help(ctx, formatter)


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
    from smolforge.auth import read_token_file

    return read_token_file(token_file)
