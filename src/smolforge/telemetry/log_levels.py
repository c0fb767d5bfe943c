"""The level of a task's output line, and the words a log search takes (`smolforge logs`, `GET /api/v1/logs`).

A stored line (`JobStore.add_logs`) carries one of Python logging's five levels. The rule, in one place
(`line_level`), for a line that did not come through logging (a `print`, a library writing to stderr):

- a line in a logging format names its level: `ERROR smolforge.task: ...` (the tee's own format),
  `ERROR:root:...` (`logging.basicConfig`), `2026-11-29 12:00:01,234 - name - ERROR - ...`,
  `[2026-11-29 12:00:01] [ERROR] ...`, `12:00:01 WARNING ...`; `level=error` (logfmt); the one-letter
  glog prefix that torch's C++ side and absl write (`W1129 12:00:01.123 ...`: I, W, E, F);
- a Python warning (`file.py:12: UserWarning: ...`) is WARNING;
- anything else is INFO, whichever stream it came on: stderr alone does not make a line a warning
  (progress bars and most libraries' chatter are on stderr), only a level word does.

A line that came through logging keeps its record's own level (`level_name(record.levelno)`), the
lines of its traceback with it: the tee passes it (`telemetry/tasklog.py`).
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

from smolforge.errors import SmolforgeError

LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}
_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL", "ERR": "ERROR", "CRIT": "CRITICAL"}
_WORD = "DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL"
# an optional time stamp (bracketed or not), an optional `name -` / `name |`, then the level word,
# bracketed or followed by a space, a colon, a dash, a pipe or the end
_LOGGING = re.compile(
    r"^\s*(?:\[?\d+[-/:]\d[\d\-/:T.,+Z ]*\]?\s*(?:[-|]\s*)?)?(?:[\w.\-]+\s+[-|]\s+)?"
    rf"[\[(<]?({_WORD})[\])>]?(?=[\s:|\-]|$)")
_LOGFMT = re.compile(rf"(?:^|\s)level=\"?({_WORD})\b", re.IGNORECASE)
_GLOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d")
_PY_WARNING = re.compile(r"^\S.*:\d+: [A-Z]\w*Warning: ")
_GLOG_LEVELS = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_AGO = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")


def line_level(line: str) -> str:
    """The level a line of task output says it is (the module's rule): one of `LEVELS`, INFO by default.

    Pure: the same line always gets the same level; only the line's first 200 characters are read."""
    head = line[:200]
    for pattern in (_LOGGING, _LOGFMT):
        found = pattern.search(head)
        if found:
            word = found.group(1).upper()
            return _ALIASES.get(word, word)
    glog = _GLOG.match(head)
    if glog:
        return _GLOG_LEVELS[glog.group(1)]
    return "WARNING" if _PY_WARNING.match(head) else "INFO"


def level_name(levelno: int) -> str:
    """A logging level number as one of the five names: a custom level (25) as the standard one below it."""
    best = "DEBUG"
    for name, number in LEVELS.items():
        if levelno >= number:
            best = name
    return best


def parse_level(text: str, where: str = "level") -> int:
    """`ERROR`, `error`, `warn`, `40` -> the level's number (10..50). Raises SmolforgeError naming `where`."""
    word = str(text).strip().upper()
    word = _ALIASES.get(word, word)
    if word in LEVELS:
        return LEVELS[word]
    if word.isdigit() and int(word) in LEVELS.values():
        return int(word)
    raise SmolforgeError(f"{text!r} is not a log level", where=where,
                         fix="give one of DEBUG, INFO, WARNING, ERROR, CRITICAL (that level and above are shown)")


def parse_since(text: str, now: float, where: str = "since") -> float:
    """`10m`, `2h`, `30s`, `1d`, `1w` (that long before `now`), or an ISO 8601 time (`2026-11-29T18:00`,
    UTC unless it says its offset) -> seconds since the epoch. Raises SmolforgeError naming `where`."""
    raw = str(text).strip()
    ago = _AGO.match(raw.lower())
    if ago:
        return now - float(ago.group(1)) * _UNITS[ago.group(2)]
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise SmolforgeError(f"{text!r} is not a time", where=where,
                             fix="give a duration back from now (30s, 10m, 2h, 1d, 1w) or an ISO time "
                                 "(2026-11-29T18:00:00, UTC unless it carries an offset)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()
