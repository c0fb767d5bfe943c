"""What a data-parallel rank tells its job while it trains (`RankReports`, the engine's hooks), and how an
elastic member leaves (`MemberLeaves`). Split from `rank.py`, whose `DPWorker` owns the flags these read:
`should_stop` and the hold read the poller's copy of the job's requests; rank 0 reads them again at each
checkpoint (`DPWorker.read_control`), so a regroup asked for before the checkpoint lands at it."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from smolforge.parallel.rank_task import RankPlan
from smolforge.telemetry.tasklog import TASK_LOGGER
from smolforge.train.engine import TrainHooks
from smolforge.train.faults import HoldAt, fault_hold_step
from smolforge.train.strategy import Strategy

COMM_REPORT_EVERY = 5  # steps between a rank's communication reports (bytes, waits) to the job's metrics


class MemberLeaves(Exception):
    """Ends the task of an elastic group's member asked to leave (`job leave`), at its next boundary;
    the runner records it as left (`member_left`), never as failed."""

    def __init__(self, member: int, step: int, boundary: str):
        super().__init__(member, step, boundary)  # the args rebuild it when Ray hands it to the runner
        self.member, self.step, self.boundary = member, step, boundary

    def __str__(self) -> str:
        return f"member {self.member} left the group after step {self.step} (its next {self.boundary}), as asked"


def slow_down(model, per_sample_s: float) -> None:
    """Make every forward of `model` take `per_sample_s` longer per row (see fault_delay_s)."""

    def pause(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        time.sleep(per_sample_s * (int(ids.shape[0]) if ids is not None else 1))

    model.register_forward_pre_hook(pause, with_kwargs=True)



class RankReports:
    """What a rank tells its job while it trains: the engine's hooks (`TrainHooks`).

    Every rank reports its own steps (the runner keeps `<name>.rank<R>` series and one TensorBoard/W&B
    run per rank; rank 0's report is also the job's progress) and, every few steps, its communication;
    rank 0 turns the strategy's decisions into the job's events, uploads checkpoints and makes the stop
    decision the engine shares with the others."""

    def __init__(self, worker: Any, task: RankPlan, log_every: int):  # worker: rank.DPWorker
        self.worker, self.task, self.log_every = worker, task, log_every
        self.is_main = worker.rank == 0
        self.strategy: Strategy | None = None  # once the group exists
        self.step_times: list[float] = []
        self.cpu_times: list[float] = []  # this process's CPU time (all threads): overhead that waits hide
        self.hold = HoldAt(fault_hold_step())

    def hooks(self, delay: float) -> TrainHooks:
        return TrainHooks(on_step=self.on_step, on_checkpoint=self.on_checkpoint, on_eval=self.on_eval,
                          should_stop=self.should_stop,
                          on_model=(lambda m: slow_down(m, delay)) if delay > 0 else None)

    def cpu_step_s(self) -> float | None:
        times = self.cpu_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    def on_step(self, info) -> None:
        self.step_times.append(time.time())
        if info.step % self.log_every == 0 or info.step == info.max_steps:
            logging.getLogger(TASK_LOGGER).info("rank %d step %d/%d: loss %.4f, %.0f tokens/s", self.worker.rank,
                                                info.step, info.max_steps, info.loss, info.tokens_per_s or 0.0)
        self.cpu_times.append(time.process_time())
        if self.strategy is not None:
            self._comm(info)
            self._decisions(info)
        recent = self.step_times[-20:]
        per_step = (recent[-1] - recent[0]) / (len(recent) - 1) if len(recent) > 1 else None
        self.worker._emit({"type": "step", "step": info.step, "max_steps": info.max_steps, "loss": info.loss,
                           "lr": info.lr, "grad_norm": info.grad_norm, "tokens_per_s": info.tokens_per_s,
                           "samples_done": info.samples_done, "samples_total": info.samples_total,
                           "epoch": info.epoch,
                           "eta_s": per_step * (info.max_steps - info.step) if per_step else None})
        if self.hold.due(info.step):
            self.worker._hold(info.step, self.hold.step)
        self._leave_if_asked(info)

    def _leave_if_asked(self, info) -> None:
        """A member asked to leave goes at its next boundary (DiLoCo: an outer step; a parameter server's
        worker: any step), never at the last step (the group ends together there) and never as rank 0
        (the runner re-forms the group without the node instead). It tells the control actor first, so
        the others' next group never waits for it."""
        import ray

        s, worker = self.strategy, self.worker
        if not worker._leave or self.is_main or s is None or info.step >= info.max_steps or not s.at_boundary(info.step):
            return
        ray.get(worker.control.member_left.remote(worker.rank), timeout=30)
        raise MemberLeaves(worker.rank, info.step, "outer step" if getattr(s, "inner_steps", None) else "step")

    def _comm(self, info) -> None:
        """Bytes, waits and the strategy's own numbers, every COMM_REPORT_EVERY steps and at the last."""
        s = self.strategy
        if info.step % COMM_REPORT_EVERY == 0 or info.step == info.max_steps:
            self.worker._emit({"type": "comm", "step": info.step, "comm_bytes_sent": s.bytes_sent,
                               "comm_wait_s": s.comm_wait_s, "rounds": s.rounds,
                               "batch_rows": s.rows[s.rank] if s.rows else None, "metrics": s.metrics()})

    def _decisions(self, info) -> None:
        """What the strategy decided (a plan, a re-formed group, a rebalance): rank 0 makes them job events."""
        emit, notes = self.worker._emit, self.strategy.notes
        while notes:
            note = notes.pop(0)
            if not self.is_main:
                continue
            if note.get("event"):  # a decision the strategy states itself (a plan)
                emit({"type": "event", "kind": note["event"], "message": note["message"], "data": note})
            if note.get("kind") == "regroup":
                joined = f"; joined: {', '.join(map(str, note['joined']))}" if note["joined"] else ""
                emit({"type": "event", "kind": "group_reformed",
                      "message": f"step {note['step']}: the group re-formed with members "
                                 f"{', '.join(map(str, note['members']))} ({note['why']}{joined}), no restart",
                      "data": note})
            if note.get("kind") == "balance":
                rates = " / ".join(f"{r:.1f}" for r in note["rates"])
                emit({"type": "event", "kind": "balance",
                      "message": f"step {info.step}: rows per rank {' / '.join(map(str, note['rows']))} "
                                 f"(measured {rates} samples/s)", "data": note})

    def on_eval(self, metrics: dict) -> None:
        if self.is_main:
            self.worker._emit({"type": "eval", **metrics})

    def on_checkpoint(self, path: Path, step: int) -> None:
        """Upload it (checksummed) and wait for the store's acknowledgement; a requested regroup turns into a
        pause at this checkpoint boundary."""
        worker = self.worker
        meta = worker._upload_dir("checkpoints", Path(path), self.task.upload_timeout_s, self.task.keep_last)
        worker._emit({"type": "event", "kind": "checkpoint",
                      "message": f"checkpoint step {step} stored ({meta['bytes']:,} bytes, sha256-checked)",
                      "data": {"step": step, "name": Path(path).name}})
        worker.read_control()
        if worker._regroup:
            worker._stop = worker._stop or "pause"

    def should_stop(self) -> str | None:
        return self.worker._stop if self.is_main else None
