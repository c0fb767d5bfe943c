"""A task process's own output, captured line by line for the coordinator (`smolforge job logs`).

A task (a data-parallel rank, a distill student...) runs in a Ray worker process on some node; what it
prints and logs would otherwise stay in that node's Ray log files. `capture_output` tees the process's
`sys.stdout`/`sys.stderr` and Python logging into a `LineBuffer`, and the task's existing channel to
the coordinator (for a DP rank: its control-actor reports) ships `LineBuffer.drain()` in its batches.

The buffer is bounded on purpose: a task that prints faster than its channel drains must neither grow
without limit nor block training, so the oldest buffered lines give way (the newest say most about a
failure) and the next drain starts with one counted "N lines dropped" marker. The original streams
still get every byte, so the node's Ray log keeps the full text.

Only Python-level output is seen: a C extension writing straight to file descriptor 1 or 2 bypasses
`sys.stdout`, and stays in the node's log only.
"""

from __future__ import annotations

import io
import logging
import os
import socket
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator

from smolforge.telemetry.log_levels import level_name, line_level

MAX_BUFFERED_LINES = 2000  # between two drains (a DP rank drains every half second)
MAX_LINE_CHARS = 2000  # a longer line (a dumped tensor) is cut: the node's log has all of it
TASK_LOGGER = "smolforge.task"  # what a task says about itself (steps, phases), at INFO
SECRET_ENVS = ("SMOLFORGE_TOKEN",)  # values masked in every line, should a task print its environment


class LineBuffer:
    """Lines of one task, oldest first, at most `limit` of them; thread-safe, never blocks for long.

    `drain` returns the records to ship (`{"type": "log", "task", "node", "ts", "level", "line"}`), led
    by a WARNING marker record when lines were dropped since the last drain. A line's level is what its
    logging record said (`level`), else what the line says (`log_levels.line_level`).
    """

    def __init__(self, task: str, node: str, limit: int = MAX_BUFFERED_LINES, secrets: list[str] | None = None):
        self.task, self.node, self.limit = task, node, max(1, limit)
        self.secrets = [s for s in (secrets if secrets is not None else _env_secrets()) if s]
        self._lines: deque[tuple[float, str, str]] = deque()
        self._dropped = 0
        self._lock = threading.Lock()

    def add(self, line: str, ts: float | None = None, level: str | None = None) -> None:
        for secret in self.secrets:
            line = line.replace(secret, "***")
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + f" … ({len(line) - MAX_LINE_CHARS} more characters cut)"
        with self._lock:
            if len(self._lines) >= self.limit:
                self._lines.popleft()
                self._dropped += 1
            self._lines.append((ts or time.time(), line, level or line_level(line)))

    def drain(self) -> list[dict[str, Any]]:
        with self._lock:
            lines, self._lines = self._lines, deque()
            dropped, self._dropped = self._dropped, 0
        out = []
        if dropped:
            ts = lines[0][0] if lines else time.time()
            out.append(self._record(ts, f"[{dropped} lines dropped: the task printed faster than they could be "
                                        "sent; the node's Ray log has them]", "WARNING"))
        out.extend(self._record(ts, line, level) for ts, line, level in lines)
        return out

    def _record(self, ts: float, line: str, level: str) -> dict[str, Any]:
        return {"type": "log", "task": self.task, "node": self.node, "ts": ts, "level": level, "line": line}


def this_node() -> str:
    """The node's name as the cluster knows it (`worker join --name` sets it), else the host name."""
    return os.environ.get("SMOLFORGE_NODE_NAME") or socket.gethostname()


def _env_secrets() -> list[str]:
    return [os.environ[name] for name in SECRET_ENVS if os.environ.get(name)]


def _as_shown(line: str) -> str:
    """What a terminal would show of `line`: a progress bar redraws after each carriage return, so only
    the text after the last one (before a trailing one) is kept."""
    return line[line.rstrip("\r").rfind("\r") + 1:]


class _TeeStream(io.TextIOBase):
    """Writes go to the original stream unchanged and, split into lines, to the buffer."""

    def __init__(self, original: Any, buffer: LineBuffer):
        self.original, self.buffer = original, buffer
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        try:
            self.original.write(text)
        except (OSError, ValueError):
            pass  # a closed original stream must not break the task
        with self._lock:
            *lines, rest = (self._partial + text).split("\n")
            rest = _as_shown(rest)
            if len(rest) > MAX_LINE_CHARS:  # no newline for a long while: a line of its own, not a leak
                lines.append(rest)
                rest = ""
            self._partial = rest
        for line in lines:
            line = _as_shown(line).rstrip("\r")
            if line.strip():
                self.buffer.add(line)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            rest, self._partial = self._partial, ""
        if rest.strip("\r").strip():
            self.buffer.add(rest.rstrip("\r"))
        try:
            self.original.flush()
        except (OSError, ValueError):
            pass

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False  # line-buffered text, no progress-bar redraws

    def fileno(self) -> int:
        return self.original.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.original, "encoding", "utf-8")


class _BufferHandler(logging.Handler):
    """A logging record as whole lines in the buffer (a traceback: one line each), and on the original
    stderr; never through the tee, so a half-printed line cannot swallow it."""

    def __init__(self, buffer: LineBuffer, original: Any):
        super().__init__()
        self.buffer, self.original = buffer, original

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text, level = self.format(record), level_name(record.levelno)
            for line in text.splitlines():  # a traceback's lines at its record's level
                self.buffer.add(line, ts=record.created, level=level)
            self.original.write(text + "\n")
        except Exception:  # logging must never break the task
            self.handleError(record)


@contextmanager
def capture_output(buffer: LineBuffer) -> Iterator[LineBuffer]:
    """Tee this process's stdout, stderr and logging into `buffer` until the block ends.

    Logging records of every logger at WARNING and above, and `smolforge.*` at INFO, go through one
    handler into the buffer and onto the original stderr; the process's own handlers and levels come
    back afterwards.
    """
    stop = start_capture(buffer)
    try:
        yield buffer
    finally:
        stop()


def start_capture(buffer: LineBuffer):
    """`capture_output` for a process whose task has no one block to wrap (an actor that lives as long
    as its process: the parameter server); returns the function that undoes it."""
    out, err = _TeeStream(sys.stdout, buffer), _TeeStream(sys.stderr, buffer)
    old_out, old_err = sys.stdout, sys.stderr
    handler = _BufferHandler(buffer, sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root, ours = logging.getLogger(), logging.getLogger("smolforge")
    old_level = ours.level
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)
    sys.stdout, sys.stderr = out, err
    root.addHandler(handler)

    def stop() -> None:
        root.removeHandler(handler)
        ours.setLevel(old_level)
        sys.stdout, sys.stderr = old_out, old_err
        out.flush()
        err.flush()

    return stop
