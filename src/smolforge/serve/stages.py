"""Serving a model cut into stages: each stage server holds its layers and its slice of every batch's
KV cache; a `StagedModel` chains them behind the `BatchModel` protocol, so `Batch` and `Engine`
run unchanged on top of it.

Why a cache per batch id on the stage: the KV cache is as large as the layers' share of the
activations of every past token, and it lives where its layers run. The client (the engine's
process) only names the batch; prefill opens a cache, `select` cuts it down to the rows that go on
(and drops left padding no row uses, as `Batch.keep` does locally), `join` moves a newly prefilled
batch's rows into a running one (per-step scheduling, `Batch.join`), `drop` frees it.

Why numpy arrays at the boundary: a stage handle may be a remote actor, and nothing of ours
pickles tensors over a network. bfloat16 has no numpy type: it travels as float32 (exact) and is
cast back on arrival, so the chain computes what one process computes.

Why each stage keeps its own layers' KV of a kept prefix (the prefix cache through stages): a
prompt that begins like a recent one (a shared system prompt, the chat so far) is computed once on
every stage, not once per request. The engine's `PrefixCache` (prefix.py) is the head: it alone
keys the prompts, decides a hit and evicts, as in one process; its entries are `StagedSnapshot`s,
names of what the stages hold (`hold`: each stage copies its layers' K/V of the row). A hit's
decision, which snapshot and how many of its positions, is carried in the batch's first `forward`
(`resume`): every stage starts the batch's cache from its own copy and computes only the rest. What
the head lets go is freed on the stages with the next `hold` or first `forward` (`forget`). A
snapshot names the stage servers that hold it (`uid`); one taken by another server (a stage
re-placed, a model or adapter changed) is never restored: the prompt is computed whole.

A stage handle is any object with `forward`, `select`, `join`, `drop`, `hold`, `uid`, `info` and `status` as
`StageServer` has them (one whose `info` does not say `joins` is batched statically);
`ready()`, when present, is called before every batch (a remote handle re-places a dead actor there).
`status` is the monitoring read (`/metrics`): it answers while a step runs (a remote stage's in its own
concurrency group), within a short bound, and never takes a stage down (only the step path decides that).
"""

from __future__ import annotations

import functools
import gc
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from smolforge.errors import SmolforgeError
from smolforge.models.families import stop_ids
from smolforge.serve.model import (_check_servable, _with_adapter, join_cache_rows, max_positions_of, plain_layers,
                                   restore_rows, select_cache_rows, snapshot_row)
from smolforge.telemetry.memory import peak_rss_mb


class StageError(SmolforgeError):
    """A stage could not run a batch's step (unknown batch, a stage that went away)."""


def to_wire(t: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy array (bfloat16 as float32: exact)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.contiguous().numpy()


def from_wire(a: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:  # arrays out of Ray's object store are read-only
        a = a.copy()
    t = torch.from_numpy(a)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to(device)


class StageServer:
    """One stage of a model, the KV caches of the batches running through it and its layers' share of the
    kept prefixes (`hold`). Counters: `tokens` (positions its layers computed, prompts and answers) and
    `reused` (positions started from a kept prefix instead)."""

    def __init__(self, stage: Any, index: int, count: int, *, device: torch.device | str = "cpu",
                 eos_ids: frozenset[int] = frozenset(), max_positions: int = 2048, name: str = ""):
        self.stage, self.index, self.count = stage, index, count
        self.device = torch.device(device)
        self.eos_ids, self.max_positions, self.name = eos_ids, max_positions, name
        self.stage.eval()
        for p in self.stage.parameters():
            p.requires_grad_(False)
        params = list(self.stage.parameters())
        self.dtype = params[0].dtype if params else torch.float32
        self.caches: dict[str, Any] = {}
        self.uid = uuid.uuid4().hex  # this server: a prefix kept by another one is never restored here
        self.kept: dict[str, tuple[Any, int]] = {}  # snapshot id -> (its layers' K/V, bytes): `hold`
        self.tokens = self.reused = 0
        # fixed at load, so `info` (read from another thread while a step runs: `status`) does no torch work
        self.joins = plain_layers(self.stage.new_cache())
        self.params = sum(p.numel() for p in params)
        self.read: dict[str, Any] = {}  # what loading read from the checkpoint (tensors, bytes), when known

    @classmethod
    def load(cls, model: str, bounds: Sequence[int], index: int, *, adapter: str | None = None,
             device: str = "cpu", dtype: str = "fp32") -> "StageServer":
        """Stage `index` of the model cut at `bounds`, with the adapter merged.

        A LoRA or IA3 adapter (or none): only the stage's own tensors are read, merged tensor by tensor
        (`models/stage_load.py`), so the stage's machine never holds the rest of the model. A Houlsby
        adapter adds layers no tensor merge makes: the model is loaded whole, cut, and the other stages
        freed (the peak is the whole model, once)."""
        from smolforge.models.loading import pick_device
        from smolforge.models.stage_load import load_stage, mergeable

        dev = pick_device(device)
        if adapter:
            _check_servable(adapter, "stages", model)
        if not adapter or mergeable([adapter]):
            stage, read = load_stage(model, bounds, index, adapters=[adapter] if adapter else [], device=dev,
                                     dtype=dtype)
            server = cls(stage, index, len(bounds) - 1, device=dev, eos_ids=stop_ids(None, stage),
                         max_positions=max_positions_of(stage.config), name=model)
            server.read = read
            return server
        return cls._load_whole(model, bounds, index, adapter, dev, dtype)

    @classmethod
    def _load_whole(cls, model: str, bounds: Sequence[int], index: int, adapter: str, dev: torch.device,
                    dtype: str) -> "StageServer":
        from smolforge.models.loading import load_model
        from smolforge.models.partition import cut

        net = _with_adapter(load_model(model, device=dev, dtype=dtype), adapter, merge=True, model=model, engine="stages").to(dev)
        eos, max_positions = stop_ids(None, net), max_positions_of(net.config)
        stages = cut(net, bounds)
        if not 0 <= index < len(stages):
            raise SmolforgeError(f"stage {index} does not exist: the bounds {list(bounds)} make {len(stages)} stages",
                                 fix="pick a stage index from 0 to the number of stages minus one")
        stage = stages[index]
        del stages, net  # the stage holds only its own modules: the rest goes with these references
        gc.collect()
        server = cls(stage, index, len(bounds) - 1, device=dev, eos_ids=eos, max_positions=max_positions, name=model)
        server.read = {"tensors": None, "bytes": None, "whole_model": True}
        return server

    @property
    def first(self) -> bool:
        return self.stage.has_embeddings

    @property
    def last(self) -> bool:
        return self.stage.has_head

    @torch.inference_mode()
    def forward(self, batch_id: str, x: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                start: bool = False, keep: int = 1, resume: tuple[str, int] | None = None,
                forget: Sequence[str] = ()) -> np.ndarray:
        """Input ids (first stage) or hidden states -> hidden states, or last-position logits [batch, vocab]
        on the last stage ([batch, keep, vocab] of the last `keep` positions when `keep` > 1: echo).
        `start` opens the batch's cache (prefill), with `resume` = (snapshot id, length) holding that kept
        prefix's first `length` positions (x is then the rest of the prompt); later steps need it open.
        `forget` names kept prefixes to free first. StageError for an unknown batch or snapshot."""
        self.free(forget)
        if start:
            self.caches[batch_id] = self._opened(resume)
        cache = self.caches.get(batch_id)
        if cache is None:
            raise StageError(f"stage {self.index} holds no cache for batch {batch_id}",
                             fix="start the batch again: its cache was lost (the stage was restarted)")
        h = from_wire(x, self.device, None if self.first else self.dtype)
        mask = from_wire(attention_mask, self.device)
        positions = from_wire(position_ids, self.device)
        if self.first:
            h = self.stage._embed(h, positions)
        h = self.stage.run_layers(h, mask, positions, cache)
        self.tokens += int(positions.numel())
        if self.last:  # as HF with logits_to_keep: norm and head of the last `keep` positions only
            h = self.stage.lm_head(self.stage.norm(h[:, -keep:, :]))
            h = h[:, -1, :] if keep == 1 else h
        return to_wire(h)

    def _opened(self, resume: tuple[str, int] | None) -> Any:
        """A new cache, or one holding a kept prefix's first positions (`resume`: snapshot id, length)."""
        if resume is None:
            return self.stage.new_cache()
        snapshot_id, length = resume
        if snapshot_id not in self.kept:
            raise StageError(f"stage {self.index} holds no kept prefix {snapshot_id}",
                             fix="send the prompt whole: the prefix was freed or kept by another stage server")
        self.reused += int(length)
        return restore_rows(self.stage.new_cache(), self.kept[snapshot_id][0], int(length))

    def hold(self, batch_id: str, row: int, length: int, snapshot_id: str, forget: Sequence[str] = ()) -> int:
        """Keep a copy of the batch's row `row`, its last `length` positions, of this stage's layers' K/V as
        `snapshot_id` (a prefix the head's cache keeps); `forget` names kept prefixes to free first. Its bytes."""
        self.free(forget)
        cache = self.caches.get(batch_id)
        if cache is None:
            raise StageError(f"stage {self.index} holds no cache for batch {batch_id}")
        kept, nbytes = snapshot_row(cache, row, length)
        self.kept[snapshot_id] = (kept, nbytes)
        return nbytes

    def free(self, snapshot_ids: Sequence[str]) -> None:
        """Let kept prefixes go (unknown ids are ignored: never held, or freed already)."""
        for snapshot_id in snapshot_ids:
            self.kept.pop(snapshot_id, None)

    def select(self, batch_id: str, rows: list[int], trim: int) -> bool:
        """Keep only `rows` of the batch's cache and drop its first `trim` columns if it can (True then)."""
        cache = self.caches.get(batch_id)
        if cache is None:
            raise StageError(f"stage {self.index} holds no cache for batch {batch_id}")
        return select_cache_rows(cache, torch.tensor(rows, dtype=torch.long, device=self.device), trim)

    def join(self, batch_id: str, other_id: str, pad: int, other_pad: int) -> None:
        """Batch `other_id`'s rows go on in batch `batch_id`'s cache (`join_cache_rows`); `other_id` is gone."""
        cache, other = self.caches.get(batch_id), self.caches.pop(other_id, None)
        if cache is None or other is None:
            raise StageError(f"stage {self.index} holds no cache for batch {batch_id if cache is None else other_id}")
        join_cache_rows(cache, other, pad, other_pad)

    def drop(self, batch_id: str) -> None:
        self.caches.pop(batch_id, None)

    def info(self) -> dict[str, Any]:
        """What the stage is and counts. Safe from a second thread while `forward`/`hold`/`join` run (a remote
        stage answers it beside a step): it reads counters and copies what it iterates, no torch work."""
        return {"joins": self.joins, "index": self.index, "count": self.count,
                "layers": [self.stage.lo, self.stage.hi],
                "eos_ids": sorted(self.eos_ids), "max_positions": self.max_positions, "pid": os.getpid(),
                "params": self.params, "batches": len(self.caches),
                "model": self.name, "read": self.read, "peak_rss_mb": round(peak_rss_mb(), 1),
                "model_type": getattr(self.stage.config, "model_type", None), "uid": self.uid,
                "tokens": self.tokens, "prefix_tokens_reused": self.reused, "prefix_entries": len(self.kept),
                "prefix_bytes": sum(nbytes for _, nbytes in list(self.kept.values()))}

    def status(self) -> dict[str, Any] | None:
        """The monitoring read (`StageHandle.status`): in this process, `info()` at once."""
        return self.info()


class StageHandle(Protocol):
    uid: str | None  # the stage server answering now (None: none is)

    def forward(self, batch_id: str, x: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                start: bool = False, keep: int = 1, resume: tuple[str, int] | None = None,
                forget: Sequence[str] = ()) -> np.ndarray: ...

    def hold(self, batch_id: str, row: int, length: int, snapshot_id: str, forget: Sequence[str] = ()) -> int: ...

    def select(self, batch_id: str, rows: list[int], trim: int) -> bool: ...

    def join(self, batch_id: str, other_id: str, pad: int, other_pad: int) -> None: ...

    def drop(self, batch_id: str) -> None: ...

    def info(self) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any] | None:
        """`info()` for a monitoring read: answered beside a running step, within a short bound; None when
        the stage does not answer (not placed, or not in time). Never marks the stage broken."""
        ...


@dataclass
class StagedCache:
    """What the batch holds of a staged cache: its name on the stages, and the kept prefix its first
    forward starts from (`resume`: snapshot id, length; `StagedModel.restore`)."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: bool = False
    resume: tuple[str, int] | None = None


@dataclass(frozen=True)
class StagedSnapshot:
    """A prefix the stages keep (each its layers' share): its name there and the servers that hold it."""

    id: str
    holders: tuple[str | None, ...]


class StagedModel:
    """The `BatchModel` of a chain of stages; the tokenizer is local, the weights are on the stages."""

    def __init__(self, stages: Sequence[StageHandle], tokenizer: Any, *, name: str,
                 eos_ids: frozenset[int] | None = None, max_positions: int | None = None):
        if not stages:
            raise SmolforgeError("a staged model needs at least one stage", fix="give one stage handle per stage")
        self.stages, self.tokenizer, self.name = list(stages), tokenizer, name
        self.device = torch.device("cpu")  # where the batch's ids, masks and logits live
        if eos_ids is None or max_positions is None:
            info = self.stages[-1].info()
            eos_ids = eos_ids if eos_ids is not None else frozenset(info["eos_ids"])
            max_positions = max_positions or int(info["max_positions"])
        # the stages' generation config ids with the tokenizer's (its eos, the template's end of turn)
        self.eos_ids = frozenset(eos_ids) | stop_ids(tokenizer)
        self.max_positions = max_positions
        self._forget: list[str] = []  # kept prefixes the head let go, freed on the stages with the next message

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else next(iter(self.eos_ids), 0))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: StagedCache, keep: int = 1) -> torch.Tensor:
        start, cache.started = not cache.started, True
        x, mask, positions = to_wire(input_ids), to_wire(attention_mask), to_wire(position_ids)
        last = len(self.stages) - 1
        told: dict[str, Any] = {}  # the first forward carries the hit's decision and what to free
        if start and cache.resume is not None:
            told["resume"] = cache.resume
        if start and self._forget:
            told["forget"], self._forget = self._forget, []
        try:
            for k, stage in enumerate(self.stages):  # only the last stage is told `keep` (it has the head)
                extra = (keep,) if keep != 1 and k == last else ()
                x = stage.forward(cache.id, x, mask, positions, start, *extra, **told)
        except Exception:
            self._forget.extend(told.get("forget", ()))  # told again with the next message
            raise
        return from_wire(x, self.device)

    def snapshot(self, cache: StagedCache, row: int, length: int) -> tuple[StagedSnapshot, int]:
        """Every stage keeps row `row`'s last `length` positions of its layers' K/V (`StageServer.hold`): the
        snapshot naming them, and their bytes on all stages together (`SnapshotModel.snapshot`)."""
        snapshot_id = uuid.uuid4().hex
        forget, self._forget = self._forget, []
        told = {"forget": forget} if forget else {}
        nbytes, holders = 0, []
        try:
            for stage in self.stages:
                nbytes += int(stage.hold(cache.id, row, length, snapshot_id, **told))
                holders.append(stage.uid)
        except Exception:  # the stages that kept it free it with the next message, and what they were told
            self._forget.extend([*forget, snapshot_id])
            raise
        return StagedSnapshot(snapshot_id, tuple(holders)), nbytes

    def restore(self, snapshot: StagedSnapshot, length: int) -> StagedCache:
        """A cache whose first forward starts every stage from the snapshot's first `length` positions
        (`StageServer.forward`'s `resume`). StageError when a stage server that kept it is not the one
        answering now (re-placed, or another model or adapter): the engine then computes the prompt whole."""
        cache = self.new_cache()
        if tuple(stage.uid for stage in self.stages) != snapshot.holders or None in snapshot.holders:
            raise StageError("a kept prefix's stage servers are gone (a stage was re-placed or changed)",
                             fix="nothing to do: the prompt is computed whole and kept again")
        cache.resume = (snapshot.id, length)
        return cache

    def forget(self, snapshot: StagedSnapshot) -> None:
        """The head's prefix cache let the snapshot go: the stages free it with the next message."""
        self._forget.append(snapshot.id)

    def new_cache(self) -> StagedCache:
        for stage in self.stages:
            ready = getattr(stage, "ready", None)
            if ready is not None:
                ready()
        return StagedCache()

    def select_rows(self, cache: StagedCache, rows: torch.Tensor, trim: int) -> bool:
        keep = [int(i) for i in rows.tolist()]
        trimmed = {stage.select(cache.id, keep, trim) for stage in self.stages}
        if len(trimmed) > 1:
            raise StageError("the stages disagree on trimming the cache's left padding",
                             fix="serve a model whose layers all use plain (not sliding-window) attention caches")
        return trimmed.pop()

    def stage_infos(self) -> list[dict[str, Any] | None]:
        """Each stage's `info()` in stage order (its counters among it: `tokens`, positions its layers computed;
        `prefix_tokens_reused`, positions restored from its share of a kept prefix instead; `prefix_entries`,
        `prefix_bytes`), None for a stage that does not answer (not placed, not in time, or failing): each
        stage's `status()`, the monitoring read, which never takes a stage down. The stages are asked at once
        (a thread each), so a scrape waits one scrape timeout at most, not one per silent stage. A remote stage's
        is a network call: call this off an event loop (`/metrics` does)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(self.stages), thread_name_prefix="sf-stage-status") as pool:
            return list(pool.map(_status_of, self.stages))

    @functools.cached_property
    def model_type(self) -> str | None:
        """The checkpoint's config `model_type`, as the last stage read it (`StageServer.info`): the family the
        HTTP side asks (its tool-call format), the one a one-process model of the same checkpoint names."""
        return self.stages[-1].info().get("model_type")

    @functools.cached_property
    def joins(self) -> bool:
        """True when every stage's cache takes new rows (plain K/V layers): the engine then schedules per step."""
        return all(stage.info().get("joins", False) for stage in self.stages)

    def join_caches(self, cache: StagedCache, other: StagedCache, pad: int, other_pad: int) -> StagedCache:
        """`other`'s rows go on in `cache`'s on every stage (`StageServer.join`)."""
        for stage in self.stages:
            stage.join(cache.id, other.id, pad, other_pad)
        other.started = False  # gone on the stages: nothing to release
        return cache

    def release(self, cache: StagedCache) -> None:
        errors = []
        for stage in self.stages:
            try:
                stage.drop(cache.id)
            except Exception as err:  # a dead stage's cache is gone anyway; free the others
                errors.append(err)
        if errors and len(errors) == len(self.stages):
            raise errors[0]


def _status_of(stage: StageHandle) -> dict[str, Any] | None:
    """A stage's `status()`, None when it raises (a stage that cannot answer now is reported as not up)."""
    try:
        return stage.status()
    except Exception:  # noqa: BLE001 - reported as not up, never raised into a scrape
        return None


def even_bounds(num_layers: int, stages: int) -> list[int]:
    """Layer bounds giving `stages` stages as equal as can be (every stage at least one layer)."""
    if not 1 <= stages <= num_layers:
        raise SmolforgeError(f"cannot cut a {num_layers}-layer model into {stages} stages",
                             fix=f"ask for 1 to {num_layers} stages")
    return [round(i * num_layers / stages) for i in range(stages + 1)]


def local_stages(model: str, bounds: Sequence[int], *, adapter: str | None = None,
                 device: str = "cpu") -> list[StageServer]:
    """Every stage in this process (tests, and a check that the cut serves what the whole model does)."""
    return [StageServer.load(model, bounds, i, adapter=adapter, device=device) for i in range(len(bounds) - 1)]


def staged_model(model: str, stages: Sequence[StageHandle], *, name: str | None = None) -> StagedModel:
    """A `StagedModel` over these handles with the model's tokenizer loaded here."""
    from smolforge.models.loading import load_tokenizer

    return StagedModel(stages, load_tokenizer(model), name=name or model)
