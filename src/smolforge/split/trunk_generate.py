"""The trunk server's side of inference through the split: one trunk KV cache per generation.

A user who trained with a trunk server chats with the result without merging it: the client runs
the bottom and the top with its own KV caches and sends the trunk only the hidden states of the
new positions (the whole prompt once, then one position per token). The server keeps, per
generation, a copy of the trunk with the trained LoRA the client sends (the client holds a copy of
it in every checkpoint; the server that trained it may be gone, or be another node) and the trunk
layers' KV cache, so a step costs one position here, not the whole prefix.

The rules are the training sessions': a malformed message is INVALID_ARGUMENT and the generation
stays usable; an unknown generation is NOT_FOUND (the client opens a new one and replays its
prefix); a repeated step (its reply was lost) gets the same reply without growing the cache
twice; a generation is freed when the client closes it or after `timeout` seconds idle. `finished`
keeps a short record of each generation that ended (positions per trunk forward, cache length,
why it ended): what the logs and the tests read.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import grpc
import torch
from pydantic import ValidationError

from smolforge.config import PeftSpec
from smolforge.models.partition import Arch
from smolforge.split.calls import (CallError, check_length, check_mask, check_positions, invalid, model_context,
                                   not_found, precondition)
from smolforge.split.codec import CodecError, decode, encode
from smolforge.split.lora import load_lora_state, lora_state
from smolforge.split.partition import Trunk
from smolforge.split.protocol import pb

log = logging.getLogger("smolforge.split.server")
NewTrunk = Callable[[int, PeftSpec | None], tuple[Trunk, list]]


@dataclass
class Generation:
    id: str
    trunk: Trunk
    cache: Any  # transformers DynamicCache: the trunk layers' keys and values
    codec: str
    max_positions: int
    batch: int = 0  # fixed by the first step
    length: int = 0  # positions in the cache
    forward_positions: list[int] = field(default_factory=list)  # new positions per trunk forward
    last: tuple[int, pb.GenerateStepReply] | None = None  # (past_length, reply) of the latest step
    last_seen: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class GenerationRecord:
    """What a generation did, kept after its cache is freed."""

    id: str
    forward_positions: tuple[int, ...]
    cache_length: int
    ended: str  # "closed", "idle" (timed out) or "error"


class Generations:
    """The open generations of one trunk server; the servicer's generation RPCs call these."""

    def __init__(self, arch: Arch, config, device: torch.device, new_trunk: NewTrunk, *, timeout: float,
                 limit: int):
        self.arch = arch
        self.device = device
        self.new_trunk = new_trunk
        self.timeout = timeout
        self.limit = limit
        self.max_positions = model_context(config)
        self.by_id: dict[str, Generation] = {}
        self.finished: deque[GenerationRecord] = deque(maxlen=64)
        self.lock = threading.Lock()

    def active(self) -> int:
        return len(self.by_id)

    def _full(self) -> CallError:
        return CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the server holds its maximum of {self.limit} generations; try again later")

    def open(self, req: pb.OpenGenerationRequest) -> pb.OpenGenerationReply:
        spec = self._spec(req.lora)
        if not 1 <= req.max_positions <= self.max_positions:
            raise invalid(f"max_positions must be 1..{self.max_positions} (the model's context), "
                          f"got {req.max_positions}")
        if len(self.by_id) >= self.limit:  # checked before building a trunk copy, and again below
            raise self._full()
        trunk, _ = self.new_trunk(0, spec)
        self._load_weights(trunk, req.trunk_lora)
        trunk.eval()
        gen = Generation(id=secrets.token_hex(16), trunk=trunk, cache=trunk.new_cache(), codec=req.codec,
                         max_positions=int(req.max_positions))
        with self.lock:
            if len(self.by_id) >= self.limit:
                raise self._full()
            self.by_id[gen.id] = gen
        log.info("generation %s opened (LoRA %s, up to %d positions)", gen.id[:8],
                 f"r={spec.r}" if spec else "off", gen.max_positions)
        return pb.OpenGenerationReply(generation_id=gen.id, idle_timeout_s=self.timeout,
                                      max_positions=gen.max_positions)

    def _spec(self, msg: pb.LoraSpec) -> PeftSpec | None:
        """The client's LoRA settings (dropout off: inference), checked before anything is allocated."""
        if not msg.enabled:
            return None
        if not 1 <= msg.r <= self.arch.hidden_size or not math.isfinite(msg.alpha) or len(msg.target_modules) > 64:
            raise invalid(f"lora needs r in 1..{self.arch.hidden_size}, a finite alpha and at most 64 target modules, "
                          f"got r={msg.r}, alpha={msg.alpha}, {len(msg.target_modules)} targets")
        try:
            return PeftSpec(method="lora", r=msg.r, alpha=msg.alpha, dropout=0.0,
                            target_modules=list(msg.target_modules) or None)
        except ValidationError as err:
            raise invalid(f"lora: {err.errors()[0]['msg']}") from None

    def _load_weights(self, trunk: Trunk, weights: Sequence[pb.NamedTensor]) -> None:
        """The trained trunk LoRA: exactly the trunk's LoRA names, each with its shape."""
        want = lora_state(trunk, self.arch.canonical)
        given: dict[str, torch.Tensor] = {}
        for named in weights:
            if named.name in given:
                raise invalid(f"trunk_lora names {named.name} twice")
            try:
                given[named.name] = decode(named.tensor)
            except CodecError as err:
                raise invalid(f"trunk_lora {named.name}: {err}") from None
        missing, extra = sorted(set(want) - set(given)), sorted(set(given) - set(want))
        if missing or extra:
            raise invalid(f"trunk_lora does not fit this trunk's LoRA ({len(want)} weights): "
                          f"{len(missing)} missing{f' (first: {missing[0]})' if missing else ''}, "
                          f"{len(extra)} unexpected{f' (first: {extra[0]})' if extra else ''}")
        for name, value in given.items():
            if value.shape != want[name].shape or not value.is_floating_point():
                raise invalid(f"trunk_lora {name} must be a floating tensor {list(want[name].shape)}, "
                              f"got {value.dtype} {list(value.shape)}")
        if given:
            load_lora_state(trunk, given, self.arch.canonical)

    def _get(self, generation_id: str) -> Generation:
        with self.lock:
            gen = self.by_id.get(generation_id)
        if gen is None:
            raise not_found("generation", generation_id)
        gen.last_seen = time.monotonic()
        return gen

    def step(self, req: pb.GenerateStepRequest) -> pb.GenerateStepReply:
        gen = self._get(req.generation_id)
        with gen.lock:
            if gen.cache is None:  # freed (timed out) between the lookup and the lock
                raise not_found("generation", gen.id)
            if gen.last is not None and req.past_length == gen.last[0]:
                return gen.last[1]  # a retry whose first reply was lost
            if req.past_length != gen.length:
                raise precondition(f"a step after {req.past_length} positions, but this generation's cache holds "
                                   f"{gen.length}")
            hidden, mask, pos = self._inputs(gen, req)
            try:
                with torch.no_grad():
                    out = gen.trunk(hidden, mask, pos, gen.cache)
            except Exception:
                self._end(gen, "error")  # the cache may hold part of the step: never use it again
                raise
            gen.batch, gen.length = hidden.shape[0], gen.length + hidden.shape[1]
            gen.forward_positions.append(hidden.shape[1])
            reply = pb.GenerateStepReply(hidden=encode(out, gen.codec), cache_length=gen.length)
            gen.last = (int(req.past_length), reply)
        gen.last_seen = time.monotonic()
        return reply

    def _inputs(self, gen: Generation, req: pb.GenerateStepRequest) -> tuple[torch.Tensor, ...]:
        check_length(req.hidden.shape, gen.max_positions - gen.length)  # before decoding or computing
        try:
            hidden, mask, pos = decode(req.hidden), decode(req.attention_mask), decode(req.positions)
        except CodecError as err:
            raise invalid(str(err)) from None
        h = self.arch.hidden_size
        if hidden.ndim != 3 or min(hidden.shape) < 1 or hidden.shape[2] != h or not hidden.is_floating_point():
            raise invalid(f"hidden must be a floating tensor [batch, new, {h}], got {hidden.dtype} "
                          f"{list(hidden.shape)}")
        b, t = hidden.shape[:2]
        if gen.batch and b != gen.batch:
            raise invalid(f"this generation runs {gen.batch} rows, the step sent {b}")
        if gen.length + t > gen.max_positions:
            raise invalid(f"the cache would hold {gen.length + t} positions, over the {gen.max_positions} "
                          "this generation was opened for")
        mask = check_mask(mask, b, gen.length + t)
        pos = check_positions(pos, b, t, limit=gen.max_positions)
        dtype = next(gen.trunk.parameters()).dtype
        return hidden.to(self.device, dtype), mask.to(self.device), pos.to(self.device)

    def close(self, generation_id: str) -> pb.CloseGenerationReply:
        with self.lock:
            gen = self.by_id.get(generation_id)
        if gen is None:
            return pb.CloseGenerationReply(closed=False)
        with gen.lock:  # a step still running finishes first
            self._end(gen, "closed")
        return pb.CloseGenerationReply(closed=True, cache_length=gen.length, steps=len(gen.forward_positions))

    def _end(self, gen: Generation, why: str) -> None:
        with self.lock:
            if self.by_id.pop(gen.id, None) is None:
                return
        gen.cache = None  # the KV cache goes now, whoever still holds the record
        self.finished.append(GenerationRecord(gen.id, tuple(gen.forward_positions), gen.length, why))
        log.info("generation %s %s after %d steps (%d positions)", gen.id[:8],
                 {"idle": f"timed out after {self.timeout:.0f} s idle"}.get(why, why), len(gen.forward_positions),
                 gen.length)

    def reap(self) -> list[str]:
        """Free the generations idle for longer than the timeout; returns their ids."""
        now = time.monotonic()
        with self.lock:
            stale = [g for g in self.by_id.values() if now - g.last_seen > self.timeout and not g.lock.locked()]
        for gen in stale:
            self._end(gen, "idle")
        return [g.id for g in stale]
