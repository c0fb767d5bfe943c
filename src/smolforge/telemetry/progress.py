"""A rich progress bar with rate and ETA, or nothing when quiet (scripts, non-zero ranks)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)


def console(stderr: bool = True) -> Console:
    return Console(stderr=stderr)


class StepProgress:
    """Progress over optimizer steps, with a free-text field for loss and tokens/s."""

    def __init__(self, total: int, description: str = "train", quiet: bool = False, completed: int = 0):
        self._progress = None
        if quiet:
            return
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
            console=Console(stderr=True), transient=False, refresh_per_second=4,
            disable=not sys.stderr.isatty() and False,
        )
        self._task = self._progress.add_task(description, total=total, completed=completed, info="")
        self._progress.start()

    def update(self, completed: int, info: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, info=info)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
