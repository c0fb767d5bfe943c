"""Fault injection for tests and benchmarks, shared by every kind of training task on a node.

A data-parallel rank (`smolforge.cluster.workloads.data_parallel.rank`) and a distillation student
(`smolforge.distill.student`) read the same faults from the same place, so one test helper (a file
in the node's directory) acts on either. Each fault is read once where it acts, never per step:
with no fault set, none costs anything.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

from smolforge.paths import home
from smolforge.telemetry.tasklog import TASK_LOGGER

HOLD_LIMIT_S = 300.0  # a hold nobody releases ends here (fault `hold-step`): a forgotten file slows, never hangs
HOLD_POLL_S = 0.2


def node_dir() -> Path:
    """Per-machine scratch space: set by `worker join` for its node, else under SMOLFORGE_HOME."""
    env = os.environ.get("SMOLFORGE_NODE_DIR")
    if env:
        return Path(env)

    return home() / "node"


def fault_setting(name: str) -> str:
    """What fault `name` asks of this node's training tasks, from SMOLFORGE_FAULT_<NAME> or the file
    `fault-<name>` in the node's directory (which a test may write while the worker runs); "" when
    neither.

    Delays (`<fault>-s`, seconds: `fault_delay_s`), data-parallel ranks only: `sample-delay-s`, per
    sample in every forward (a slow machine); `result-delay-s`, before a rank hands back its result (a
    rank whose last report lags); `upload-delay-s`, before a checkpoint's upload commits (a slow link to
    the coordinator).

    `hold-step` (a step N, read as a data-parallel rank or a distillation student starts): the task
    stops after the step that takes it past N (N itself, unless a parameter server hands it steps with
    gaps), says so in a `held` event, and waits there until released (`stay_held`), so a test acts on
    a job at a known step instead of on one made "long enough" to still be running. A task that
    resumes past N does not hold. Hold every node of a job (a file in each node's directory): a rank
    that goes on would wait for the held ones at its next collective.

    `hold-shard` (a count N, read as a distillation teacher task starts): the teacher holds after
    handing over its N-th shard, until released, so a test sees two teachers running at once by the
    order of their shards, not by a clock.

    `hold-stage` ("<index> <method>", read as a serve job's stage actor starts: only a stage armed then reads it
    again, at each call of `forward` and `report`): stage <index>'s calls of <method> wait while the setting
    names them (`hold_while`), saying so in the stage's log first, so a test acts while a stage is inside a
    step (or its status group is busy) instead of on one made "long enough".

    `say-error` (a text, read as a data-parallel rank starts: `say_fault`): the rank logs it at ERROR
    through the task logger, so a test finds a known line from a known node by its level
    (`smolforge logs --level ERROR --node w2`)."""
    env = os.environ.get(f"SMOLFORGE_FAULT_{name.upper().replace('-', '_')}")
    if env:
        return env.strip()
    try:
        return (node_dir() / f"fault-{name}").read_text().strip()
    except OSError:
        return ""


def fault_delay_s(name: str) -> float:
    """Seconds of delay fault `name` asks of this node's ranks (`fault_setting(name + "-s")`), 0 if none."""
    try:
        return float(fault_setting(f"{name}-s") or 0)
    except ValueError:
        return 0.0


def fault_once(name: str) -> bool:
    """Whether fault `name` fires here, once in the whole cluster: its setting (`fault_setting`) names
    a ticket file, and the one task that removes it fires; every other, and every later one, goes on.
    A test writes the setting into each node's directory and the ticket once, so exactly one attempt
    fails wherever it lands (`export-fail`: an export task's process dies; `serve-start-fail`: a serve
    job's stages fail to start)."""
    ticket = fault_setting(name)
    if not ticket:
        return False
    try:
        Path(ticket).unlink()
    except OSError:
        return False
    return True


def say_fault() -> None:
    """Fault `say-error`: log its text at ERROR through the task logger (see `fault_setting`); nothing if unset."""
    said = fault_setting("say-error")
    if said:
        logging.getLogger(TASK_LOGGER).error("%s", said)


def fault_hold_step(fault: str = "hold-step") -> int | None:
    """The step after which this node's tasks hold (fault `hold-step`, or a teacher's `hold-shard`:
    see `fault_setting`), if any."""
    try:
        return int(fault_setting(fault)) or None
    except ValueError:
        return None


class HoldAt:
    """Whether the step a task just took passes the hold's step N (`fault_hold_step`, read once): its
    steps come in order, N itself or, from a parameter server, the first one past N."""

    def __init__(self, step: int | None):
        self.step = step
        self.last: int | None = None  # the step before this one (the first: as if steps had no gaps)

    def due(self, step: int) -> bool:
        last, self.last = (step - 1 if self.last is None else self.last), step
        return self.step is not None and last < self.step <= step


def held_message(who: str, step: int, fault: str = "hold-step") -> str:
    """The `held` event's message: which task, after which step, and the file that releases it."""
    return (f"{who} held after {'shard' if fault == 'hold-shard' else 'step'} {step} (fault injection: "
            f"{node_dir() / ('fault-' + fault)}); waiting for its release")


def stay_held(who: str, step: int, at: int, interrupt: Callable[[], str | None], fault: str = "hold-step") -> str:
    """Fault `hold-step` N = `at`: stay after `step` (the caller has said so in its `held` event)
    until released; why the hold ended, which the task's log also says.

    Released when the setting no longer names N (the test removed the file), when `interrupt()` says
    why the job needs the task to go on (a stop, a regroup, a member waiting to join: the request then
    lands at this step or the next boundary, never at one a race chose), or after HOLD_LIMIT_S.
    Holding costs one file read (and one `interrupt()`) per HOLD_POLL_S, and only while held."""
    deadline = time.time() + HOLD_LIMIT_S
    while not (why := interrupt() or _hold_over(at, deadline, fault)):
        time.sleep(HOLD_POLL_S)
    logging.getLogger(TASK_LOGGER).info("%s goes on after %s %d: %s", who, "shard" if fault == "hold-shard" else "step",
                                        step, why)
    return why


def hold_while(fault: str, value: str, who: str) -> str | None:
    """Wait while fault `fault`'s setting is `value` (`hold-stage`), read every HOLD_POLL_S, at most
    HOLD_LIMIT_S; None when it did not hold, else why the hold ended. Says "<who> held" in the task's log
    as it starts holding (what a test waits for) and why it goes on as it ends."""
    if fault_setting(fault) != value:
        return None
    logging.getLogger(TASK_LOGGER).info("%s held (fault injection: %s); waiting for its release", who,
                                        node_dir() / f"fault-{fault}")
    deadline = time.time() + HOLD_LIMIT_S
    while not (why := _hold_ends(lambda: fault_setting(fault) == value, deadline)):
        time.sleep(HOLD_POLL_S)
    logging.getLogger(TASK_LOGGER).info("%s goes on: %s", who, why)
    return why


def _hold_over(at: int, deadline: float, fault: str = "hold-step") -> str | None:
    """Why the hold of fault `fault` N = `at` ends now on its own (None: it goes on)."""
    return _hold_ends(lambda: fault_hold_step(fault) == at, deadline)


def _hold_ends(named: Callable[[], bool], deadline: float) -> str | None:
    """Why a hold ends now: "released" once `named()` (its setting still names this hold) is false, or past
    `deadline` (s, time.time()); None while it goes on. Every hold's one rule (`stay_held`, `hold_while`)."""
    if not named():
        return "released"
    if time.time() > deadline:
        return f"not released within {HOLD_LIMIT_S:.0f} s"
    return None
