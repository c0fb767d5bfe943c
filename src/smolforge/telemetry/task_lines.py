"""The seeds' progress lines for `Orchestrator.monitor_tasks(ids)` called without a callback.

As SOLLOL's TEACHER_STUDENT_GUIDE.md shows them:

    [⠋] Task teacher_qwen2.5 - RUNNING (GPU-01)
    [⠙] Task student_0 - PENDING
    [✓] Task teacher_qwen2.5 - COMPLETED
    [✓] All tasks completed

A line is printed when a task's state, node or whole percent changes; a running task with progress
adds its percent, a failed one its error.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
MARKS = {"completed": "✓", "failed": "✗", "cancelled": "✗", "paused": "‖"}


def task_line(task_id: str, status: dict[str, Any], frame: int = 0) -> str:
    """One task's line: `[mark] Task ID - STATE (node)`, ` 45%` while running with progress, `: error`
    when failed. `frame` picks the spinner's character for a task not yet ended."""
    state = str(status.get("state") or "unknown")
    mark = MARKS.get(state, SPINNER[frame % len(SPINNER)])
    line = f"[{mark}] Task {task_id} - {state.upper()}"
    if status.get("node") and state == "running":
        line += f" ({status['node']})"
    progress = float(status.get("progress") or 0.0)
    if state == "running" and progress > 0:
        line += f" {progress:.0%}"
    if state == "failed" and status.get("error"):
        line += f": {str(status['error']).splitlines()[0][:200]}"
    return line


class SeedLines:
    """A `monitor_tasks` callback that prints the seeds' lines to `out` (stdout), and `done(statuses)`
    for the closing line."""

    def __init__(self, out: TextIO | None = None):
        self.out = out
        self.frame = 0
        self.shown: dict[str, str] = {}

    def __call__(self, task_id: str, status: dict[str, Any]) -> None:
        line = task_line(task_id, status, self.frame)
        key = line[4:]  # the spinner's character alone is no news
        if self.shown.get(task_id) != key:
            self.shown[task_id] = key
            self.frame += 1
            self._print(line)

    def done(self, statuses: dict[str, dict[str, Any]]) -> None:
        ended = [s.get("state") for s in statuses.values()]
        if ended and all(state == "completed" for state in ended):
            self._print("[✓] All tasks completed")
        else:
            left = sum(state != "completed" for state in ended)
            self._print(f"[✗] {left} of {len(ended)} tasks did not complete")

    def _print(self, line: str) -> None:
        out = self.out or sys.stdout
        out.write(line + "\n")
        out.flush()
