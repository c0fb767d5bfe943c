"""Where a single run's metrics go: a JSONL file (for scripts and the dashboard) plus the metric
sinks it asked for (TensorBoard, W&B: smolforge.telemetry.sinks)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from smolforge.telemetry.sinks import open_sinks


class MetricsWriter:
    """Appends one JSON object per event to metrics.jsonl and mirrors scalars to the run's sinks."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, append: bool = False,
                 wandb: str | None = None, run_name: str = "run", config: Mapping[str, Any] | None = None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")
        self._sinks = open_sinks(out_dir, tensorboard=tensorboard, wandb=wandb, name=run_name, config=config)

    def log(self, kind: str, step: int, **values: Any) -> None:
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._sinks.log(kind, step, values)

    def close(self) -> None:
        self._file.close()
        self._sinks.close()
