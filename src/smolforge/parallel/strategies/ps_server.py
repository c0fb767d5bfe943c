"""A parameter server's core: what the servers of `ssp`, `sync-ps` and `async-ps` share.

A parameter server holds the trainable weights, the optimizer (AdamW, as one process would have it)
and its own counters; workers (`ps_worker.PSStrategy`) compute gradients and push them, and pull
weights. There is no process group between the workers: every exchange goes through the server, so a
worker that is slow, stopped or dead never blocks a collective. The three strategies differ only in
the server's policy (a `ServerCore` subclass in each strategy's file):

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
actor (`smolforge.cluster.workloads.data_parallel.param_server`) and the tests in a thread. Tensors
travel as numpy arrays (zero-copy buffers in Ray's object store), never pickled over a socket of ours
(`to_numpy` / `to_torch`). Its `snapshot` is what a checkpoint keeps (weights, optimizer state,
versions, Polyak average) and, with a lossy codec, every worker's error-feedback residual at the step
the checkpoint resumes from (`ps_feedback.py`: how they are gathered and handed back on resume).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from smolforge.parallel.codecs import make_codec
from smolforge.parallel.strategies.ps_feedback import WAIT_S, FeedbackKeeper
from smolforge.parallel.strategies.ps_pull import PullStream

OPTIMIZERS = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}


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
        # the codec pushes travel in (its settings from the strategy's config: sparse's chunk/topk/bits)
        self.coder = make_codec(str(config.get("codec", "fp32")), **config)
        self.feedback = FeedbackKeeper(self.coder, world)  # the workers' residuals, for checkpoints
        # how workers pull newer weights: what changed, through the codec (`ps_pull.py`), or the fp32 weights
        self.pulls = PullStream(self.coder if config.get("pull", "codec") == "codec" else make_codec("fp32"))

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
            why = self.feedback.restore(state)
            if why:
                self.notes.append({"kind": "error_feedback_reset", "message": why})
            self.start, self.steps = int(spec["start"]), int(spec["steps"])
            self._begin(self.start)
            why = self.pulls.reset(self.flat, self.version, state)
            if why:
                self.notes.append({"kind": "pull_shadow_reset", "message": why})
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
        """`_claim_reply`, with what the error feedback needs: `feedback_for` (a checkpoint asks this member
        for its residuals: `ps_feedback.py`), `feedback` (its residual to resume with, with its first part)."""
        with self.cond:
            out = self._claim_reply(member, wait_s, have, pull_due)
            if "done" in out and member not in self.feedback.finished:
                self.feedback.finished.add(member)
                self.cond.notify_all()  # a snapshot waiting for this member's residuals waits no more
            if "step" in out:
                found, residual = self.feedback.hand(member)
                if found:
                    out["feedback"] = to_numpy(residual)
            ask = self.feedback.wants(member)
            if ask is not None:
                out["feedback_for"], out["feedback_step"] = ask, self.feedback.step
            return out

    def _claim_reply(self, member: int, wait_s: float, have: int | None, pull_due: bool) -> dict[str, Any]:
        """The next part this member computes: {"step", "part", "parts", "version", "need"}; or {"wait": why}
        after up to `wait_s`; {"stop": "pause"|"cancel"}; {"done": True} once every step is applied. With
        `have` (the version the worker holds): "pull" carries the weights (`ps_pull.PullStream.reply`: the
        fp32 weights, or what changed since `have` through the codec) when it must or may pull.

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
                    out["progress"], out["resume"] = self.progress(), self.resume_step()
                    if have is not None and "step" in got and (
                            have < got["need"] or (got["version"] > have and pull_due)):
                        out["pull"] = self.pulls.reply(self.flat, self.version, have)  # of `version`, atomically
                    return out
                blocked, at_bound = True, at_bound or bool(got.get("bound"))
                if member not in self.waiting:
                    self.cond.notify_all()  # whoever watches the server (a test's gate) sees it start waiting
                self.waiting[member] = got["wait"]
                left = deadline - time.monotonic()
                if left <= 0 or self.feedback.wants(member) is not None:  # a checkpoint waits for this member
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
            self.feedback.pushers.add(member)
            grad = self.coder.decode(payload, int(self.flat.numel()))
            out = self._push(member, step, part, version_used, grad, float(weight), float(lr), max_norm)
            if not out.get("accepted", True):
                self.dropped[member] = self.dropped.get(member, 0) + 1
            self.cond.notify_all()
            return {**out, "version": self.version}

    def pull(self, member: int, which: str = "raw") -> dict[str, Any]:
        """The current weights (flat fp32, whole: the job's final model is the server's exactly, whatever the
        codec) and their version; `which="polyak"`: the Polyak average. Counted in `pull_bytes`."""
        with self.cond:
            src = self.ema if which == "polyak" and self.ema is not None else self.flat
            self.pulls.n["pull_bytes"] += 4 * int(src.numel())
            self.pulls.n["pull_keyframes"] += 1
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

    def put_feedback(self, member: int, gen: int | None, table: dict[str, Any], final: bool = False) -> None:
        """A worker's error-feedback table (`ps_feedback.FeedbackMarks.table`), asked for by request `gen`
        (None: unasked, a pausing worker's), `final` when it pushes no more."""
        with self.cond:
            self.feedback.put(member, gen, table, final)
            self.cond.notify_all()

    def snapshot(self, member: int | None = None, feedback: dict[str, Any] | None = None,
                 wait_s: float = WAIT_S) -> dict[str, Any]:
        """An atomic copy of the state a checkpoint keeps; `resume_step`: where a resumed job starts. With a
        lossy codec also every worker's residual at it: `member` (rank 0, the caller) hands its own table
        (`feedback`) and the others are asked for theirs, waited for at most `wait_s` (`ps_feedback.py`)."""
        with self.cond:
            out = self._snapshot()
            if self.feedback.active and (self.feedback.pushers or feedback):
                gen = self.feedback.request(member, feedback, out["resume_step"])
                self.cond.notify_all()  # waiting claims return with the request
                self.cond.wait_for(lambda: not self.feedback.missing(gen, self.gone), timeout=wait_s)
                kept, lacking = self.feedback.collect(out["resume_step"], gen, self.gone)
                out["state"].update(to_numpy(kept))
                if lacking:
                    self.notes.append({"kind": "error_feedback_missing", "members": lacking, "message":
                                       f"the checkpoint at step {out['resume_step']} lacks the error-feedback "
                                       f"residuals of member(s) {lacking} (gone, done or slow to answer): "
                                       "they resume at zero"})
            return out

    def _snapshot(self) -> dict[str, Any]:
        """The weights, optimizer state and counters, copied (the caller holds the lock)."""
        split = lambda flat: {n: flat[o:o + int(np.prod(s))].reshape(s).numpy().copy()  # noqa: E731
                              for n, o, s in zip(self.names, self.offsets, self.shapes)}
        out = {"resume_step": self.resume_step(), "weights": split(self.flat),
               "optim": to_numpy(self.optimizer.state_dict()),
               "state": {"version": self.version, "applied": self.applied, **self.pulls.state()}}
        if self.ema is not None:
            out["state"]["ema"] = split(self.ema)
        return out

    def stats(self) -> dict[str, Any]:
        with self.cond:
            notes, self.notes = self.notes, []
            return {"version": self.version, "progress": self.progress(), "dropped": dict(self.dropped),
                    "staleness": {m: {"mean": s[0] / max(1, s[1]), "max": s[2]} for m, s in self.staleness.items()},
                    "notes": notes, "waiting": dict(self.waiting), **self.pulls.n, **self._stats()}

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


def median_mad(values: list[float] | deque) -> tuple[float, float]:
    med = statistics.median(values)
    return med, statistics.median(abs(v - med) for v in values)
