"""One rank of a data-parallel job: a Ray actor that runs the ordinary training engine.

The actor is deliberately thin. It receives one typed `RankPlan` (the train config validated at
submit, the strategy and its settings, timeouts: `parallel.rank_task`) and where its group meets
(`Seat`), pins its torch threads to the CPUs Ray gave it, fetches what the job needs onto its own
disk (uploaded dataset, the checkpoint to resume from: there is no shared filesystem), joins the
process group, makes its strategy from a typed `RankContext` (nothing sets its attributes afterwards),
and calls `smolforge.train.engine.train` with hooks (`RankReports`); it hands back a
`RankResult` (the engine's `TrainResult` and where it ran), from which the runner's summary is made:

- `should_stop` reads a flag that a background thread refreshes from the job's control actor every
  half second (pause / cancel / regroup), so checking costs nothing per step; the engine max-reduces
  the decision across ranks so every rank leaves the loop at the same step.
- `on_step` / `on_eval` buffer progress that the same thread ships to the control actor in batches.
- what the rank prints and logs (`telemetry.tasklog`) rides in the same batches, as `r<rank>`'s lines,
  so `smolforge job logs` shows it without anyone reading the node's Ray logs.
- `on_checkpoint` (rank 0) uploads the checkpoint directory, checksummed, to the coordinator's
  artifact store and waits for the acknowledgement; it then reads the job's requests itself
  (`read_control`, not the poller's copy), and a requested regroup (a node joining or leaving) turns
  into a pause at this checkpoint boundary: the boundary after the request, never a later one that
  the poller's half second chose (`RankReports`, in `rank_reports.py`).
- a member of an elastic group (DiLoCo, a parameter server's workers) asked to leave (`job leave`)
  goes at its next boundary (`MemberLeaves`): it tells the control actor, leaves the process group,
  and the others go on without it as they do for a lost member.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ray.exceptions import RayError

from smolforge.config import TrainConfig
from smolforge.parallel.auto_probe import resolve as resolve_auto
from smolforge.parallel.rank_task import RankPlan, RankResult, Seat
from smolforge.models.loading import resolve_model
from smolforge.cluster.nodes.model_fetch import held_model_dir
from smolforge.cluster.nodes.ray_glue import node_ip
from smolforge.cluster.workloads.data_parallel.rank_reports import MemberLeaves, RankReports
from smolforge.cluster.workloads.data_parallel.stage_parts import PartFetch, local_model
from smolforge.parallel.rendezvous import init_group, leave_group, listen_socket, pick_backend
from smolforge.parallel.strategies import make_strategy
from smolforge.parallel.transfer import CHUNK_BYTES, DirReceiver, send_dir
from smolforge.paths import atomic_write_bytes
from smolforge.telemetry.tasklog import TASK_LOGGER, LineBuffer, capture_output, this_node
from smolforge.train.engine import train
from smolforge.train.faults import fault_delay_s, held_message, node_dir, say_fault, stay_held
from smolforge.train.rank_context import RankContext
from smolforge.train.strategy import Strategy

POLL_S = 0.5
REGROUP_WAIT_S = 120.0  # a member waiting for the others to re-form the group (the control actor decides in 60)


def _left(deadline: float) -> float:
    """Seconds to a deadline, for a `ray.get` timeout; a timeout error once it has passed."""
    from ray.exceptions import GetTimeoutError

    left = deadline - time.time()
    if left <= 0:
        raise GetTimeoutError("the transfer ran past its time limit")
    return left


def local_model_path(name: str) -> str:
    """The node's own copy of a model when `worker join` found one under that name, or one fetched
    into its models dir for this job (`nodes.model_fetch`)."""
    return held_model_dir(name) or name


def prepare_model(name: str, root: Path) -> None:
    """Materialise a tiny preset on this node before joining the process group, one rank at a time.

    Two reasons: ranks on one node would otherwise all build it at once, and a build inside an
    initialised process group goes wrong (transformers' save_pretrained writes the weights on rank 0
    only), leaving a preset directory without its model.
    """
    import fcntl


    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            resolve_model(name)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def drop_broken_group() -> None:
    """Leave the process group a lost peer broke now, before the next epoch is decided: a member still
    blocked in a collective on this one (a ring passes through every member) then fails as well and
    comes to the next epoch, instead of waiting there until the control actor leaves it out
    (REGROUP_GRACE_S; seen with three members, one leaving). The failed collective's traceback keeps
    the group alive (its frames hold the work and the group), so those frames are cleared first."""
    import gc
    import sys
    import traceback

    exc = sys.exc_info()[1]
    if exc is not None and exc.__traceback__ is not None:
        traceback.clear_frames(exc.__traceback__)
    leave_group()
    gc.collect()  # the group's sockets close with it


class ControlMembership:
    """How an elastic strategy's ranks re-form their group: through the job's control actor.

    Each rank binds a rendezvous socket on its own address, `enter`s the next epoch with it, and
    polls `view` until the control actor has decided who is in (every live member came, or a grace
    period passed). The lowest member hosts the store on its socket; the others close theirs."""

    def __init__(self, worker: "DPWorker", backend: str, timeout_s: float, admit_timeout_s: float):
        self.worker, self.backend, self.timeout_s = worker, backend, timeout_s
        self.admit_timeout_s = admit_timeout_s

    def joiners_waiting(self) -> bool:
        """Asked afresh at each outer step (the poller's copy may predate the last admission)."""
        import ray

        try:
            return bool(ray.get(self.worker.control.poll.remote(), timeout=10).get("joiners"))
        except RayError:
            return self.worker._joiners

    def regroup(self, epoch: int | None, admit: bool = False) -> dict:
        import ray

        control, member = self.worker.control, self.worker.rank
        if epoch is not None and not admit:  # a peer was lost (every member re-forms on purpose to admit)
            drop_broken_group()
        sock = listen_socket(node_ip())
        try:
            ray.get(control.enter.remote(epoch, member, sock.getsockname()[:2], admit), timeout=30)
            # a joiner waits for the others' next outer step; a member for the others to arrive
            limit = self.admit_timeout_s if epoch is None else REGROUP_WAIT_S
            deadline = time.time() + limit
            while True:
                view = ray.get(control.view.remote(epoch, member), timeout=30)
                if view is not None:
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"member {member}: the group did not re-form within {limit:.0f} s")
                time.sleep(0.2)
        except BaseException:
            sock.close()
            raise
        if view.get("excluded"):
            sock.close()
            raise RuntimeError(f"member {member} was left out of the group (it was too late or seen as gone)")
        if view["host"] == member:
            view = {**view, "listen": sock}
        else:
            sock.close()
        return {**view, "backend": self.backend, "timeout_s": self.timeout_s}


class ServerClient:
    """A parameter server's methods as plain calls (`PSStrategy.server`), each `ray.get` bounded: a server
    that died raises here, the rank fails, and the runner resumes the job from its last checkpoint."""

    def __init__(self, actor: Any):
        self.actor = actor

    def _call(self, method: str, *args: Any, timeout: float = 120.0) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def setup(self, spec: dict) -> bool:
        return self._call("setup", spec, timeout=600)

    def is_ready(self) -> bool:
        return self._call("is_ready")

    def exchange(self, member: int, wait_s: float, push: dict | None, have: int, pull_due: bool) -> dict:
        return self._call("exchange", member, wait_s, push, have, pull_due, timeout=wait_s + 600)

    def pull(self, member: int, which: str) -> dict:
        return self._call("pull", member, which, timeout=600)

    def stop(self, code: str) -> None:
        self._call("stop", code)

    def put_feedback(self, member: int, gen: int | None, table: dict, final: bool) -> None:
        self._call("put_feedback", member, gen, table, final, timeout=600)

    def snapshot(self, member: int | None = None, feedback: dict | None = None) -> dict:
        return self._call("snapshot", member, feedback, timeout=600)


class DPWorker:
    """Ray actor class (wrapped with ray.remote by WorkerGroup)."""

    def __init__(self, job_id: str, attempt: int, rank: int, cpus: float, control: Any):
        import torch

        self.job_id, self.attempt, self.rank = job_id, attempt, rank
        self.cpus = max(1, int(round(cpus)))
        torch.set_num_threads(self.cpus)
        self.control = control
        self._stop: str | None = None
        self._regroup = False
        self._joiners = False  # a member waits to join this (elastic) group
        self._leave = False  # this member is asked to leave the (elastic) group at its next boundary
        self._buffer: list[dict] = []
        self._lock = threading.Lock()
        self._running = False
        self._listen: socket.socket | None = None  # rank 0's store socket, from free_address to init_group
        self._log = LineBuffer(f"r{rank}", this_node())

    # -- placement info and rendezvous ----------------------------------------------------------

    def info(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "node_name": os.environ.get("SMOLFORGE_NODE_NAME") or socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "rank": self.rank}

    def free_address(self) -> tuple[str, int]:
        """Rank 0: where the group's rendezvous store will listen (this node's address, a free port)."""
        if self._listen is not None:
            self._listen.close()
        ip = node_ip()
        self._listen = listen_socket(ip)
        return ip, self._listen.getsockname()[1]

    # -- reporting --------------------------------------------------------------------------------

    def _emit(self, item: dict) -> None:
        item.setdefault("ts", time.time())
        item.setdefault("rank", self.rank)
        with self._lock:
            self._buffer.append(item)

    def _flush(self) -> None:
        """Send buffered reports and wait until the control actor has them.

        Waiting keeps this rank's reports in order (the control actor is threaded, so two reports in
        flight may land in either order and an older step could overwrite a newer one), and makes the
        last flush land before the task returns: the driver drains once it sees the task finish.
        """
        import ray

        with self._lock:
            batch, self._buffer = self._buffer, []
        batch += self._log.drain()
        if batch:
            ray.get(self.control.report.remote(batch), timeout=30)

    def _poller(self) -> None:
        import ray

        while self._running:
            try:
                self.read_control()
            except RayError:
                pass  # the driver notices a lost control actor; training need not stop for it
            try:
                self._flush()
            except RayError:
                pass  # the same: reports wait in the buffer for the next flush
            time.sleep(POLL_S)

    def read_control(self) -> None:
        """The job's requests now (the control actor's `poll`): the poller's each POLL_S, and rank 0's at a
        checkpoint, whose stop decision must not wait for the poller (a regroup asked for before a held
        rank went on lands at the checkpoint after it, not one a poll chose). Raises RayError."""
        import ray

        state = ray.get(self.control.poll.remote(), timeout=10)
        if state.get("stop"):
            self._stop = state["stop"]
        self._regroup = bool(state.get("regroup"))
        # a member waiting to join, not this one (its own wait, read just before the group took it in,
        # would end its first hold at once)
        self._joiners = bool(set(state.get("joiners") or ()) - {self.rank})
        self._leave = self.rank in (state.get("leave") or ())
        if state.get("regroup_now"):
            self._stop = self._stop or "pause"

    def _hold(self, step: int, at: int) -> None:
        """Fault injection `hold-step` N = `at` (`smolforge.train.faults`): stay after `step` until
        released, or until the job asks something of this rank (`_hold_interrupt`). The `held` event is
        what a test waits for; the poller keeps shipping it and the step's report meanwhile."""
        self._emit({"type": "event", "kind": "held", "data": {"rank": self.rank, "step": step},
                    "message": held_message(f"rank {self.rank}", step)})
        stay_held(f"rank {self.rank}", step, at, self._hold_interrupt)

    def _hold_interrupt(self) -> str | None:
        """What the job asks of a held rank (a stop, a regroup, a member waiting to join: the poller's
        flags, so asking costs nothing), which ends the hold; None while it asks nothing."""
        if self._stop or self._regroup or self._joiners or self._leave:
            return "the job asked for " + (self._stop or ("a regroup" if self._regroup else
                                                          "this member to leave" if self._leave else "a member to join"))
        return None

    # -- staging ----------------------------------------------------------------------------------

    def _stage_upload(self, ref: str, job_root: Path) -> str:
        """`upload:<sha256>` → a local file with that content (fetched once per node and job)."""
        import ray

        digest = ref.split(":", 1)[1]
        dest = job_root / "data" / f"{digest}.jsonl"
        if dest.exists() and hashlib.sha256(dest.read_bytes()).hexdigest() == digest:
            return str(dest)
        data = ray.get(self.control.get_upload.remote(digest), timeout=600)
        if hashlib.sha256(data).hexdigest() != digest:
            raise RuntimeError(f"dataset {digest[:12]} arrived corrupted")

        atomic_write_bytes(dest, data)
        return str(dest)

    def _stage_checkpoint(self, name: str, out_dir: Path, timeout_s: float = 600.0) -> None:
        """Fetch a stored checkpoint in pieces into `<out_dir>/checkpoints/<name>` (verified, atomic)."""
        import ray

        deadline = time.time() + timeout_s
        files = ray.get(self.control.artifact_manifest.remote("checkpoints", name), timeout=timeout_s)
        receiver = DirReceiver(out_dir / "checkpoints" / name)
        try:
            for rel, info in files.items():
                offset = 0
                while offset < info["bytes"] or (offset == 0 and info["bytes"] == 0):
                    data = ray.get(self.control.get_piece.remote("checkpoints", name, rel, offset, CHUNK_BYTES),
                                   timeout=_left(deadline))
                    receiver.write(rel, offset, data)
                    offset += len(data)
                    if not data:
                        break
            receiver.commit({rel: info["sha256"] for rel, info in files.items()})
        finally:
            receiver.abort()

    def _upload_dir(self, kind: str, path: Path, timeout_s: float, keep_last: int | None = None) -> dict:
        """Hand a directory to the control actor's artifact store in pieces (`send_dir`); its metadata.
        An upload that fails or runs past `timeout_s` is aborted: the stored ones stay as they were."""
        import ray

        deadline = time.time() + timeout_s
        upload_id = ray.get(self.control.begin_artifact.remote(kind, path.name), timeout=_left(deadline))

        def put(rel: str, offset: int, data: bytes) -> None:
            ray.get(self.control.put_piece.remote(upload_id, rel, offset, data), timeout=_left(deadline))

        try:
            sums = send_dir(path, put)
            delay = fault_delay_s("upload-delay")
            if delay:
                time.sleep(delay)
            return ray.get(self.control.commit_artifact.remote(upload_id, sums, keep_last), timeout=_left(deadline))
        except BaseException:
            self.control.abort_artifact.remote(upload_id)  # fire and forget: the actor may be gone
            raise

    # -- the work ---------------------------------------------------------------------------------

    def run(self, task: RankPlan, seat: Seat, resume_from: str | None, server: Any = None) -> RankResult:
        """`_train`, this process's output (a traceback too) captured; after fault `say-error`'s line if set."""
        with capture_output(self._log):
            try:
                say_fault()
                return self._train(task, seat, resume_from, server)
            except MemberLeaves as left:
                logging.getLogger(TASK_LOGGER).info("%s", left)
                raise
            except BaseException:
                logging.getLogger(TASK_LOGGER).exception("rank %d failed", self.rank)
                raise
            finally:
                try:
                    self._flush()
                except RayError:
                    pass  # a lost control actor: the lines stay in the node's Ray log

    def _train(self, task: RankPlan, seat: Seat, resume_from: str | None, server: Any) -> RankResult:
        """Stage what the task needs on this node, meet the group, train, hand back the result. The
        poller runs from before the group forms until after the last report is flushed."""
        t0 = time.time()
        job_root = node_dir() / "jobs" / self.job_id
        out_dir = job_root / f"attempt-{self.attempt}-rank-{self.rank}"
        model, parts = local_model(task.train.model, task.strategy_class.stage_parts, seat.world,
                                   task.model_travels)  # the whole copy, else the config part (`stage_parts`)
        cfg = self._local_config(task.train, model, job_root, out_dir, resume_from)
        prepare_model(cfg.model, node_dir())
        if resume_from:
            self._stage_checkpoint(resume_from, out_dir)
        delay = fault_delay_s("sample-delay")
        reports = RankReports(self, task, cfg.log_every)
        self._running = True
        poller = threading.Thread(target=self._poller, daemon=True, name="dp-control-poller")
        poller.start()
        chosen = pick_backend(task.backend, cfg.device)
        adapter_meta = None
        try:
            grouped = self._meet(task, seat, chosen)  # then `auto` measures over the group and decides:
            task = resolve_auto(task, seat.world, self._emit if self.rank == 0 else None, cfg)
            t_ready = time.time()
            self._announce(task, seat, chosen if grouped else "via the parameter server", resume_from, delay)
            reports.strategy = self._strategy(task, seat, chosen, server, parts)
            result = train(cfg, reports.hooks(delay), strategy=reports.strategy)
            if self.rank == 0 and not result.stopped and result.adapter_dir:
                adapter_meta = self._upload_dir("adapter", Path(result.adapter_dir), 600.0)
        finally:
            self._running = False
            leave_group()
            poller.join(timeout=15)  # its own flush may hold the last batch; let it send first
            try:
                self._flush()
            except RayError:
                pass  # a lost control actor: the driver diagnoses the group, not this rank
        info = self.info()
        out = RankResult(train=result, rank=self.rank, world=seat.world, node_name=info["node_name"],
                         node_id=info["node_id"], setup_s=t_ready - t0,
                         adapter_artifact=adapter_meta["name"] if adapter_meta else None,
                         first_step_ts=reports.step_times[0] if reports.step_times else None,
                         cpu_step_s=reports.cpu_step_s(), step_times=reports.step_times if self.rank == 0 else None)
        time.sleep(fault_delay_s("result-delay"))
        return out

    def _local_config(self, cfg: TrainConfig, model: str, job_root: Path, out_dir: Path,
                      resume_from: str | None) -> TrainConfig:
        """The job's train config (validated at submit) as this rank runs it: uploaded data staged on this
        node's disk, `model` (the node's own copy of the model, or the config part: `stage_parts.local_model`),
        its own output directory and threads. TensorBoard and
        W&B are written by the job's runner from the reports (one run per rank, on the coordinator), not by
        the ranks on their nodes."""
        staged = {key: self._stage_upload(where, job_root) for key in ("path", "eval_path")
                  if isinstance(where := getattr(cfg.data, key), str) and where.startswith("upload:")}
        return cfg.model_copy(update={
            "data": cfg.data.model_copy(update=staged), "model": model,
            "output_dir": str(out_dir), "quiet": True, "num_threads": self.cpus, "tensorboard": False,
            "wandb": None, "resume": bool(resume_from)})

    def _meet(self, task: RankPlan, seat: Seat, backend: str) -> bool:
        """Join the round's process group when the strategy's ranks form one; returns whether they do.

        A joiner enters the group at its next re-formation (`ControlMembership`), not here; a
        parameter server's workers never meet."""
        grouped = task.strategy_class.uses_process_group
        if seat.world > 1 and not seat.join and grouped:
            listen, self._listen = (self._listen, None) if self.rank == 0 else (None, None)
            init_group(backend, seat.addr, seat.port, self.rank, seat.world, task.collective_timeout_s, seat.secret,
                       listen)
        return grouped

    def _announce(self, task: RankPlan, seat: Seat, how: str, resume_from: str | None, delay: float) -> None:
        """The `rank_started` event and the task log's first line: where this rank runs and how."""
        join = seat.join
        self._emit({"type": "event", "kind": "rank_started",
                    "message": f"{'member' if join else 'rank'} {self.rank}/{seat.world} "
                               f"{'waits to join' if join else 'started'} on {self.info()['node_name']} "
                               f"({how if seat.world > 1 else 'single'}, {self.cpus} threads"
                               f"{', resuming ' + resume_from if resume_from else ''}"
                               f"{f', slowed {delay} s per sample (fault injection)' if delay else ''})"})
        logging.getLogger(TASK_LOGGER).info("rank %d/%d on %s: %s, %d threads, %s", self.rank, seat.world,
                                            self._log.node, how, self.cpus,
                                            f"resuming {resume_from}" if resume_from else "from the start")

    def _strategy(self, task: RankPlan, seat: Seat, backend: str, server: Any, parts: bool) -> Strategy:
        """The task's strategy, made once the group exists (a distributed strategy needs it) from this rank's
        `RankContext`: its world and rank, the plan's balance, the job's parameter server (every exchange goes
        through it), the control actor (an elastic group re-forms through it), and where its stage's part comes
        from when this node lacks the model (`parts`: fetched once the rank has cut the model)."""
        cls, alone = task.strategy_class, seat.world == 1  # alone: the single-process strategy, nothing shared
        membership = (ControlMembership(self, backend, task.collective_timeout_s, task.collective_timeout_s)
                      if cls.elastic and not cls.needs_server and not alone else None)
        part = None
        if parts:  # this node lacks the model: the rank fetches its stage's part once it has cut it
            info = self.info()
            part = PartFetch(task.train.model, (info["node_id"], info["node_name"]), self.rank, self._emit)
        context = RankContext(world=seat.world, member=self.rank, balance=task.balance, membership=membership,
                              server=ServerClient(server) if cls.needs_server and not alone else None, model_part=part)
        return make_strategy("single" if alone else task.strategy, task.strategy_config, context)
