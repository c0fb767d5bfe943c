"""The client side of a split job as a Ray actor: the data, the labels, the bottom and the top.

It runs `smolforge.split.trainer.SplitTrainer` where the job's `client_node` says, with a connection
that follows the trunk (`FollowingTrunkClient`): while the trunk cannot be reached, it asks the
actor where the trunk is now (the runner tells it, `set_trunk`, each time it places one); once the
trunk is elsewhere it reconnects there, the new server does not know the session, and the trainer
rolls back to the newest checkpoint both sides hold (`SessionLost`, as after a server restart), so
the client resumes instead of failing. On a `--tls` cluster it trusts exactly the cluster's CA (the
trunk serves with its node's certificate, which that CA signed), so the hidden states, gradients and
the job's token never cross the network in clear. After each checkpoint the trunk's half goes to the
coordinator (`TrunkActor.ship`) before training goes on: the trunk placed next starts from it; then
the client's own half goes there too (`CLIENT_CHECKPOINTS`), so a client placed again on another node
after its node died (`runner.SplitRunner._client_lost`, `placement.client_plan`) fetches them first and
both sides resume from the newest checkpoint they share.

What it did (steps with their loss, checkpoints, resumes, a hold) waits in `status()` for the runner,
with the lines this process printed. Its own checkpoints stay on its node (`<node dir>/split/<job>/`),
with the data: a next attempt on that node resumes from them, one on another node from the stored ones.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from smolforge.cluster.control.kinds import CLIENT_CHECKPOINTS
from smolforge.cluster.control.specs import SplitJob
from smolforge.cluster.nodes import ray_tls
from smolforge.cluster.workloads.split.artifacts import download_dir, upload_dir
from smolforge.telemetry.tasklog import TASK_LOGGER, LineBuffer, start_capture, this_node
from smolforge.train.faults import HoldAt, fault_hold_step, held_message, node_dir, stay_held

KEEP_STORED = 2  # client checkpoints the coordinator keeps per job, as for the trunk's
PROBE_S = 5.0  # how long one connection retries an unreachable trunk before asking where it is now
SHIP_TIMEOUT_S = 600.0
log = logging.getLogger(TASK_LOGGER)


class TrunkUnreachable(RuntimeError):
    """The trunk stayed out of reach past the job's patience: a lost node, not the job's own making
    (a plain error, so the job's FailurePolicy may try again)."""


class FollowingTrunkClient:
    """What `SplitTrainer` needs of a `TrunkClient` (call, info, address, counters, close), following
    the trunk to wherever the runner placed it last (`locate`), for at most `patience_s` per call."""

    def __init__(self, locate: Callable[[], tuple[str, int] | None], token: str, *, rpc_timeout: float,
                 patience_s: float, tls_ca: str | None = None):
        self.locate, self.token, self.rpc_timeout, self.patience_s = locate, token, rpc_timeout, patience_s
        self.tls_ca = tls_ca  # the cluster's CA on a `--tls` cluster: the trunk's certificate must chain to it
        self.tls = bool(tls_ca)
        self.moves = 0
        self.where: tuple[str, int] | None = None
        self._client: Any = None  # connected at the first call, once a trunk listens (the client loads meanwhile)
        self._done = [0, 0, 0]  # bytes sent, bytes received, retries of the connections before this one

    def _connect(self, where: tuple[str, int]) -> None:
        from smolforge.split.client import TrunkClient

        self.where = where
        self._client = TrunkClient(where[0], where[1], self.token, tls_ca=self.tls_ca, rpc_timeout=self.rpc_timeout,
                                   reconnect_timeout=PROBE_S)

    @property
    def address(self) -> str:
        return self._client.address if self._client is not None else "(the trunk, once placed)"

    def _counter(self, i: int, name: str) -> int:
        return self._done[i] + (getattr(self._client, name) if self._client is not None else 0)

    @property
    def bytes_sent(self) -> int:
        return self._counter(0, "bytes_sent")

    @property
    def bytes_received(self) -> int:
        return self._counter(1, "bytes_received")

    @property
    def retries(self) -> int:
        return self._counter(2, "retries")

    def call(self, name: str, request, *, retry: bool = True, timeout: float | None = None):
        from smolforge.split.client import RETRY_CODES, TrunkCallError

        deadline = time.monotonic() + self.patience_s
        while True:
            if self._client is None:  # no trunk listens yet: the runner is placing it
                where = self.locate()
                if where is None:
                    if time.monotonic() > deadline:
                        raise TrunkUnreachable(f"no trunk listened within {self.patience_s:g} s")
                    time.sleep(0.5)
                    continue
                self._connect(where)
            try:
                return self._client.call(name, request, retry=retry, timeout=timeout)
            except TrunkCallError as err:
                if not retry or err.code not in RETRY_CODES:
                    raise
                if time.monotonic() > deadline:
                    raise TrunkUnreachable(f"the trunk at {self.address} stayed unreachable for "
                                           f"{self.patience_s:g} s: {err.what}") from None
                self._follow()

    def _follow(self) -> None:
        """Reconnect where the trunk is now, or wait a moment when it has not moved (yet)."""
        where = self.locate()
        if where is None or where == self.where:
            time.sleep(1.0)
            return
        old = self._client
        self._done = [self._done[0] + old.bytes_sent, self._done[1] + old.bytes_received, self._done[2] + old.retries]
        old.close()
        self.moves += 1
        log.info("the trunk is now at %s:%d; reconnecting (the session rolls back to the newest checkpoint both "
                 "sides hold)", *where)
        self._connect(where)

    def info(self, session_name: str = "", retry: bool = True):
        from smolforge.split.protocol import pb

        return self.call("Info", pb.InfoRequest(session_name=session_name), retry=retry)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class ClientActor:
    """Ray actor class: the client of one split job (threaded: `status` and `set_trunk` answer while
    `train` runs)."""

    def __init__(self, job_id: str, spec: SplitJob, control: Any, token: str, tls: bool = False):
        self.lines = LineBuffer("client", this_node())
        self.lines.secrets.append(token)
        start_capture(self.lines)
        self.job_id, self.spec, self.control, self.token = job_id, spec, control, token
        self.tls = tls
        self.root = node_dir() / "split" / job_id
        self.lock = threading.Lock()
        self.where: tuple[str, int] | None = None
        self.trunk: Any = None
        self.items: list[dict[str, Any]] = []
        self.stop_code: str | None = None
        self.last_step = 0
        self.since: tuple[float, int] | None = None  # (time, step) the logged rate counts from
        self.session = job_id
        self.hold = HoldAt(fault_hold_step())

    # -- from the runner ------------------------------------------------------------------------

    def set_trunk(self, host: str, port: int, trunk: Any) -> None:
        with self.lock:
            self.where, self.trunk = (host, port), trunk

    def request_stop(self, code: str) -> None:
        self.stop_code = code

    def status(self) -> dict[str, Any]:
        with self.lock:
            items, self.items = self.items, []
        return {"items": items, "lines": self.lines.drain(), "pid": os.getpid(), "node": this_node()}

    def _say(self, item: dict[str, Any]) -> None:
        with self.lock:
            self.items.append({**item, "ts": time.time()})

    # -- the run --------------------------------------------------------------------------------

    def train(self, session: str, stored: list[str] = ()) -> dict[str, Any]:
        """The whole client run (resuming from this node's checkpoints, and the `stored` client
        checkpoints the coordinator holds: step-N names, fetched first where this node lacks them); its
        summary. It starts as the trunk is placed: the model and data load meanwhile, the first call
        waits for the trunk. The final adapter goes to the coordinator as the job's `adapter` artifact."""
        from smolforge.split.trainer import SplitTrainer
        from smolforge.train.engine import TrainHooks

        self.session = session
        cfg = self._config(session)
        self._fetch(Path(cfg.output_dir) / "checkpoints", stored)
        files = ray_tls.node_files_from_env(required=True) if self.tls else None  # [2]: the cluster's CA
        client = FollowingTrunkClient(self._locate, self.token, rpc_timeout=cfg.rpc_timeout,
                                      patience_s=self.spec.replace_timeout_s + self.spec.start_timeout_s,
                                      tls_ca=files[2] if files else None)
        hooks = TrainHooks(on_step=self._on_step, on_checkpoint=self._on_checkpoint,
                           should_stop=lambda: self.stop_code)
        trainer = SplitTrainer(cfg, hooks, client=client)
        try:
            result = trainer.train()
        finally:
            trainer.close()
        out = result.to_dict()
        out["trunk_moves"] = client.moves
        if result.adapter_dir:
            out["artifact"] = upload_dir(self.control, "adapter", Path(result.adapter_dir).name,
                                         Path(result.adapter_dir), SHIP_TIMEOUT_S)
        return out

    def _config(self, session: str):
        from smolforge.cluster.workloads.data_parallel.rank import local_model_path, prepare_model
        from smolforge.split.trainer import SplitTrainConfig

        s = self.spec.split
        prepare_model(s.model, node_dir())
        # (server_host/port unused: the trainer talks through the FollowingTrunkClient it is handed)
        return SplitTrainConfig(**{**s.model_dump(), "model": local_model_path(s.model),
                                   "dataset": self._stage_data(s.dataset),
                                   "eval_dataset": s.eval_dataset and self._stage_data(s.eval_dataset)},
                                token=self.token, output_dir=str(self.root / "client"),
                                resume=True, session_name=session, quiet=True, reconnect_timeout=PROBE_S,
                                num_threads=max(1, int(self.spec.cpus)))

    def _fetch(self, root: Path, stored: list[str]) -> None:
        """The stored client checkpoints this node does not hold, into `root` (the trainer's)."""
        from smolforge.split import checkpoint as ckpt

        have = {ckpt.step_dir(root, step).name for step in ckpt.valid_steps(root)} if root.is_dir() else set()
        for name in stored:
            if name not in have:
                download_dir(self.control, CLIENT_CHECKPOINTS, name, root / name, SHIP_TIMEOUT_S)

    def _locate(self) -> tuple[str, int] | None:
        with self.lock:
            return self.where

    def _stage_data(self, dataset: str) -> str:
        """`upload:<sha256>` as a file on this node (fetched once per job), else the name as it is."""
        import ray

        if not dataset.startswith("upload:"):
            return dataset
        digest = dataset.split(":", 1)[1]
        dest = self.root / "data" / f"{digest}.jsonl"
        if not (dest.exists() and hashlib.sha256(dest.read_bytes()).hexdigest() == digest):
            from smolforge.paths import atomic_write_bytes

            data = ray.get(self.control.get_upload.remote(digest), timeout=SHIP_TIMEOUT_S)
            if hashlib.sha256(data).hexdigest() != digest:
                raise RuntimeError(f"dataset {digest[:12]} arrived corrupted")
            atomic_write_bytes(dest, data)
        return str(dest)

    # -- hooks (the trainer's thread) -------------------------------------------------------------

    def _on_step(self, info) -> None:
        if info.step <= self.last_step:  # the first step after a roll back to a shared checkpoint
            self._say({"type": "resumed", "step": info.step - 1, "from_step": self.last_step})
        self.last_step = info.step
        self._say({"type": "step", "step": info.step, "max_steps": info.max_steps, "loss": info.loss, "lr": info.lr,
                   "grad_norm": info.grad_norm, "samples_done": info.samples_done,
                   "samples_total": info.samples_total, "tokens_per_s": info.tokens_per_s})
        if self.since is None or info.step <= self.since[1]:
            self.since = (time.monotonic(), info.step)
        if info.step % self.spec.split.log_interval == 0 or info.step == info.max_steps:
            from smolforge.split.trainer import step_log

            rate = (info.step - self.since[1]) / max(1e-9, time.monotonic() - self.since[0])
            log.info(step_log(info.step, info.loss, info.lr, info.grad_norm, rate))
        if self.hold.due(info.step) and fault_hold_step() == self.hold.step:  # fault injection (train/faults.py)
            self._say({"type": "held", "step": info.step, "message": held_message("the split client", info.step)})
            stay_held("the split client", info.step, self.hold.step, lambda: self.stop_code)

    def _on_checkpoint(self, path: Path, step: int) -> None:
        """Both sides hold step `step` now: the trunk's half, then the client's, go to the coordinator
        before training on."""
        import ray

        with self.lock:
            trunk = self.trunk
        try:
            meta = ray.get(trunk.ship.remote(self.session, step), timeout=SHIP_TIMEOUT_S)
            upload_dir(self.control, CLIENT_CHECKPOINTS, Path(path).name, Path(path), SHIP_TIMEOUT_S,
                       keep_last=KEEP_STORED)
        except Exception as err:  # noqa: BLE001 - the trunk (or its node) went away: the next call finds out
            self._say({"type": "checkpoint_not_shipped", "step": step, "error": f"{type(err).__name__}: {err}"[:300]})
            return
        self._say({"type": "checkpoint", "step": step, "bytes": meta.get("bytes")})
