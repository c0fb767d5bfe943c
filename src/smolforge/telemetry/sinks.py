"""Metric sinks: the one seam between "a number was measured" and TensorBoard / Weights & Biases.

The single-process trainer (through MetricsWriter), split learning, and the cluster runners (which
write every rank's and every student's series from the reports they already drain) all log through
here, so none of them grows its own copy of the TensorBoard or W&B glue.

A *series* is one run in those tools: the trainer has one; a data-parallel job has one per rank
(`rank<R>`), a distillation job one per student (`student<N>`). Each series gets its own TensorBoard
run directory (`<root>/tensorboard/<series>`) and its own W&B run, named like the seeds:
`{strategy}-{role}-{host}_rank{R}_lr{LR}_bs{BS}`.

W&B always runs offline (`mode="offline"`: never any network, whatever WANDB_MODE says); runs land in
`<root>/wandb/offline-run-*` and `wandb sync` uploads them later if the user wants that.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from smolforge.errors import SmolforgeError


class MetricSink(Protocol):
    """Where one series' scalars go."""

    def log(self, kind: str, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars(values: Mapping[str, Any]) -> dict[str, float]:
    """The plottable values: numbers that are not NaN/inf and not booleans."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def run_name(strategy: str, role: str, rank: int, lr: float, batch_size: int, host: str | None = None) -> str:
    """The seeds' run name: `{strategy}-{role}-{host}_rank{R}_lr{LR}_bs{BS}`."""
    return f"{strategy}-{role}-{host or socket.gethostname()}_rank{rank}_lr{lr:g}_bs{batch_size}"


class TensorBoardSink:
    """Scalars as `<kind>/<name>` (train/loss, eval/eval_loss) in one TensorBoard run directory."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._w = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, kind: str, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self._w.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self._w.flush()
        self._w.close()


class WandbSink:
    """One offline W&B run; several can be open in one process (one per rank on the coordinator)."""

    def __init__(self, project: str, name: str, root: str | Path, config: Mapping[str, Any] | None = None):
        try:
            import wandb
        except ImportError as err:
            raise SmolforgeError("--wandb needs the wandb package", where="--wandb",
                                 fix="pip install 'smolforge[wandb]' (or drop --wandb)") from err
        Path(root).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(mode="offline", silent=True, console="off", x_disable_stats=True,
                                  save_code=False, disable_git=True)
        self._run = wandb.init(project=project, name=name, dir=str(root), config=dict(config or {}),
                               reinit="create_new", settings=settings)
        self.run_dir = Path(self._run.dir).parent  # .../wandb/offline-run-<time>-<id>

    def log(self, kind: str, step: int, values: Mapping[str, float]) -> None:
        self._run.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class Sinks:
    """Every sink of one series: `log` fans out (non-scalars and NaN are dropped), `close` closes all."""

    def __init__(self, sinks: list[MetricSink] | None = None):
        self.sinks = list(sinks or [])
        self._last_step = -1

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log(self, kind: str, step: int, values: Mapping[str, Any]) -> None:
        nums = scalars(values)
        if not nums or not self.sinks:
            return
        # W&B drops a step lower than one the run has seen (a re-formed group repeats the steps since its
        # checkpoint): keep the first pass of each step, in every sink alike.
        if step < self._last_step:
            return
        self._last_step = step
        for sink in self.sinks:
            sink.log(kind, step, nums)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def open_sinks(root: str | Path, *, tensorboard: bool, wandb: str | None, name: str,
               config: Mapping[str, Any] | None = None, series: str | None = None) -> Sinks:
    """The sinks one series asked for, under `root` (TensorBoard in `root/tensorboard[/series]`,
    W&B runs in `root/wandb/`)."""
    root = Path(root)
    out: list[MetricSink] = []
    if tensorboard:
        out.append(TensorBoardSink(root / "tensorboard" / series if series else root / "tensorboard"))
    if wandb:
        out.append(WandbSink(wandb, name, root, config))
    return Sinks(out)


class SeriesSinks:
    """Sinks opened lazily per series (`rank0`, `student1`...): what a cluster runner keeps for a job,
    since it learns which ranks or students exist only from their reports."""

    def __init__(self, root: str | Path, *, tensorboard: bool, wandb: str | None,
                 name_for: Callable[[str], str], config: Mapping[str, Any] | None = None):
        self.root = Path(root)
        self.tensorboard, self.wandb = tensorboard, wandb
        self.name_for, self.config = name_for, dict(config or {})
        self._open: dict[str, Sinks] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard or self.wandb)

    def log(self, series: str, kind: str, step: int, values: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        sinks = self._open.get(series)
        if sinks is None:
            sinks = self._open[series] = open_sinks(self.root, tensorboard=self.tensorboard, wandb=self.wandb,
                                                    name=self.name_for(series), series=series,
                                                    config={**self.config, "series": series})
        sinks.log(kind, step, values)

    def close(self) -> None:
        opened, self._open = self._open, {}
        for sinks in opened.values():
            sinks.close()
