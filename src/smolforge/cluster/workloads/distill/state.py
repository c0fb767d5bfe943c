"""The driver's record of a distillation run: its tasks, its teacher-output stores, its threads."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smolforge.cluster.workloads.distill.controller import DistillRun
from smolforge.cluster.workloads.distill.plans import TeacherPlan
from smolforge.distill.prompts import GenSettings, PromptItem
from smolforge.distill.store import StorePlan
from smolforge.errors import SmolforgeError
from smolforge.models.names import built_from_code

if TYPE_CHECKING:  # (annotations only: task_plans brings StudentConfig's torch)
    from smolforge.cluster.workloads.distill.sync import GroupSeat
    from smolforge.cluster.workloads.distill.task_plans import StudentTaskPlan

GET_TIMEOUT_S = 600.0
POLL_S = 0.25
PLACEMENT_POLL_S = 2.0  # how often queued students look for a node (one that joined, one that freed up)
BROKER_LOST_S = 60.0  # a broker silent this long is gone (it lives on the driver node, so this is rare)
MAX_STUDENT_RESTARTS = 2  # per student (per group, for a ddp group), after a worker process or node was lost
TASK_ENDED = ("completed", "failed", "cancelled")  # a teacher's or student's own states that end it


@dataclass
class DistillTask:
    task_id: str
    kind: str  # teacher | student | aggregate
    store: str
    state: str = "pending"  # pending | running | paused | completed | failed | cancelled
    node: str | None = None
    node_id: str | None = None
    queued: bool = False
    cpus: float = 1.0
    shards: list[int] = field(default_factory=list)
    done_shards: list[int] = field(default_factory=list)
    samples_done: int = 0
    samples_total: int = 0
    step: int = 0
    max_steps: int = 0
    loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    progress: float = 0.0
    error: str | None = None
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    output_dir: str | None = None
    result: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None
    resumed_step: int = 0  # steps done before this run (a resumed student): not part of its rate
    restarts: int = 0  # times a lost worker made this student start again
    attempt: int = 0  # the run's attempt of this task (`controller.Task.attempt`) it was last started as
    # A student's own record, typed (`task_plans.StudentTaskPlan`, frozen: its config, eval examples, resume
    # point and group seat; a restart or a group replaces it whole); None for a teacher or an aggregate.
    plan: StudentTaskPlan | None = field(default=None, repr=False)
    req_model: str | None = None  # the model resource a student's node must hold (asked at each placement)
    no_node_since: float | None = None  # a queued student no live node could run at all: since when (time.time())
    replace_timeout_s: float = 300.0  # how long such a student waits for a node before it fails (s)

    @property
    def seat(self) -> GroupSeat | None:
        """A student's seat in its ddp group; None alone (or not a student)."""
        return self.plan.group if self.plan is not None else None

    def take_last_step(self, result: dict[str, Any]) -> None:
        """A finished student's last step and loss, from its result.

        A quick student can end before the broker's progress for its last steps is drained (only a
        running task takes progress), so without this its curve, and its TensorBoard series, could be
        missing altogether (seen once in CI: `tensorboard/student1` never written)."""
        steps = int(result.get("steps") or 0)
        if steps >= self.step and result.get("final_loss") is not None:
            self.step, self.loss = steps, float(result["final_loss"])

    def status(self) -> dict[str, Any]:
        eta = None
        here = self.progress - (self.resumed_step / self.max_steps if self.max_steps else 0.0)
        if self.state == "running" and self.started and here > 0 and self.progress < 1:
            eta = (time.time() - self.started) * (1 - self.progress) / here
        return {"task_id": self.task_id, "kind": self.kind, "state": self.state, "progress": round(self.progress, 4),
                "node": self.node, "nodes": [self.node] if self.node else [], "queued": self.queued, "cpus": self.cpus,
                "samples_done": self.samples_done, "samples_total": self.samples_total, "eta_s": eta,
                "step": self.step, "max_steps": self.max_steps, "loss": self.loss,
                "lr": self.lr, "tokens_per_s": self.tokens_per_s,
                "error": self.error, "shards": list(self.shards), "done_shards": list(self.done_shards),
                "output_dir": self.output_dir, "started": self.started, "finished": self.finished}


@dataclass
class StoreState:
    """One teacher-output store: its plan, prompts, broker and who is working on it."""

    dir: Path
    plan: StorePlan
    items: list[PromptItem]
    teacher: str
    backend: str
    settings: GenSettings
    compress: bool
    broker: Any
    teacher_nodes: list[Any]
    teacher_req_model: str | None
    cpus_per_teacher: float
    device: str
    ollama_host: str | None = None
    teacher_url: str | None = None  # an openai teacher's endpoint
    teacher_key_file: str | None = None  # and its key's file (a path on the teacher's node, never the key)
    teacher_tokenizer: str | None = None
    max_retries: int = 2  # per shard: how often a failed teacher's shard goes to another node
    teacher_on_coordinator: bool = False  # its teachers run on the coordinator node (lent by the user)
    dtype: str = "fp32"  # the teacher's weights (a --dtype choice, smolforge.models.dtypes)
    quant: str = "q8_0"  # a llamacpp teacher's GGUF weights (--teacher-quant)
    written: set[int] = field(default_factory=set)
    regenerating: set[int] = field(default_factory=set)
    retries: dict[int, int] = field(default_factory=dict)
    next_rank: int = 0
    assigned: dict[str, list[int]] = field(default_factory=dict)
    eval_examples: list[dict[str, Any]] = field(default_factory=list)
    broker_silent_since: float | None = None  # when its broker first failed to answer a drain
    teacher_plan: TeacherPlan | None = None  # the stage's plan, sent whole to each of its teachers


class SessionState:
    def __init__(self):
        self.lock = threading.RLock()
        # One placement at a time (`Placing._place_waiting`: a plan, then its Places started, told to the
        # run), and a failure's verdict with the restart it asks for (`_group_member_failed`): held
        # across both, no other thread plans between a verdict ("waiting") and its restart, nor starts a
        # second copy of a group another thread's plan is starting (two groups for one CPU each: neither
        # meets). Taken before `lock`, never while holding it.
        self.placing = threading.RLock()
        self.tasks: dict[str, DistillTask] = {}
        self.stores: dict[str, StoreState] = {}
        self.handles: dict[str, Any] = {}  # task id -> generator / (actor, ref)
        self.counters = {"teacher": itertools.count(), "student": itertools.count(), "aggregate": itertools.count()}
        self.monitor: threading.Thread | None = None
        self.threads: list[threading.Thread] = []  # the monitor, and a thread per failure being decided
        # task id -> (what to wait on: a teacher's generator or a student's result ref, what to do when
        # it is ready: returns whether to go on waiting on it); `step` waits on them all at once
        self.watch: dict[str, tuple[Any, Any]] = {}
        self.driven = False  # True: whoever drives the run calls `step` (a job runner's poll); no monitor thread
        self.last_placement = 0.0
        self.closing = False
        self.node_names: dict[str, str] = {}
        # the run as the controller keeps it (decide.py): every verdict and placement comes from it
        self.run = DistillRun(max_restarts=MAX_STUDENT_RESTARTS)
        self.max_restarts = MAX_STUDENT_RESTARTS  # per student (per group): restarts after a lost worker
        self.journal: list[Any] | None = None  # a list: every event and plan kept (decide.replay)
        self.store_nos: list[str] = []  # the stores' keys in the order they came (shard keys, decide.shard_key)


def is_local_model(name: str) -> bool:
    return built_from_code(name) or Path(name).expanduser().exists()



def short_error(err: Exception) -> str:
    if isinstance(err, SmolforgeError):
        return err.render()
    cause = getattr(err, "cause", None)  # RayTaskError wraps the original
    if isinstance(cause, SmolforgeError):
        return cause.render()
    text = str(err).strip().splitlines()
    tail = [line for line in text if line.strip()][-1:] if text else []
    return f"{type(err).__name__}: {tail[0] if tail else ''}"[:500]
