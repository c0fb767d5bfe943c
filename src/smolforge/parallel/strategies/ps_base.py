"""Parameter servers: what `ssp`, `sync-ps` and `async-ps` share (the server's core and the worker side).

A parameter server holds the trainable weights, the optimizer (AdamW, as one process would have it)
and its own counters; workers compute gradients and push them, and pull weights. There is no
process group between the workers: every exchange goes through the server, so a worker that is slow,
stopped or dead never blocks a collective. The three strategies differ only in the server's policy:

- what a worker may compute next (`claim`): the server hands out *parts* of the global steps (the
  rows of step s split into P parts, as the ranks of a synchronous group would split them). A fast
  worker takes more parts than a slow one; `ssp` refuses a part more than K steps ahead of the last
  complete step (the worker waits, with the reason shown), `sync-ps` gives each worker in its barrier
  one part of the open step, `async-ps` the next part with no bound;
- what a push does: `ssp` sums a step's parts and applies the step when all arrived, `sync-ps` when
  all arrived or its deadline passed (late parts are dropped and counted), `async-ps` at once.

Why parts of the same global steps: the data order stays the function of (seed, step) that every
other strategy uses, the loss is normalised over the tokens that arrived for a step (each push
carries its gradient's token count), and with K = 0 `ssp` is exactly DDP's step: the same rows,
gradients computed on the same weights, summed and clipped once, one AdamW step at lr(step).

`ServerCore` is plain Python and thread-safe (every wait bounded); the worker glue hosts it in a Ray
actor (`smolforge.cluster.workloads.data_parallel.param_server`) and the tests in a thread. Tensors travel as numpy arrays
(zero-copy buffers in Ray's object store), never pickled over a socket of ours. `PSStrategy` is the
worker side: the loop's optimizer step becomes a push (`ServerOptimizer`), its next step a claim.

Checkpoints: rank 0 takes an atomic snapshot of the server (weights, optimizer state, versions,
Polyak average) and writes it as an ordinary checkpoint at the step it resumes from
(`checkpoint_step`); its optimizer state is AdamW's own, so it resumes under any other strategy and
a job whose server's node died resumes on another node from it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Any, ClassVar

import numpy as np
import torch

from smolforge.parallel.codecs import ErrorFeedback, decode, payload_bytes
from smolforge.train import balance
from smolforge.train.loop import StopRequested
from smolforge.train.strategy import Strategy

OPTIMIZERS = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}
SETUP_WAIT_S = 600.0  # a worker waiting for rank 0 to start the server (rank 0 may still be loading)
STALL_S = 900.0  # a worker that gets no step to take for this long gives up, saying why


def to_numpy(value: Any) -> Any:
    """An optimizer/strategy state with every tensor as a numpy array (what travels to and from the server)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: to_numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_numpy(v) for v in value)
    return value


def to_torch(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value))  # a writable copy: Ray's buffers are read-only
    if isinstance(value, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): to_torch(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_torch(v) for v in value)
    return value


class ServerCore:
    """The server's state and the logic all three policies share. Subclasses decide `_claim` and `_push`.

    Versions: `ssp` and `sync-ps` count global steps applied (version s: the weights after steps < s);
    `async-ps` counts parts applied. Every method holds `self.cond`'s lock; waits are bounded by the
    caller's `wait_s` and return a reason."""

    straggler_after = 3  # sync-ps: deadlines missed in a row before a worker leaves the barrier

    def __init__(self, config: dict[str, Any], world: int):
        self.config = dict(config)
        self.world = world  # parts per step: the ranks the job started with
        self.cond = threading.Condition()
        self.ready = False
        self.stopped: str | None = None
        self.version = 0
        self.ema: torch.Tensor | None = None
        self.decay = float(config.get("polyak_decay") or 0.0)
        self.gone: set[int] = set()  # members known dead
        self.dropped: dict[int, int] = {}
        self.staleness: dict[int, list[float]] = {}  # member -> [sum, count, max]
        self.notes: list[dict] = []  # decisions for the job's events (a straggler left the barrier)
        self.waiting: dict[int, str] = {}  # member -> why the policy makes its claim wait now (shown in stats)
        self.applied = 0

    # -- setup (rank 0, once per round) ---------------------------------------------------------------

    def setup(self, spec: dict[str, Any]) -> bool:
        """Weights, optimizer (and its state when resuming), the steps; the first call wins."""
        with self.cond:
            if self.ready:
                return False
            self.names, self.shapes = list(spec["names"]), [tuple(s) for s in spec["shapes"]]
            sizes = [int(np.prod(s)) for s in self.shapes]
            self.offsets = np.cumsum([0] + sizes).tolist()
            self.flat = torch.cat([torch.from_numpy(np.array(spec["weights"][n], dtype=np.float32)).reshape(-1)
                                   for n in self.names])
            self.params = {n: torch.nn.Parameter(self.flat[o:o + k].view(shape))
                           for n, o, k, shape in zip(self.names, self.offsets, sizes, self.shapes)}
            groups = [{"params": [self.params[n] for n in g["names"]], "weight_decay": g["weight_decay"]}
                      for g in spec["groups"]]
            defaults = {k: v for k, v in spec["defaults"].items() if k in ("lr", "betas", "eps", "momentum")}
            self.optimizer = OPTIMIZERS[spec["optimizer"]](groups, **defaults)
            if spec.get("optim_state"):
                self.optimizer.load_state_dict(to_torch(spec["optim_state"]))
            state = to_torch(spec.get("state") or {})
            if self.decay:
                ema = state.get("ema")
                self.ema = (torch.cat([ema[n].float().reshape(-1) for n in self.names]) if isinstance(ema, dict)
                            else self.flat.clone())
            self.start, self.steps = int(spec["start"]), int(spec["steps"])
            self._begin(self.start)
            self.ready = True
            self.cond.notify_all()
            return True

    def is_ready(self) -> bool:
        with self.cond:
            return self.ready

    def _begin(self, start: int) -> None:
        """The policy's counters for a run starting at global step `start`."""
        self.version = start

    # -- the update -------------------------------------------------------------------------------------

    def _apply(self, grad: torch.Tensor, lr: float, max_norm: float | None) -> None:
        """One optimizer step with `grad` (flat, the token-mean gradient): clipped, at `lr`; the Polyak
        average follows."""
        for n, o, p in zip(self.names, self.offsets, self.params.values()):
            p.grad = grad[o:o + p.numel()].view_as(p)
        if max_norm:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), max_norm)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.mul_(self.decay).add_(self.flat, alpha=1.0 - self.decay)
        self.applied += 1

    def _record_staleness(self, member: int, gap: float) -> None:
        st = self.staleness.setdefault(member, [0.0, 0, 0.0])
        st[0] += gap
        st[1] += 1
        st[2] = max(st[2], gap)

    # -- what workers call ----------------------------------------------------------------------------

    def exchange(self, member: int, wait_s: float = 1.0, push: dict[str, Any] | None = None, have: int = -1,
                 pull_due: bool = False) -> dict[str, Any]:
        """One round trip per part: the last part's push (if any), then the next claim, with the current
        weights when the worker's (version `have`) are too old or it is due to pull (`pull_due`)."""
        with self.cond:
            pushed = self.push(member, **push) if push is not None else None
            got = self.claim(member, wait_s, have, pull_due)
            return {**got, "pushed": pushed}

    def claim(self, member: int, wait_s: float = 1.0, have: int | None = None, pull_due: bool = False) -> dict[str, Any]:
        """The next part this member computes: {"step", "part", "parts", "version", "need"}; or {"wait": why}
        after up to `wait_s`; {"stop": "pause"|"cancel"}; {"done": True} once every step is applied. With
        `have` (the version the worker holds): "values" carries the weights when it must or may pull.

        Every reply says what the policy decided, not how long it took: `blocked` (this claim was made to
        wait: a bound, a barrier, the last parts out) and `at_bound` (ssp: it waited at the staleness
        bound); the worker counts them (`claim_waits`, `bound_waits`), whatever the machine's speed."""
        deadline = time.monotonic() + wait_s
        blocked = at_bound = False
        with self.cond:
            while True:
                got = self._decide(member)
                if "wait" not in got:
                    self.waiting.pop(member, None)
                    out = {**got, "blocked": blocked, "at_bound": at_bound}
                    if "stop" in got:
                        return out
                    out["progress"] = self.progress()
                    if have is not None and "step" in got and (
                            have < got["need"] or (got["version"] > have and pull_due)):
                        out["values"] = self.flat.numpy().copy()  # the weights of `version`, atomically
                    return out
                blocked, at_bound = True, at_bound or bool(got.get("bound"))
                if member not in self.waiting:
                    self.cond.notify_all()  # whoever watches the server (a test's gate) sees it start waiting
                self.waiting[member] = got["wait"]
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"wait": got["wait"], "version": self.version, "blocked": True, "at_bound": at_bound}
                self.cond.wait(self._wake_in(left))

    def _decide(self, member: int) -> dict[str, Any]:
        """What `claim` answers now: the policy's decision, or why it cannot decide yet."""
        if not self.ready:
            return {"wait": "waiting for rank 0 to start the parameter server"}
        if self.stopped:
            return {"stop": self.stopped}
        if member in self.gone:
            return {"stop": "cancel", "why": "this member was taken out of the job"}
        return self._claim(member)

    def push(self, member: int, step: int, part: int, version_used: int, payload: dict, weight: float,
             lr: float, max_norm: float | None) -> dict[str, Any]:
        """A part's gradient (encoded, `parallel.codecs`; its loss normalised over the whole step's tokens, as
        a DDP rank's is), its share of the step's tokens (`weight`), the lr of its step."""
        with self.cond:
            if not self.ready:
                raise RuntimeError("push before the parameter server was set up")
            grad = decode(payload, int(self.flat.numel()))
            out = self._push(member, step, part, version_used, grad, float(weight), float(lr), max_norm)
            if not out.get("accepted", True):
                self.dropped[member] = self.dropped.get(member, 0) + 1
            self.cond.notify_all()
            return {**out, "version": self.version}

    def pull(self, member: int, which: str = "raw") -> dict[str, Any]:
        """The current weights (flat fp32) and their version; `which="polyak"`: the Polyak average."""
        with self.cond:
            src = self.ema if which == "polyak" and self.ema is not None else self.flat
            return {"version": self.version, "values": src.numpy().copy()}

    def stop(self, code: str) -> None:
        """Rank 0 pauses or cancels the job: every worker's next claim says so."""
        with self.cond:
            self.stopped = self.stopped if self.stopped == "cancel" else code
            self.cond.notify_all()

    def member_left(self, member: int) -> None:
        """The runner saw this member's process die: its parts are handed to the others."""
        with self.cond:
            self.gone.add(member)
            self.waiting.pop(member, None)
            self._left(member)
            self.cond.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """An atomic copy of the state a checkpoint keeps; `resume_step`: where a resumed job starts."""
        with self.cond:
            split = lambda flat: {n: flat[o:o + int(np.prod(s))].reshape(s).numpy().copy()  # noqa: E731
                                  for n, o, s in zip(self.names, self.offsets, self.shapes)}
            out = {"resume_step": self.resume_step(), "weights": split(self.flat),
                   "optim": to_numpy(self.optimizer.state_dict()),
                   "state": {"version": self.version, "applied": self.applied}}
            if self.ema is not None:
                out["state"]["ema"] = split(self.ema)
            return out

    def stats(self) -> dict[str, Any]:
        with self.cond:
            notes, self.notes = self.notes, []
            return {"version": self.version, "progress": self.progress(), "dropped": dict(self.dropped),
                    "staleness": {m: {"mean": s[0] / max(1, s[1]), "max": s[2]} for m, s in self.staleness.items()},
                    "notes": notes, "waiting": dict(self.waiting), **self._stats()}

    # -- the policy (subclasses) ------------------------------------------------------------------------

    def _claim(self, member: int) -> dict[str, Any]:
        raise NotImplementedError

    def _push(self, member: int, step: int, part: int, version_used: int, grad: torch.Tensor, weight: float,
              lr: float, max_norm: float | None) -> dict[str, Any]:
        raise NotImplementedError

    def _left(self, member: int) -> None:
        """A member died (its claimed parts go back to the others)."""

    def _wake_in(self, left: float) -> float:
        """How long a waiting claim may sleep before it looks again (sync-ps: its deadline)."""
        return left

    def _stats(self) -> dict[str, Any]:
        return {}

    def resume_step(self) -> int:
        """The global step every step before which is applied."""
        return self.version

    def progress(self) -> int:
        """Global steps done."""
        return self.version

    @property
    def done(self) -> bool:
        return self.version >= self.steps


class PartQueue:
    """The parts of the global steps in order (slot = step * P + part), handed out once each; a dead
    member's unfinished parts are handed out again first. Used by `ssp` and `async-ps`."""

    def __init__(self, start: int, steps: int, parts: int):
        self.parts, self.next, self.end = parts, start * parts, steps * parts
        self.again: list[int] = []
        self.out: dict[int, int] = {}  # slot -> member computing it

    def peek(self) -> int | None:
        return min(self.again) if self.again else (self.next if self.next < self.end else None)

    def take(self, member: int) -> int:
        slot = self.peek()
        assert slot is not None
        if self.again and slot == min(self.again):
            self.again.remove(slot)
        else:
            self.next += 1
        self.out[slot] = member
        return slot

    def finish(self, member: int, slot: int) -> bool:
        """A push for `slot`: True when this member was the one computing it (else it is dropped)."""
        if self.out.get(slot) != member:
            return False
        del self.out[slot]
        return True

    def release(self, member: int) -> None:
        for slot in [s for s, m in self.out.items() if m == member]:
            del self.out[slot]
            self.again.append(slot)

    def lowest_open(self) -> int:
        """The lowest slot not yet pushed."""
        return min([*self.out, *self.again, self.next])


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

    def __init__(self, **config: Any):
        settings = self.Settings(**config) if self.Settings else None
        super().__init__()
        self.config = settings.model_dump() if settings else {}
        self.server: Any = None
        self.member, self.nominal_world = 0, 1
        self.codec = ErrorFeedback(self.config.get("codec", "fp32"), int(self.config.get("block", 256)))
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
        if "values" in reply:
            self._load(reply["values"], reply["version"])
        return int(reply["step"])

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

    def step_targets(self, step: int, mine: float, device: torch.device) -> float:
        """The whole step's loss tokens, counted from the data (every worker has it): a part's gradient is
        then normalised exactly as DDP's rank's is, and the server's sum of the parts is the step's."""
        self.step_total = float(self.step_tokens(step)) if self.step_tokens else mine
        return self.step_total

    def step_reduce(self, values: list[float], device: torch.device) -> list[float]:
        return list(values)  # this part's own (the loss it logs); the server adds the parts

    @property
    def step_ranks(self) -> int:
        return 1

    @torch.no_grad()
    def push(self, lr: float) -> None:
        """This part's gradient, encoded; it travels with the next claim (`exchange`: one round trip)."""
        grads = [p.grad.detach().float().reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                 for _, p in self.named]
        payload = self.codec.encode(torch.cat(grads).cpu())
        self.bytes_sent += payload_bytes(payload)
        c = self.claimed
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
        self._load(got["values"], got["version"])

    def _load(self, values: np.ndarray, version: int) -> None:
        values = torch.from_numpy(np.asarray(values))
        self.bytes_pulled += int(values.numel()) * 4
        offset = 0
        with torch.no_grad():
            for _, p in self.named:
                k = p.numel()
                p.copy_(values[offset:offset + k].view_as(p).to(p.device, p.dtype))
                offset += k
        self.version = int(version)
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
        self._snap = self.server.snapshot()
        return int(self._snap["resume_step"])

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        if not self.is_main:
            return None
        if self._snap is None:  # a pause before the server was set up: what was loaded, or nothing yet
            return self._resume_optim or optimizer.state_dict()
        return to_torch(self._snap["optim"])

    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
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


def median_mad(values: list[float] | deque) -> tuple[float, float]:
    med = statistics.median(values)
    return med, statistics.median(abs(v - med) for v in values)
