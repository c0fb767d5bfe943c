"""One error type for every problem a user can fix.

The CLI turns a `SmolforgeError` into one line (what, where, how to fix) and exit code 2,
so bad input never ends in a bare traceback.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping

FieldPath = tuple[Any, ...]  # a key path in a spec: ("distill", "save_every"); list items by index


class SmolforgeError(Exception):
    """A problem the user can fix: says what went wrong, where, and what to do.

    `field`: the spec key path it refuses, where a check of a value knows it (relative to what was
    checked until `in_spec` puts it under its section): `config.placed` turns it into the spec
    file's `file:line`, and a coordinator's 400 sends it along, so the client can do the same.

    `fields`: a refusal across settings (two that contradict each other, settings that need what a
    model lacks) names each of them, the one its fix would change first leading (`eval` before
    `eval_data`: "--no-eval skips the evaluation --eval-data asks for"); `field` is the first. The rule
    for its line: `config.placed` puts it at the line of the first of FIELDS that the spec file wrote (a
    value a flag or `--set` gave has no line there, so the next one is asked)."""

    exit_code = 2

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None, field: FieldPath | None = None,
                 fields: tuple[FieldPath, ...] = ()):
        self.what = what
        self.where = where
        self.fix = fix
        self.fields: tuple[FieldPath, ...] = tuple(tuple(f) for f in ((field,) if field is not None else ()) + tuple(fields))
        super().__init__(self.render())

    @property
    def field(self) -> FieldPath | None:
        """The first of `fields` (the one a single-setting refusal names), or None."""
        return self.fields[0] if self.fields else None

    @field.setter
    def field(self, value: FieldPath | None) -> None:
        """Name VALUE alone (None: no field)."""
        self.fields = () if value is None else (tuple(value),)

    def render(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


@contextmanager
def in_spec(*section: Any, names: Mapping[str, str] | None = None, default: FieldPath | None = None) -> Iterator[None]:
    """Refusals raised inside name their spec field as the spec has it: a refusal's `field` (a key of
    the object checked inside; DEFAULT for one without) renamed by NAMES (the checked object's key ->
    the spec's), under SECTION (`in_spec("distill")` around a check of the `distill:` section); each of
    a cross-setting refusal's `fields` so. Re-raises the same SmolforgeError; a refusal with neither
    field nor DEFAULT is left as it is."""
    try:
        yield
    except SmolforgeError as err:
        named = err.fields or ((default,) if default else ())
        err.fields = tuple((*section, (names or {}).get(f[0], f[0]), *f[1:]) for f in named if f)
        raise
