"""A parameter-server strategy's worker side (`PSStrategy`): the ordinary training loop against a server.

The loop's optimizer step becomes a push (`ServerOptimizer`: the gradients, encoded, go to the server
with the next claim, one round trip per part) and its next step a claim (`next_step`: the server
hands out parts of the global steps, `ps_server.ServerCore`). A part's gradient is normalised over
the whole step's loss tokens, as a DDP rank's is, so the server's sum of the parts is the step's.

Checkpoints: rank 0 takes an atomic snapshot of the server (weights, optimizer state, versions,
Polyak average) and writes it as an ordinary checkpoint at the step it resumes from
(`checkpoint_step`); its optimizer state is AdamW's own, so it resumes under any other strategy and
a job whose server's node died resumes on another node from it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from smolforge.parallel.codec_settings import CodecFields
from smolforge.parallel.codecs import ErrorFeedback, make_codec, payload_bytes
from smolforge.parallel.strategies.ps_feedback import FeedbackMarks
from smolforge.parallel.strategies.ps_pull import PulledWeights, pulled_bytes
from smolforge.parallel.strategies.ps_server import OPTIMIZERS, ServerCore, to_numpy, to_torch
from smolforge.train import balance
from smolforge.train.loop import StopRequested
from smolforge.train.rank_context import ParamServer, RankContext
from smolforge.train.strategy import Strategy

SETUP_WAIT_S = 600.0  # a worker waiting for rank 0 to start the server (rank 0 may still be loading)
STALL_S = 900.0  # a worker that gets no step to take for this long gives up, saying why


class CodecSettings(CodecFields):
    """How a parameter server's workers push their gradients (every PS strategy's `strategy_config` has these:
    the codec's fields, `CodecFields`, and how workers pull). A lossy codec's error feedback stays on the
    worker; its residuals go into checkpoints (`ps_feedback.py`)."""

    pull: Literal["codec", "full"] = Field(
        "codec", description="how workers get newer weights: codec, what changed since their version through "
                             "the codec, error feedback on the server (ps_pull.py); full, the fp32 weights")


class ServerOptimizer(torch.optim.Optimizer):
    """What the loop and its LR schedule see as the optimizer: its step hands the gradients to the server,
    which holds the real one."""

    def __init__(self, groups: list[dict[str, Any]], strategy: "PSStrategy", defaults: dict[str, Any]):
        super().__init__(groups, defaults)
        self.strategy = strategy

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch's signature
        self.strategy.push(lr=float(self.param_groups[0]["lr"]))


class PSStrategy(Strategy):
    """The worker side of a parameter-server strategy. `server`: the server's methods as plain calls,
    set by the worker glue (a Ray actor behind it) or a test (a `ServerCore` itself)."""

    elastic = True  # a worker other than rank 0 that dies is left out; the others go on
    needs_server = True  # the runner starts a parameter server for the job's round
    uses_process_group = False  # workers never talk to each other
    Server: ClassVar[type[ServerCore]] = ServerCore
    pull_every = 1
    wait_s = 1.0  # one claim's wait at the server before the worker looks again

    def __init__(self, context: RankContext | None = None, **config: Any):
        settings = self.Settings(**config) if self.Settings else None
        super().__init__(context)
        self.config = settings.model_dump() if settings else {}
        self.server: ParamServer | None = self.context.server  # the job's server (the context's)
        self.member, self.nominal_world = self.context.member, self.context.world
        self.codec = ErrorFeedback(make_codec(self.config.get("codec", "fp32"), **self.config))
        self.marks = FeedbackMarks(self.codec)  # its residual before each push the server may resume before
        self.pulled = PulledWeights(self.codec.coder)  # its fp32 copy of what it pulled (`ps_pull.py`)
        self.pull_every = int(self.config.get("pull_every", 1))
        self.final = self.config.get("final", "raw")
        self.named: list[tuple[str, torch.nn.Parameter]] = []
        self.groups: list[dict[str, Any]] = []
        self.optimizer_kind, self.defaults = "AdamW", {}
        self.version = -1  # of the weights this worker holds
        self.claimed: dict[str, Any] | None = None
        self.since_pull = 10 ** 9  # pull at the first claim (a joiner's weights are not the server's)
        self.targets, self.max_norm, self.step_total = 0.0, None, 1.0
        self.started = False
        self._resume_optim: dict | None = None
        self._resume_state: dict | None = None
        self._snap: dict[str, Any] | None = None
        self._progress: int | None = None
        self._pending: dict[str, Any] | None = None  # the last part's push, sent with the next claim
        self._pending_loss: tuple[int, float, float] | None = None  # its (step, loss sum, tokens): counted if applied
        self.n = {"parts": 0, "pulls": 0, "waits": 0, "bound_waits": 0, "wait_s": 0.0, "dropped": 0, "stale_sum": 0.0,
                  "stale_max": 0.0}
        self.bytes_pulled = 0

    @property
    def rank(self) -> int:
        return self.member

    @property
    def world(self) -> int:
        return self.nominal_world

    # -- set-up ---------------------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def make_optimizer(self, groups: list[dict[str, Any]], optimizer_class: type[torch.optim.Optimizer],
                       **defaults: Any) -> torch.optim.Optimizer:
        name_of = {id(p): n for n, p in self.named}
        self.groups = [{"names": [name_of[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]}
                       for g in groups]
        self.optimizer_kind = optimizer_class.__name__
        if self.optimizer_kind not in OPTIMIZERS:
            raise ValueError(f"a parameter server runs AdamW or SGD, not {self.optimizer_kind}")
        self.defaults = {k: v for k, v in defaults.items() if isinstance(v, (int, float)) and v is not None}
        return ServerOptimizer(groups, self, {"lr": defaults.get("lr", 1e-3)})

    def _start(self, done: int, steps: int) -> None:
        """Rank 0 sets the server up with its weights (resumed or fresh); the others wait for it."""
        if self.is_main:
            self.server.setup({
                "names": [n for n, _ in self.named], "shapes": [tuple(p.shape) for _, p in self.named],
                "weights": {n: p.detach().float().cpu().numpy() for n, p in self.named},
                "groups": self.groups, "optimizer": self.optimizer_kind, "defaults": self.defaults,
                "optim_state": to_numpy(self._resume_optim) if self._resume_optim else None,
                "state": to_numpy(self._resume_state) if self._resume_state else None,
                "start": done, "steps": steps})
        else:
            deadline = time.monotonic() + SETUP_WAIT_S
            while not self.server.is_ready():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"member {self.member}: rank 0 did not start the parameter server "
                                       f"within {SETUP_WAIT_S:.0f} s")
                time.sleep(0.1)
        self.started = True

    # -- the step ---------------------------------------------------------------------------------------

    def next_step(self, done: int, steps: int) -> int | None:
        if not self.started:
            self._start(done, steps)
        t0, blocked, at_bound = time.monotonic(), False, False
        while True:
            push, self._pending = self._pending, None  # sent once, with the first call
            loss, self._pending_loss = self._pending_loss, None
            reply = self.server.exchange(self.member, self.wait_s, push, self.version,
                                         self.since_pull >= self.pull_every)
            if reply.get("pushed") is not None:
                self._pushed(reply["pushed"], loss)
            self._feedback(reply)
            if "stop" in reply:
                raise StopRequested(reply["stop"])
            blocked, at_bound = blocked or bool(reply.get("blocked")), at_bound or bool(reply.get("at_bound"))
            if "wait" not in reply:
                break
            if time.monotonic() - t0 > STALL_S:
                raise RuntimeError(f"member {self.member}: no step to take for {STALL_S:.0f} s ({reply['wait']})")
        waited_s = time.monotonic() - t0
        self.comm_wait_s += waited_s
        self.n["waits"] += int(blocked)  # the server's decision, counted once per claim
        self.n["bound_waits"] += int(at_bound)
        self.n["wait_s"] += waited_s if blocked else 0.0
        self._progress = reply["progress"]
        if reply.get("done"):
            return None
        self.claimed = reply
        if "pull" in reply:
            self._load(reply["pull"])
        return int(reply["step"])

    def _feedback(self, reply: dict[str, Any]) -> None:
        """What a claim's reply says of the error feedback: where the server resumes (older marks go), the
        residual to resume with, a checkpoint asking for this worker's table (answered at once; a pausing
        worker's table goes unasked: it pushes no more). See `ps_feedback.py`."""
        if "resume" in reply:
            self.marks.prune(int(reply["resume"]))
        if "feedback" in reply:
            self.marks.load(reply["feedback"])
        final = reply.get("stop") == "pause" and self.n["parts"] > 0
        if self.marks.active and (reply.get("feedback_for") is not None or final):
            step = None if final else reply.get("feedback_step")  # asked: only the residual at that step
            self.server.put_feedback(self.member, reply.get("feedback_for"), self.marks.table(step), final)

    def rows_for(self, step: int, total: int) -> tuple[int, int]:
        part, parts = self.claimed["part"], self.claimed["parts"]
        shares = balance.split_rows([1.0] * parts, total)
        return sum(shares[:part]), shares[part]

    def observe(self, rows: int, started: float, ended: float, targets: float = 0.0) -> None:
        self.targets = targets

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float | None) -> float:
        """This part's norm, for the log; the server clips the step's summed gradient (or this part's, async)."""
        self.max_norm = max_norm
        return Strategy.clip_grad_norm(self, params, None)

    def step_targets(self, step: int, mine: float, device: torch.device,
                     counted: Callable[[int], float] | None = None) -> float:
        """The whole step's loss tokens, counted from the data (every worker has it: `counted`): a part's
        gradient is then normalised exactly as DDP's rank's is, and the server's sum of the parts is the step's."""
        self.step_total = float(counted(step)) if counted else mine
        return self.step_total

    def step_reduce(self, values: list[float], device: torch.device) -> list[float]:
        return list(values)  # this part's own; the server adds the parts

    def step_loss(self, loss_sum: float, targets: float, step_targets: float, device: torch.device) -> float:
        """The loss this worker logs: its part's mean over the part's own tokens (over the whole step's tokens
        it would be a fraction of the step's loss); the job's final_loss merges the parts (`own_loss`)."""
        return loss_sum / max(1.0, targets)

    @property
    def step_ranks(self) -> int:
        return 1

    @torch.no_grad()
    def push(self, lr: float) -> None:
        """This part's gradient, encoded; it travels with the next claim (`exchange`: one round trip)."""
        grads = [p.grad.detach().float().reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                 for _, p in self.named]
        c = self.claimed
        self.marks.before_push(c["step"])
        payload = self.codec.encode(torch.cat(grads).cpu())
        self.bytes_sent += payload_bytes(payload)
        share = self.targets / max(self.step_total, 1.0)  # of the step's loss tokens
        self._pending = {"step": c["step"], "part": c["part"], "version_used": self.version, "payload": payload,
                         "weight": share, "lr": lr, "max_norm": self.max_norm}
        self.n["parts"] += 1
        self.since_pull += 1

    def own_loss(self, step: int, loss_sum: float, targets: float) -> None:
        """This part's loss waits with its push: it counts in `last_loss` only once the server applied the part."""
        self._pending_loss = (step, loss_sum, targets)

    def _pushed(self, reply: dict[str, Any], loss: tuple[int, float, float] | None = None) -> None:
        if not reply.get("accepted", True):
            self.n["dropped"] += 1
        elif loss is not None:  # the job's final_loss merges the parts of the last step the server applied
            Strategy.own_loss(self, *loss)
        gap = float(reply.get("staleness", 0.0))
        self.n["stale_sum"] += gap
        self.n["stale_max"] = max(self.n["stale_max"], gap)

    def _pull(self, which: str) -> None:
        t0 = time.monotonic()
        got = self.server.pull(self.member, which)
        self.comm_wait_s += time.monotonic() - t0
        self._load(got)

    def _load(self, got: dict[str, Any]) -> None:
        """A pull's reply (`ps_pull.PullStream.reply`: fp32 weights, or deltas to add) into the parameters."""
        values = self.pulled.apply(got)
        self.bytes_pulled += pulled_bytes(got)
        offset = 0
        with torch.no_grad():
            for _, p in self.named:
                k = p.numel()
                p.copy_(values[offset:offset + k].view_as(p).to(p.device, p.dtype))
                offset += k
        self.version = int(got["version"])
        self.since_pull = 0
        self.n["pulls"] += 1

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every step is applied: this worker ends with the server's weights (the Polyak average if asked)."""
        self._pull("polyak" if self.final == "polyak" else "raw")

    def progress(self, step: int) -> int:
        return self._progress if self._progress is not None else step

    # -- agreeing without a group -------------------------------------------------------------------

    def agree(self, code: int, device: torch.device) -> int:
        """Rank 0's pause or cancel goes to the server; the others hear it at their next claim."""
        if code:
            self.server.stop({1: "pause", 2: "cancel"}[code])
        return code

    def reduce(self, values: list[float], device: torch.device) -> list[float]:
        return list(values)  # rank 0 evaluates on everything (`shard`); the others on nothing

    def shard(self, items: list) -> list:
        return list(items) if self.is_main else []

    def at_boundary(self, step: int) -> bool:
        return True  # the server's state is consistent at any moment (a snapshot is atomic)

    # -- checkpoints: the server's snapshot ---------------------------------------------------------

    def checkpoint_step(self, step: int) -> int:
        if not self.is_main or not self.started:
            return step
        self._snap = self.server.snapshot(self.member, self.marks.table() if self.marks.active else None)
        return int(self._snap["resume_step"])

    def optimizer_state(self, optimizer: torch.optim.Optimizer, spool_dir: Path | None = None) -> dict[str, Any] | None:
        if not self.is_main:
            return None
        if self._snap is None:  # a pause before the server was set up: what was loaded, or nothing yet
            return self._resume_optim or optimizer.state_dict()
        return to_torch(self._snap["optim"])

    def model_state(self, model: torch.nn.Module, spool_dir: Path | None = None) -> dict[str, torch.Tensor] | None:
        if self._snap is None:
            return None
        return {n: torch.from_numpy(np.array(w)) for n, w in self._snap["weights"].items()}

    def state_dict(self) -> dict[str, Any]:
        snap, self._snap = self._snap, None
        if snap is None:
            return dict(self._resume_state or {})
        return to_torch(snap["state"])

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self._resume_optim = state  # the server's optimizer starts from it (rank 0 hands it over)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_state = dict(state)

    # -- what it reports ----------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        n = self.n
        return {"parts_done": n["parts"], "pulls": n["pulls"], "claim_waits": n["waits"],
                "bound_waits": n["bound_waits"], "claim_wait_s": n["wait_s"], "dropped": n["dropped"],
                "staleness_mean": n["stale_sum"] / max(1, n["parts"]), "staleness_max": n["stale_max"],
                "bytes_pulled": self.bytes_pulled}
