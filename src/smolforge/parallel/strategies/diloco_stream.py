"""Streaming syncs for DiLoCo (Streaming DiLoCo, Douillard et al., arXiv 2501.18512): the model is synced
one fragment at a time, each fragment's transfer overlapped with the next inner steps.

What is taken from the paper (its section 2, "Streaming partial updates" and "Overlapping communication"):
- The trainable parameters are split into `fragments` groups. Here contiguous groups in layer order
  (`split`, balanced by values; the paper strides layers across fragments, which it reports as slightly
  better: a possible follow-up), each with its own shared (outer) weights and outer momentum.
- Fragment f is synced every H inner steps on a staggered schedule: after step t when
  (t - offset_f) % H == 0, offset_f = f * H // fragments, so at most one fragment is on the wire at a time
  and the peak bandwidth is 1/fragments of a whole-model sync.
- Its pseudo-gradient (shared - local, token-weighted as in `DiLoCo._average`) is sent at t and its outer
  step applied τ = `overlap` inner steps later, at t + τ; the ranks keep training meanwhile. The merge
  mixes as the paper's Algorithm 2 does: local <- α local + (1 - α) global, with α = `mix` (the paper's
  0.5 by default) when τ > 0; with τ = 0 the local weights are replaced (today's DiLoCo).
- Or, with diloco's `merge: delta` (not the paper's): local <- global + (local - local at the send), the
  new global weights with the τ steps' own progress on top, as if the sync had been instant and the same τ
  updates followed it (so with τ = 0 it is the replacement). The mix halves both the outer step and the
  τ steps' progress: on llama-100m at 1 Gbit/s, H 10, four fragments, τ 1, it reached one node's loss at
  step 52 against the blocking sync's 42 (stop 61, BENCHMARKS.md scale-out). It keeps a copy of the
  fragment's local weights from the send to the merge (one fragment is in flight at a time).
- The next round's pseudo-gradient is taken against the new global weights (the paper's θ^(t)).

`background`: the transfer runs in a thread on its own process group (`sync_group`), so the inner steps'
own collectives (stop codes, evals) never interleave with it; without it the same average is computed at
send time, blocking, and held until t + τ: the same numbers, only the waiting differs (a test checks it).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from smolforge.parallel.codecs import spans


def split(sizes: list[int], fragments: int) -> list[tuple[int, int]]:
    """`fragments` contiguous ranges [first, last) of parameter indices, in layer order, each at least
    one parameter, cut where the running count of values crosses k/fragments of the whole.

    Raises ValueError when there are fewer parameters than fragments."""
    if fragments > len(sizes):
        raise ValueError(f"{fragments} fragments need at least as many trainable tensors (the model has "
                         f"{len(sizes)})")
    total, cuts = sum(sizes), [0]
    running = list(itertools.accumulate(sizes))
    for k in range(1, fragments):
        cut = next(i for i, c in enumerate(running) if c * fragments >= k * total) + 1
        cuts.append(min(max(cut, cuts[-1] + 1), len(sizes) - (fragments - k)))
    cuts.append(len(sizes))
    return list(zip(cuts[:-1], cuts[1:]))


def offsets(inner_steps: int, fragments: int) -> list[int]:
    """Each fragment's place in the H-step cycle (offset_f = f * H // fragments)."""
    return [f * inner_steps // fragments for f in range(fragments)]


class Flight:
    """One fragment's average on its way: `fn` run in a daemon thread (`background`) or not at all until
    `wait` (the caller has then run it blocking itself and passes `done`).

    `wait()` returns fn's result; an error the thread met is raised once (so the caller's regroup-and-retry
    can run), and a retry then runs fn again in the caller's thread."""

    def __init__(self, fn: Callable[[], Any], background: bool, done: Any = None):
        self.fn, self.result, self.error = fn, done, None
        self.thread: threading.Thread | None = None
        if background:
            self.thread = threading.Thread(target=self._run, name="diloco-fragment-sync", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as err:  # handed to the training thread at the merge
            self.error = err

    def wait(self) -> Any:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            if self.error is not None:
                err, self.error = self.error, None
                raise err
            return self.result
        if self.result is None:  # a retry after a regroup: run again, here
            self.result = self.fn()
        return self.result

    def drain(self) -> None:
        """Wait for the thread to end (a regroup is about to tear its group down); its outcome is kept."""
        if self.thread is not None:
            self.thread.join()


@dataclass
class Averaged:
    """The ranks' average of one fragment's pseudo-gradient, read a piece at a time (`piece(a, b)`, `a` a
    multiple of `unit`) by the outer step: all-reduced `values` (fp32), or every rank's message (`parts`,
    as sent) and share (`weights`), summed by the codec piece by piece (`Codec.aggregate_piece`: the bits
    of `Codec.aggregate` without a whole-model tensor)."""

    coder: Any
    values: torch.Tensor | None = None
    parts: list[dict[str, Any]] | None = None
    weights: list[float] | None = None

    @property
    def unit(self) -> int:
        return 1 if self.values is not None else self.coder.unit

    def piece(self, a: int, b: int) -> torch.Tensor:
        if self.values is not None:
            return self.values[a:b]
        return self.coder.aggregate_piece(self.parts, self.weights, a, b)


@dataclass
class Fragment:
    """A slice of the trainable parameters synced together: params[first:last], values [start:end) of
    the flat vector; `shared`: its outer (global) weights, fp32; `feedback`: its codec stream's error
    feedback (`parallel.codecs.ErrorFeedback`, set by the strategy)."""

    first: int
    last: int
    start: int
    end: int
    shared: torch.nn.Parameter
    feedback: Any = None
    flight: Flight | None = None
    merge_at: int = 0  # the step after which its flight is merged
    meta: dict[str, Any] = field(default_factory=dict)


def make_fragments(params: list[torch.nn.Parameter], fragments: int) -> list[Fragment]:
    """The fragments over `params` (layer order), each holding its shared weights (a copy, fp32)."""
    out, start = [], 0
    for first, last in split([p.numel() for p in params], fragments):
        n = sum(p.numel() for p in params[first:last])
        with torch.no_grad():
            flat = torch.cat([p.detach().float().reshape(-1) for p in params[first:last]])
        out.append(Fragment(first, last, start, start + n, torch.nn.Parameter(flat, requires_grad=False)))
        start += n
    return out


@torch.no_grad()
def merge_into(params: list[torch.nn.Parameter], frag: Fragment, mix: float,
               sent: list[torch.Tensor] | None = None) -> None:
    """The fragment's shared weights into its local parameters: replaced (`mix` 0), mixed,
    local <- mix * local + (1 - mix) * shared (Streaming DiLoCo's merge), or with `sent` (the fragment's
    local parameters at its send, `snapshot`) local <- shared + (local - sent) (`merge: delta`)."""
    offset = 0
    for i, p in enumerate(params[frag.first:frag.last]):
        n = p.numel()
        new = frag.shared[offset:offset + n].view_as(p).to(p.dtype)
        if sent is not None:
            p.sub_(sent[i]).add_(new)
        elif mix:
            p.mul_(mix).add_(new, alpha=1 - mix)
        else:
            p.copy_(new)
        offset += n


def snapshot(params: list[torch.nn.Parameter], frag: Fragment) -> list[torch.Tensor]:
    """The fragment's local parameters now (copies), for a `merge: delta` at its merge."""
    return [p.detach().clone() for p in params[frag.first:frag.last]]


@torch.no_grad()
def pseudo_gradient(params: list[torch.nn.Parameter], frag: Fragment) -> torch.Tensor:
    """shared - local over the fragment's values: flat fp32, unweighted, written parameter by parameter
    into one new buffer (no flat copy of the local weights, no whole-model temporaries)."""
    out, offset = torch.empty(frag.end - frag.start), 0
    for p in params[frag.first:frag.last]:
        n = p.numel()
        torch.sub(frag.shared[offset:offset + n], p.detach().reshape(-1), out=out[offset:offset + n])
        offset += n
    return out


@torch.no_grad()
def fill_pseudo_gradient(params: list[torch.nn.Parameter], frag: Fragment) -> Callable[[int, int, torch.Tensor], None]:
    """`fill(a, b, out)`: values [a, b) of `pseudo_gradient(params, frag)` written into `out`, the same
    subtraction, read straight from the parameters (for `ErrorFeedback.encode_pieces`: no whole-model
    buffer). The parameters must not change until the last fill."""
    views = [p.detach().reshape(-1) for p in params[frag.first:frag.last]]
    starts = [0, *itertools.accumulate(v.numel() for v in views)]

    def fill(a: int, b: int, out: torch.Tensor) -> None:
        i, at = bisect.bisect_right(starts, a) - 1, a
        while at < b:
            end = min(b, starts[i + 1])
            if end > at:
                torch.sub(frag.shared[at:end], views[i][at - starts[i]:end - starts[i]], out=out[at - a:end - a])
            at, i = end, i + 1

    return fill


@torch.no_grad()
def outer_step(outer: torch.optim.SGD, shared: torch.nn.Parameter,
               grad: torch.Tensor | Callable[[int, int], torch.Tensor], unit: int = 1) -> None:
    """`outer.step()` for one fragment's shared weights with gradient `grad` (flat fp32, or `grad(a, b)`
    giving its values [a, b) for pieces of whole `unit`s: a codec's `aggregate_piece`, so the average is
    never a whole-model tensor), piece by piece (`codecs.spans`): torch's single-tensor SGD arithmetic
    (momentum, dampening, Nesterov; the buffer kept in `outer.state` as torch keeps it), op for op, so the
    same bits without its whole-model temporaries (a test compares them). Raises ValueError for weight
    decay or `maximize`, which DiLoCo never sets."""
    group = outer.param_groups[0]
    if group["weight_decay"] or group["maximize"]:
        raise ValueError("outer_step: weight decay and maximize are not DiLoCo's outer step")
    lr, momentum, dampening, nesterov = group["lr"], group["momentum"], group["dampening"], group["nesterov"]
    buf, first = None, False
    if momentum:
        buf = outer.state[shared].get("momentum_buffer")
        first = buf is None
        if first:
            buf = outer.state[shared]["momentum_buffer"] = torch.empty_like(shared)
    for a, b in spans(shared.numel(), unit):
        g = grad(a, b) if callable(grad) else grad[a:b]
        if buf is not None:
            if first:
                buf[a:b].copy_(g)
            else:
                buf[a:b].mul_(momentum).add_(g, alpha=1 - dampening)
            g = g.add(buf[a:b], alpha=momentum) if nesterov else buf[a:b]
        shared[a:b].add_(g, alpha=-lr)
