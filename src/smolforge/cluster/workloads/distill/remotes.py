"""The Ray side of a distillation run: the teacher task, the shard broker and the student actor.

See `smolforge.cluster.workloads.distill` for how data moves between them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from smolforge.cluster.workloads.distill.broker import (  # noqa: F401  (MAX_BROKER_LINES, WAIT_CALL_S: named here too)
    BROKER_THREADS, MAX_BROKER_LINES, WAIT_CALL_S, _ShardBroker,
)
from smolforge.cluster.workloads.distill.state import GET_TIMEOUT_S
from smolforge.cluster.workloads.distill.sync import SYNCS
from smolforge.cluster.workloads.distill.task_plans import StudentTaskPlan, TeacherTaskPlan
from smolforge.train.faults import fault_hold_step, held_message, stay_held
from smolforge.train.loop import StopRequested
from smolforge.distill.store import CorruptShardError, Shard, decode_shard
from smolforge.distill.student import train_student
from smolforge.distill.backends import teacher_backend
from smolforge.distill.teacher import make_teacher, produce_shards
from smolforge.errors import SmolforgeError
from smolforge.cluster.workloads.data_parallel.rank import local_model_path, node_dir, prepare_model
from smolforge.parallel.transfer import pack_dir, unpack_dir
from smolforge.telemetry.tasklog import TASK_LOGGER, LineBuffer, capture_output
from smolforge.train import checkpoint as ckpt

SHIP_LINES_S = 1.0  # how often a student sends what it printed to its broker (fire and forget)

# ------------------------------------------------------------------------------- remote definitions

def _node_model(name: str) -> str:
    """This node's own copy of a model, when `worker join` found it under that name (else the name)."""
    return local_model_path(name)


def _teacher_shards(plan: TeacherTaskPlan):
    """Ray streaming generator: one teacher on one node, yielding (manifest JSON, bytes) per shard."""

    # What it prints rides along with each shard's manifest (`log`: the driver takes it out); lines
    # after the last shard stay in the node's Ray log.
    lines = LineBuffer(plan.task_id, plan.node_name or "")
    with capture_output(lines):
        yield from _teacher_shards_captured(plan, lines)


def _teacher_shards_captured(plan: TeacherTaskPlan, lines: LineBuffer):
    import ray
    import torch

    torch.set_num_threads(plan.num_threads)
    ctx = ray.get_runtime_context()
    t = plan.teacher
    model = _node_model(t.model) if teacher_backend(t.backend).loader.weights else t.model
    teacher = make_teacher(model, t.backend, device=t.device, ollama_host=t.ollama_host, tokenizer=t.tokenizer,
                           dtype=t.dtype, quant=t.quant, n_threads=plan.num_threads,  # llamacpp: the task's CPUs
                           teacher_url=t.teacher_url, teacher_key_file=t.teacher_key_file)
    hold = fault_hold_step("hold-shard")  # fault injection for tests (train/faults.py): read once, here
    produced = produce_shards(teacher, plan.prompt_items(), plan.ranges(), replace(t.settings), compress=t.compress)
    for count, (manifest, data) in enumerate(produced, 1):
        manifest.update(node_id=ctx.get_node_id(), node=plan.node_name, task=plan.task_id,
                        teacher=t.model, finished=time.time(), pid=os.getpid())
        logging.getLogger(TASK_LOGGER).info("%s: shard %s done", plan.task_id, manifest.get("shard"))
        manifest["log"] = lines.drain()
        yield json.dumps(manifest), data
        if hold == count:  # the shard is the driver's already (a streaming generator runs ahead)
            logging.getLogger(TASK_LOGGER).info(held_message(plan.task_id, count, "hold-shard"))
            stay_held(plan.task_id, count, hold, lambda: None, "hold-shard")


class BrokerShardSource:
    """A student's shard source on the cluster: ask the broker, fetch bytes, verify, report corruption.

    Nothing here sleeps: each ask waits inside the broker (at most WAIT_CALL_S) until a shard, a stop or
    the store's failure arrives (`_ShardBroker.wait_next`); `timeout_s` without a shard ends in a
    SmolforgeError that says so."""

    def __init__(self, broker, rank: int, timeout_s: float = 900.0):
        self.broker, self.rank = broker, rank
        self.timeout_s = timeout_s

    def _call(self, method: str, *args):
        import ray

        return ray.get(getattr(self.broker, method).remote(*args), timeout=60)

    def expected_rows(self) -> int | None:
        plan = self._call("get_plan")
        mine = plan["assigned"][str(self.rank)]
        return sum(plan["shards"][s][1] - plan["shards"][s][0] for s in mine) * max(1, int(plan.get("samples_per_prompt", 1)))

    def _fetch(self, reply: dict[str, Any]) -> Shard | None:
        import ray

        manifest = json.loads(reply["manifest"])
        value = ray.get(reply["holder"][0], timeout=GET_TIMEOUT_S)
        data = value[1] if isinstance(value, (tuple, list)) else value
        try:
            return decode_shard(manifest, data)
        except CorruptShardError as err:
            self._call("report_corrupt", self.rank, reply["shard"], err.what)
            return None

    def _loop(self, ask) -> Shard | None:
        """`ask(wait_s)` until the broker hands a shard (None: this student's shards are done)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = ask(max(0.0, deadline - time.monotonic()))
            if reply["kind"] == "done":
                return None
            if reply["kind"] == "stop":
                raise StopRequested(reply["what"])
            if reply["kind"] == "failed":
                raise SmolforgeError(f"teachers failed before this student's shards were ready: {reply['error']}",
                                     fix="see the teacher task's error (smolforge status / the event log)")
            if reply["kind"] == "shard":
                shard = self._fetch(reply)
                if shard is not None:
                    return shard
                deadline = time.monotonic() + self.timeout_s  # regeneration takes a teacher's time
                continue
            if time.monotonic() >= deadline:
                raise SmolforgeError(f"waited {self.timeout_s:.0f}s for a teacher shard",
                                     fix="check that the teacher tasks are running (smolforge status)")

    def next_shard(self) -> Shard | None:
        return self._loop(lambda wait_s: self._call("wait_next", self.rank, wait_s))

    def get_shard(self, shard_id: int) -> Shard:
        shard = self._loop(lambda wait_s: self._call("wait_get", self.rank, shard_id, wait_s))
        if shard is None:
            raise SmolforgeError(f"shard {shard_id} is gone", fix="start the student without resume")
        return shard


class _StudentWorker:
    """Ray actor: one student (or one rank of a student group). Trains from the broker, returns its
    adapter files and summary."""

    _listen = None  # rank 0 of a group: the socket its rendezvous store will serve on

    def free_address(self) -> tuple[str, int]:
        """Rank 0 of a student group: where the group's rendezvous store will listen (as a
        data-parallel job's rank 0 does: `DPWorker.free_address`)."""
        from smolforge.cluster.nodes.ray_glue import node_ip
        from smolforge.parallel.rendezvous import listen_socket

        if self._listen is not None:
            self._listen.close()
        self._listen = listen_socket(node_ip())
        return self._listen.getsockname()[:2]

    def run(self, plan: StudentTaskPlan, broker, rank: int) -> dict[str, Any]:
        """`_train`, with what this process prints sent to the broker as the task's lines."""
        import ray

        lines = LineBuffer(plan.task_id or f"student-rank{rank}", plan.node_name or "")
        with capture_output(lines):
            try:
                return self._train(plan, broker, rank, lines)
            except BaseException:
                logging.getLogger(TASK_LOGGER).exception("%s failed", lines.task)
                raise
            finally:
                from ray.exceptions import RayError

                try:  # waited for: the lines reach the broker before the driver sees the result
                    ray.get(broker.add_lines.remote(lines.drain()), timeout=10)
                except RayError:
                    pass  # a lost broker: the lines stay in the node's Ray log

    def _train(self, plan: StudentTaskPlan, broker, rank: int, lines: LineBuffer) -> dict[str, Any]:
        import ray

        work = Path(tempfile.mkdtemp(prefix=f"smolforge-student-{rank}-"))
        resume = plan.resume  # the checkpoint this student paused at, shipped back from the driver
        if resume:
            unpack_dir(resume.payload, ckpt.checkpoints_dir(work / "out") / resume.name)
        cfg = plan.config_for(_node_model(plan.config.base_model), str(work / "out"))
        node_id = ray.get_runtime_context().get_node_id()

        def on_event(kind: str, **data: Any) -> None:
            broker.record.remote(rank, kind, {**data, "at": time.time(), "node_id": node_id, "pid": os.getpid()})

        def on_checkpoint(path: Path, step: int) -> None:
            # Waited for: the driver must hold it before this worker can be lost with it.
            ray.get(broker.put_checkpoint.remote(rank, {"name": path.name, "payload": pack_dir(path)}), timeout=120)

        shipped = [time.time()]
        task_log = logging.getLogger(TASK_LOGGER)
        task_log.info("%s (rank %d) on %s: %s, %s threads%s", lines.task, rank, lines.node, cfg.base_model,
                      cfg.num_threads, ", resuming" if resume else "")

        def on_step(info: dict[str, Any]) -> None:
            broker.set_progress.remote(rank, info)
            task_log.info("%s step %d/%d: loss %.4f", lines.task, info["step"], info["max_steps"], info["loss"])
            if time.time() - shipped[0] >= SHIP_LINES_S:
                shipped[0] = time.time()
                batch = lines.drain()
                if batch:
                    broker.add_lines.remote(batch)

        def should_stop() -> str | None:
            return ray.get(broker.should_stop.remote(rank), timeout=60)

        # A preset is built here before any process group exists, one student of the node at a time
        # (as a data-parallel rank does: building inside a group writes the weights on rank 0 only).
        prepare_model(cfg.base_model, node_dir())
        group = plan.group
        sync = SYNCS[group.sync if group else "average"]  # (its `join`: the strategy was checked when the group formed)
        listen, self._listen = self._listen, None
        try:
            eval_examples = None if plan.eval_examples is None else list(plan.eval_examples)
            with sync.join(group, BrokerShardSource(broker, rank, timeout_s=cfg.wait_timeout_s), listen) as (strategy, source):
                result = train_student(cfg, source, teacher_tokenizer_hash=plan.teacher_hash, on_event=on_event,
                                       should_stop=should_stop, on_step=on_step, eval_examples=eval_examples,
                                       on_checkpoint=on_checkpoint, strategy=strategy)
            adapter = pack_dir(result.adapter_dir) if result.adapter_dir else None
            out = {"result": result.to_dict(), "adapter": adapter, "node_id": node_id}
            latest = ckpt.latest_checkpoint(work / "out") if result.stopped == "pause" else None
            if latest is not None:  # this temp dir goes away: the driver keeps the pause point
                out["checkpoint"] = {"name": latest.name, "payload": pack_dir(latest)}
            return out
        finally:
            shutil.rmtree(work, ignore_errors=True)


_REMOTES: dict[str, Any] = {}
_REMOTES_LOCK = threading.Lock()


def remotes() -> dict[str, Any]:
    """The remote teacher function and broker and student classes, built once per process and shared by
    every job its driver runs at once: built whole under a lock, then published, so a concurrent first
    caller never sees a partial table (it did: KeyError 'broker', stop 58)."""
    import ray

    with _REMOTES_LOCK:
        if not _REMOTES:
            # max_calls=1: each teacher gets a fresh worker process, which exits after it. A teacher
            # cancelled mid-import (a job cancel or pause while it loads transformers) otherwise leaves
            # the pooled process with half-imported modules, and every later teacher there fails with
            # "Could not import module 'LlamaConfig'" (seen in CI after the cancel test).
            built = {"teacher": ray.remote(num_returns="streaming", max_retries=0, max_calls=1)(_teacher_shards),
                     "broker": ray.remote(_ShardBroker), "student": ray.remote(_StudentWorker)}
            _REMOTES.update(built)
    return _REMOTES


BROKER_START_S = 300.0


def new_broker(plan: dict[str, Any]):
    """The broker lives on the driver's node: it holds the shard refs and the students' shipped
    checkpoints, so it must not go down with a worker."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    # Hard affinity: a soft one was seen to land the broker on a worker (which then took the whole
    # run down with it when that worker left). The driver's own node always exists.
    broker = remotes()["broker"].options(num_cpus=0, max_concurrency=BROKER_THREADS,
                                         scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote(plan)
    try:  # its first answer waits for a new worker process (Python and Ray; its module imports no torch)
        where = ray.get(broker.node.remote(), timeout=BROKER_START_S)
    except ray.exceptions.GetTimeoutError:
        ray.kill(broker)
        raise SmolforgeError(f"the shard broker did not start within {BROKER_START_S:.0f} s",
                             fix="the coordinator's machine is overloaded or out of memory: free it and rerun "
                                 "(finished shards are kept)") from None
    if where != here:  # a guard: the run must not depend on a worker staying
        ray.kill(broker)
        raise SmolforgeError(f"the shard broker started on node {where[:8]}, not on the driver's {here[:8]}",
                             fix="report this: the broker must live on the coordinator's node")
    return broker


# ------------------------------------------------------------------------------------ driver state
