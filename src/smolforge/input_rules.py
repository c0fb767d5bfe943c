"""What any value from outside may be: one rule set for the coordinator's API and the CLI's parser.

Every string that can reach the job store, a path, a log line or a header is UTF-8 text (no lone
UTF-16 surrogate: Python keeps one from JSON's `\\ud800` or an undecodable argument byte, and it fails
later wherever the string is encoded, a 500 on every listing that shows it), holds no NUL byte (the
file system and C libraries cut or refuse there) and is at most `MAX_TEXT` characters. Every number
is finite (no NaN or infinity: comparisons with NaN are all false, so a bound checked with `<` lets
it through) and an integer fits SQLite's and torch's 64 bits.

Where each is applied: `cluster/api_input.py` (every JSON body, path and query parameter, before the
route runs), `config.Spec` (every spec, whichever road it came by: a YAML file, `--set`, the Python
API), `cli/common.run_cli` (every option and argument of every command, plus the bounds a flag
declares with `cli.common.bounded`). A stored row written before these rules is shown as damaged
(`cluster/control/jobstore.py`), using `first_problem` here too.
"""

from __future__ import annotations

import math
from typing import Any

from smolforge.errors import SmolforgeError

MAX_TEXT = 4096  # characters of one string: PATH_MAX, far above any name, id or setting
# characters of one command-line argument: a --set value or a JSON option is parsed into values that are
# each held to MAX_TEXT (and to their nesting bound) by the spec they fill
MAX_ARGUMENT = 65536
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # SQLite's INTEGER and torch's int64


def text_problem(value: str, limit: int = MAX_TEXT) -> str | None:
    """What is wrong with `value` as text from outside (None: nothing)."""
    if len(value) > limit:
        return f"is {len(value):,} characters long (at most {limit:,})"
    if "\x00" in value:
        return f"holds a NUL byte (at character {value.index(chr(0))})"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"is not UTF-8 text (a lone surrogate U+{ord(value[err.start]):04X} at character {err.start})"
    return None


def number_problem(value: int | float, *, ge: float | None = None, gt: float | None = None,
                   le: float | None = None, lt: float | None = None) -> str | None:
    """What is wrong with `value` as a number from outside, within the bounds given (None: nothing).
    Integers must fit 64 bits; floats must be finite."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "is not a finite number"
    if isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
        return f"is past the 64-bit range ({len(str(abs(value)))} digits)"
    for bound, ok, word in ((ge, lambda b: value >= b, "below"), (gt, lambda b: value > b, "at or below"),
                            (le, lambda b: value <= b, "above"), (lt, lambda b: value < b, "at or above")):
        if bound is not None and not ok(bound):
            return f"is {word} {bound:g}"
    return None


def first_problem(value: Any, where: str = "", depth: int = 0, numbers: bool = True) -> tuple[str, str] | None:
    """The first string (or, with `numbers`, number) in a JSON-like tree (dicts, lists, scalars) that
    breaks the rules, as (where, what); keys are text too. `where` is a dotted path ('train.model')."""
    if depth > 64:  # the routes and specs bound nesting to 32 before this runs
        return where, "nests too deeply"
    if isinstance(value, str):
        what = text_problem(value)
        return (where, what) if what else None
    if isinstance(value, (int, float)) and numbers:
        what = number_problem(value)
        return (where, what) if what else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        at = f"{where}.{key}" if where else str(key)
        if isinstance(key, str) and (what := text_problem(key, 200)):
            return where, f"the key {shown(key, 40)!r} {what}"
        found = first_problem(item, at, depth + 1, numbers)
        if found:
            return found
    return None


def shown(value: str, limit: int = 80, controls: bool = True) -> str:
    """`value` safe to print or send whatever it holds: surrogates (and, with `controls`, control
    characters) escaped, cut to `limit` characters."""
    text = value.encode("utf-8", "backslashreplace").decode("utf-8")
    if controls:
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "…"


def escaped(value: Any) -> Any:
    """A JSON-like tree with every string made safe to send (`shown`, without a cut or control escapes):
    a stored value written before the rules still renders."""
    if isinstance(value, str):
        return shown(value, MAX_TEXT * 16, controls=False) if text_problem(value, MAX_TEXT * 16) else value
    if isinstance(value, dict):
        return {escaped(k): escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escaped(v) for v in value]
    return value


def check_input(value: Any, where: str, fix: str) -> None:
    """Raise SmolforgeError (where, what, fix) for the first value in `value` that breaks the rules."""
    found = first_problem(value)
    if found:
        at, what = found
        at = shown(".".join(p for p in (where, at) if p), 200)
        raise SmolforgeError(what, where=at, fix=fix)
