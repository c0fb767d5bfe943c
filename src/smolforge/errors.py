"""One error type for every problem a user can fix.

The CLI turns a `SmolforgeError` into one line (what, where, how to fix) and exit code 2,
so bad input never ends in a bare traceback.
"""

from __future__ import annotations


class SmolforgeError(Exception):
    """A problem the user can fix: says what went wrong, where, and what to do."""

    exit_code = 2

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text
