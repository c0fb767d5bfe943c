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
    file's `file:line`, and a coordinator's 400 sends it along, so the client can do the same."""

    exit_code = 2

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None, field: FieldPath | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        self.field = field
        super().__init__(self.render())

    def render(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


@contextmanager
def in_spec(*section: Any, names: Mapping[str, str] | None = None, default: FieldPath | None = None) -> Iterator[None]:
    """Refusals raised inside name their spec field as the spec has it: a refusal's `field` (a key of
    the object checked inside; DEFAULT for one without) renamed by NAMES (the checked object's key ->
    the spec's), under SECTION (`in_spec("distill")` around a check of the `distill:` section).
    Re-raises the same SmolforgeError; a refusal with neither field nor DEFAULT is left as it is."""
    try:
        yield
    except SmolforgeError as err:
        field = err.field if err.field is not None else default
        if field:
            err.field = (*section, (names or {}).get(field[0], field[0]), *field[1:])
        raise
