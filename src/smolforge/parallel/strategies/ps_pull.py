"""How a parameter server's workers get newer weights: a pull through the job's codec (issue 45).

With a lossy codec (`Codec.lossy`: int8, int4, fp16, sparse) and `pull: codec` (the default) the server keeps
the weights the workers hold (`PullStream.shadow`: the sum of every delta sent so far) and, when a
worker must or may pull, sends only what changed: Δ = weights − shadow, encoded with the job's codec,
and the server adds decode(Δ) to the shadow exactly as a worker does. What Δ's message could not carry
(its rounding; sparse: the values not sent) stays in weights − shadow and goes with the next Δ: error
feedback kept on the server, one stream for every worker (EF-SGD, Karimireddy et al. 2019, arXiv
1901.09847, applied to the downlink as in DoubleSqueeze, Tang et al. 2019, arXiv 1905.05957).

Every Δ is kept in a chain, by the version it brings the shadow to; a worker holding version v gets the
deltas after v, in order, and adds them to its own fp32 copy (`PulledWeights`) with the server's own
operations: every worker that holds version v holds the same fp32 tensor, bitwise. A worker the chain
does not reach (a joiner, a resumed job's first claim) gets the shadow itself (a keyframe, fp32 bytes),
and so does one whose deltas would cost more than that; the chain keeps at most a model's fp32 bytes.
A codec that loses nothing (fp32), or `pull: full`, sends the server's weights themselves every pull.

The bound, against the server's weights w at the version a worker pulled: the worker holds w − r, r the
residual of that version's Δ: |r| ≤ Δ's block absmax / (2 qmax) per value for int8 and int4 (half a step: qmax 127 and 7), half an
fp16 step for fp16, and Δ's chunk absmax for sparse (values not sent are no larger than the smallest
sent one; a sent value errs by at most its chunk's scale / (2^bits − 1)). Δ is what changed since the
previous pull plus the previous residual: what one pull leaves out goes with a later one, and r is bounded
by the newest Δ, not summed over pulls. The job's final weights are pulled whole (`ServerCore.pull`): the
model a job ends with is the server's, exactly.

Costs: the server holds one more fp32 copy of the trainable weights (the shadow, also in checkpoints)
and the chain (at most that again). A worker that missed k versions gets k deltas: one per pull under
sync-ps and ssp (all pull the same versions), about the world size under async-ps (the others' parts
came in between; tests/test_ps_pull.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from smolforge.parallel.codecs import Codec, payload_bytes


def pulled_bytes(got: dict[str, Any]) -> int:
    """What a pull's reply carried, in bytes: the keyframe's fp32 values, or its deltas' payloads."""
    if "values" in got:
        return int(np.asarray(got["values"]).nbytes)
    return sum(payload_bytes(p) for p in got["deltas"])


class PullStream:
    """The server's side, under its lock: the shadow (flat fp32, what the workers hold), its version
    (None: behind the weights, e.g. restored from a checkpoint taken before its last delta), the chain
    of (base version, version, payload) and what pulls cost (`stats`). `coder`: the job's codec."""

    def __init__(self, coder: Codec):
        self.coder = coder
        self.shadow: torch.Tensor | None = None
        self.shadow_version: int | None = None
        self.chain: list[tuple[int | None, int, dict[str, np.ndarray]]] = []
        self.n = {"pull_bytes": 0, "pull_keyframes": 0, "pull_deltas": 0}

    @property
    def active(self) -> bool:
        return self.coder.lossy

    def reset(self, flat: torch.Tensor, version: int, state: dict[str, Any]) -> str | None:
        """A new server's stream: the shadow a checkpoint's `state` kept with the same codec and size, else
        the weights themselves (`flat`, at `version`). Returns why a kept shadow was not taken, if it was not."""
        self.chain = []
        if not self.active:
            return None
        saved, why = state.get("pull_shadow"), None
        if saved is not None and state.get("pull_codec") == self.coder.settings() and np.asarray(saved).size == flat.numel():
            saved = saved if isinstance(saved, torch.Tensor) else torch.from_numpy(np.array(saved, dtype=np.float32))
            self.shadow = saved.detach().float().reshape(-1).clone()
            kept = state.get("pull_version")
            self.shadow_version = int(version) if kept is not None and int(kept) == int(version) else None
            return None
        if saved is not None:
            why = (f"the checkpoint's pull shadow was kept with {state.get('pull_codec')}; this run pulls with "
                   f"{self.coder.settings()}: the workers start from the weights themselves")
        self.shadow, self.shadow_version = flat.clone(), int(version)
        return why

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the stream (nothing for a codec that loses nothing)."""
        if not self.active or self.shadow is None:
            return {}
        return {"pull_shadow": self.shadow.numpy().copy(), "pull_version": self.shadow_version,
                "pull_codec": self.coder.settings()}

    def _advance(self, flat: torch.Tensor, version: int) -> None:
        """Encode what changed since the shadow's version (with the last residual), add it to the shadow."""
        payload = self.coder.encode(flat - self.shadow)
        self.shadow.add_(self.coder.decode(payload, flat.numel()))
        self.chain.append((self.shadow_version, int(version), payload))
        self.shadow_version = int(version)
        keyframe, kept = 4 * flat.numel(), sum(payload_bytes(p) for _, _, p in self.chain)
        while len(self.chain) > 1 and kept > keyframe:  # older deltas cost more than a keyframe: never sent
            kept -= payload_bytes(self.chain.pop(0)[2])

    def reply(self, flat: torch.Tensor, version: int, have: int) -> dict[str, Any]:
        """What a worker holding version `have` pulls to reach `version` (the server's weights `flat`):
        {"version", "values": fp32 flat} (a keyframe) or {"version", "deltas": [payload, ...]} in order."""
        if not self.active:
            got: dict[str, Any] = {"version": int(version), "values": flat.numpy().copy()}
        else:
            if self.shadow_version != version:
                self._advance(flat, version)
            bases = [base for base, _, _ in self.chain]
            deltas = [p for _, _, p in self.chain[bases.index(have):]] if have >= 0 and have in bases else None
            if deltas is not None and sum(payload_bytes(p) for p in deltas) < 4 * flat.numel():
                got = {"version": int(version), "deltas": deltas}
            else:  # the chain does not reach back to `have`, or costs more than the weights
                got = {"version": int(version), "values": self.shadow.numpy().copy()}
        self.n["pull_keyframes" if "values" in got else "pull_deltas"] += 1
        self.n["pull_bytes"] += pulled_bytes(got)
        return got


class PulledWeights:
    """A worker's side: its fp32 copy of the weights it pulled (flat, on the CPU), brought to the server's
    version by a keyframe or by adding the deltas as the server added them (so it is the shadow, bitwise)."""

    def __init__(self, coder: Codec):
        self.coder = coder
        self.flat: torch.Tensor | None = None

    def apply(self, got: dict[str, Any]) -> torch.Tensor:
        """The weights after this pull (flat fp32). Raises RuntimeError for deltas with no weights to add
        them to (a server that sent deltas to a worker that never had a keyframe)."""
        if "values" in got:
            values = np.asarray(got["values"], dtype=np.float32)
            self.flat = torch.from_numpy(values.copy() if not values.flags.writeable else values).reshape(-1)
            return self.flat
        if self.flat is None:
            raise RuntimeError("the parameter server sent weight deltas to a worker that holds no weights")
        for payload in got["deltas"]:
            self.flat.add_(self.coder.decode(payload, self.flat.numel()))
        return self.flat
