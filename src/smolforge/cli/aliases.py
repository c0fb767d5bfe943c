"""The seed documents' spellings of our flags: ONE table (`ALIASES`), applied before a command parses.

Users of the seeds copy their command lines (SplitLearn's `--model-type gpt2 --model-name gpt2
--split-point-1 0 …`, SOLLOL's `--sollol-host H --sollol-port P`, SmolCluster's
`--override training.learning_rate=3e-4`). A command built with `seed_command("split train")` rewrites
those spellings onto its own flags (`SeedCommand.parse_args`), says each rewrite that changes a
meaning on stderr, refuses what has no counterpart here with one message and exit 2, and lists the
table's rows for itself under "Seed spellings" in its `--help`. A seed flag the command itself
declares (a later `--dataset-name`, say) is the command's own and is never rewritten.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any, Callable

import click
import typer

from smolforge.cli.common import RegistryHelp
from smolforge.config import SEED_KEYS
from smolforge.errors import SmolforgeError

SPLITLEARN, SOLLOL, SMOLCLUSTER = "SplitLearn", "SOLLOL", "SmolCluster"
CLUSTER_COMMANDS = ("launch", "submit")  # the commands that take --coordinator HOST:PORT


@dataclass(frozen=True)
class Alias:
    """One seed spelling: `seed` (its flag) in `commands` means `ours`; `takes_value`: the flag has a
    value; `how`: what the rewrite does, for `--help`."""

    seed: str
    source: str
    commands: tuple[str, ...]
    ours: str
    how: str = ""
    takes_value: bool = True


ALIASES: tuple[Alias, ...] = (
    Alias("--model-name", SPLITLEARN, ("split serve", "split train"), "--model"),
    Alias("--model-type", SPLITLEARN, ("split serve", "split train"), "(checked)",
          "the family is read from the model's config; a --model-type that names another family is refused"),
    Alias("--split-point-1", SPLITLEARN, ("split serve", "split train", "launch"), "--split-point-1", "the same"),
    Alias("--split-point-2", SPLITLEARN, ("split serve", "split train", "launch"), "--split-point-2", "the same"),
    Alias("--use-lora", SPLITLEARN, ("split train",), "(always)", "the client always trains LoRA on bottom and top",
          takes_value=False),
    Alias("--use-lora", SPLITLEARN, ("split serve",), "--use-lora", "the same (default on)", takes_value=False),
    Alias("--lora-rank", SPLITLEARN, ("split serve", "split train"), "--lora-rank", "the same"),
    Alias("--lora-rank", SPLITLEARN, ("launch",), "--lora-r"),
    Alias("--device", SPLITLEARN, ("split serve", "split train"), "--device", "the same (cpu|cuda|auto)"),
    Alias("--max-train-samples", SPLITLEARN, ("split train",), "--max-train-samples", "the same"),
    Alias("--sollol-host", SOLLOL, ("worker join", *CLUSTER_COMMANDS), "--coordinator HOST:PORT",
          "worker join: the HOST:PORT argument"),
    Alias("--sollol-port", SOLLOL, ("worker join", *CLUSTER_COMMANDS), "--coordinator HOST:PORT",
          "with --sollol-host (default 127.0.0.1)"),
    Alias("--override", SMOLCLUSTER, ("train", *CLUSTER_COMMANDS), "--set"),
)

SET_FLAGS = ("--set", "--override")


def rows_for(command: str) -> list[Alias]:
    """The table's rows for one command ('split train'), in table order."""
    return [a for a in ALIASES if command in a.commands]


def seed_command(command: str, base: type[click.Command] = RegistryHelp) -> type[click.Command]:
    """The command class for `command` ('split serve'): its seed spellings rewritten, shown in --help."""
    return type(f"SeedCommand_{command.replace(' ', '_')}", (SeedCommand, base), {"seed_key": command})


class SeedCommand(RegistryHelp):
    """A command that reads the seeds' spellings (`ALIASES`): `parse_args` rewrites them before click
    parses; a refusal is `error: …` + `fix: …` and exit 2, like every command's."""

    seed_key = ""

    def own_flags(self) -> set[str]:
        return {opt for p in self.params for opt in (*p.opts, *getattr(p, "secondary_opts", ()))}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if ctx.resilient_parsing:
            return super().parse_args(ctx, args)
        try:
            args, checks = rewrite(self.seed_key, list(args), self.own_flags(), say=lambda t: typer.echo(t, err=True))
            rest = super().parse_args(ctx, args)
            for check in checks:
                check(ctx.params)
        except SmolforgeError as err:
            typer.echo(f"error: {err.render()}", err=True)
            ctx.exit(2)
        return rest

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help(ctx, formatter)
        own = self.own_flags()
        rows = [(a.seed, f"→ {a.ours} ({a.source}{'; ' + a.how if a.how else ''})") for a in rows_for(self.seed_key)
                if a.seed not in own or a.seed != a.ours]
        if rows:
            with formatter.section("Seed spellings (read as our flags)"):
                formatter.write_dl(rows)


def _take(args: list[str], flag: str, takes_value: bool) -> tuple[list[str], list[str]]:
    """(args without `flag`, the values it had): `--flag V`, `--flag=V`, or the bare flag ('' each)."""
    out: list[str] = []
    values: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out.extend(args[i:])
            break
        if arg == flag:
            if not takes_value:
                values.append("")
            elif i + 1 < len(args):
                values.append(args[i + 1])
                i += 1
            else:
                raise SmolforgeError(f"{flag} needs a value", fix=f"write {flag} VALUE")
        elif takes_value and arg.startswith(flag + "="):
            values.append(arg[len(flag) + 1:])
        else:
            out.append(arg)
        i += 1
    return out, values


Check = Callable[[dict[str, Any]], None]


def rewrite(command: str, args: list[str], own: set[str],
            say: Callable[[str], None] = lambda _: None) -> tuple[list[str], list[Check]]:
    """`args` of `command` with every seed spelling of `ALIASES` rewritten onto our flags, and the checks
    that need the parsed values (`--model-type` against the model). A seed flag in `own` (the command
    declares it) is left alone. SmolforgeError for a seed spelling without a counterpart here."""
    checks: list[Check] = []
    taken: dict[str, list[str]] = {}
    for alias in rows_for(command):
        if alias.seed in own:  # the command's own flag (also where the seed's name is ours)
            continue
        args, values = _take(args, alias.seed, alias.takes_value)
        if values:
            taken[alias.seed] = values
    for seed, values in taken.items():
        args = ALIAS_RULES.get(seed, _rename)(command, seed, values, args, taken, checks, say)
    return _seed_keys(args, say), checks


def _rename(command: str, seed: str, values: list[str], args: list[str], *_: Any) -> list[str]:
    alias = next(a for a in rows_for(command) if a.seed == seed)
    if not alias.ours.startswith("--"):  # accepted, nothing to set: "(always)"
        return args
    if not alias.takes_value:
        return args + [alias.ours]
    return args + [x for v in values for x in (alias.ours, v)]


def _model_type(command: str, seed: str, values: list[str], args: list[str], taken: dict, checks: list[Check],
                say: Callable[[str], None]) -> list[str]:
    wanted = values[-1]
    if not any(a in ("--model", "--model-name") or a.startswith(("--model=", "--model-name=")) for a in args) \
            and "--model-name" not in taken:
        raise SmolforgeError(f"--model-type {wanted} names a family, not a model",
                             fix="add --model-name NAME (or --model NAME): an HF id, a local dir, a preset or twin")
    checks.append(lambda params: check_model_type(wanted, params.get("model")))
    return args


def _sollol(command: str, seed: str, values: list[str], args: list[str], taken: dict, *_: Any) -> list[str]:
    host, port = (taken.get("--sollol-host") or [None])[-1], (taken.get("--sollol-port") or [None])[-1]
    if seed == "--sollol-port" and host is not None:
        return args  # read with --sollol-host
    address = f"{host or '127.0.0.1'}" + (f":{port}" if port else "")
    return [address, *args] if command == "worker join" else args + ["--coordinator", address]


ALIAS_RULES: dict[str, Callable[..., list[str]]] = {
    "--model-type": _model_type,
    "--sollol-host": _sollol, "--sollol-port": _sollol,
}


def _seed_keys(args: list[str], say: Callable[[str], None]) -> list[str]:
    """`--set`/`--override` values whose key the seeds name otherwise (`training.learning_rate`), mapped
    onto ours where `SEED_KEYS` says the meaning is the same; said once each on stderr."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg not in SET_FLAGS or "=" not in out[i + 1]:
            continue
        key, _, value = out[i + 1].partition("=")
        parts = key.split(".")
        section = parts[:1] if len(parts) > 1 and parts[0] in ("training", "train") else []
        leaf = ".".join(parts[len(section):])
        if leaf in SEED_KEYS:
            mapped = f"{SEED_KEYS[leaf]}={value}"
            say(f"note: {arg} {out[i + 1]} read as --set {mapped} (the seed's name for it)")
            out[i + 1] = mapped
    return out


def check_model_type(wanted: str, model: str | None) -> None:
    """SplitLearn's `--model-type T` against the model's own config: the family of T must be the
    family of the model (`models.families`); one that is not registered, or another, is refused."""
    from smolforge.cli.common import quiet_libraries
    from smolforge.models.default_student import model_config
    from smolforge.models.families import family_of, registered

    quiet_libraries()  # a preset or twin named here is built now: no progress bars
    if not model:
        raise SmolforgeError(f"--model-type {wanted} names a family, not a model",
                             fix="add --model-name NAME (or --model NAME): an HF id, a local dir, a preset or twin")
    if wanted not in registered():
        close = difflib.get_close_matches(wanted, list(registered()), n=1)
        raise SmolforgeError(f"--model-type {wanted} is not a model family smolforge knows"
                             + (f" (did you mean {close[0]!r}?)" if close else ""),
                             fix=f"drop --model-type (the family is read from the model), or use one of "
                                 f"{', '.join(sorted(registered()))}")
    config = model_config(model)
    if config is not None and type(family_of(config)) is not type(family_of(wanted)):
        raise SmolforgeError(f"--model-type {wanted}, but {model} is a {config.get('model_type')} model",
                             fix=f"drop --model-type (the family is read from the model), or name a {wanted} model")
