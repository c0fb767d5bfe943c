"""FSDP (FSDP2, `torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state sharded.

Each transformer block is one FSDP unit, and the root (embeddings, final norm, head, and what PEFT adds
outside the blocks) is the last. Between uses a rank keeps 1/N of every parameter; a block's weights
are all-gathered just before its forward and again before its backward, then freed; its gradients are
reduce-scattered, each rank keeping the 1/N it owns. AdamW, built over the sharded parameters, holds
its moments for that 1/N only. Why it looks like this:

- A subclass of `DDP`: the group, ranks, metric reductions, RNG gathering and byte counting are DDP's.
  The reduce-scatter averages over the ranks as DDP's all-reduce does, so the loop's loss scaling
  (`step_ranks` = world) is unchanged and the weights are DDP's (AdamW is elementwise).
- With LoRA the frozen base is sharded too (`fully_shard` shards every parameter of a unit): nothing
  frozen has a gradient or optimizer state, and each rank holds 1/N of the base between uses. The price
  is traffic: the base is all-gathered twice a step, where DDP sends only the LoRA gradients.
- Sharding replaces the parameters with DTensors, so it happens in `prepare`, before the optimizer
  sees them. Micro-batches before the last skip the reduce-scatter (`set_requires_gradient_sync`).
- Gradient clipping needs nothing: `clip_grad_norm_` over DTensor gradients reduces the global norm.
- Evaluation and generation run on whole weights (`whole_model`): ranks make different numbers of
  forwards, and a sharded forward is a collective every rank must join.
- Checkpoints hold the whole state, written by rank 0, not one shard file per rank (what `dcp.save`
  writes): a home cluster has no shared filesystem, and rank 0 alone uploads its checkpoint
  directory. The state is never whole in one process: each weight and each optimizer tensor in turn
  is gathered (`DTensor.full_tensor`, every rank), written by rank 0 into a safetensors file as it
  comes (`checkpoint.TensorFileWriter`) and dropped. (torch.distributed.checkpoint's
  `get_model_state_dict(full_state_dict=True)` gathers the whole state onto rank 0 first: for a
  100M-parameter full fine-tune that took rank 0 from 1.7 to 2.9 GB.) It is keyed as the other
  strategies key it (parameter names; the optimizer by torch's integer ids), so a checkpoint moves
  between fsdp, ddp, zero1 and world sizes. To resume, every rank (each staged the checkpoint) reads
  it one tensor at a time and, of a sharded weight or moment, only the rows of its own shard
  (`safe_open`'s slices, `train.tensor_reader`): a rank never holds more of the checkpoint than it
  keeps (`checkpoint_bytes_read` counts it).
- The final adapter (or full model) is streamed the same way and written by rank 0 as ordinary HF
  files (`save_adapter(..., weights=path)`).
- Freed memory goes back to the system: glibc keeps freed blocks under its dynamic mmap threshold
  (up to 32 MB) in its heap, and FSDP's per-block gathers and frees fragment it; `prepare` fixes the
  threshold at 1 MiB (`telemetry.memory.return_freed_memory`). Measured on llama-100m full
  fine-tuning: a rank's training peak 2.5 GB before, 1.66 GB after (DDP's: 2.76 GB either way), for
  about 1.4x the CPU per step (fresh mappings faulted in each step; BENCHMARKS.md).
- Bytes: every all-gather and reduce-scatter FSDP makes goes through counting subclasses of its own
  default collectives (`set_custom_all_gather` / `set_custom_reduce_scatter`): what this rank hands
  over, its shard for a gather, the whole gradient buffer for a reduce-scatter (as DDP counts buckets).
- No speed balancing: every block's collectives make a fast rank wait for the slowest, so a rank cannot
  measure its own speed.
"""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor, Shard

from smolforge.parallel.strategies.ddp import DDP
from smolforge.telemetry.memory import return_freed_memory
from smolforge.train.checkpoint import optimizer_file_key, optimizer_file_metadata, spool_tensor_file
from smolforge.train.tensor_reader import TensorReader, optimizer_file_groups
from smolforge.train.loop import optimizer_state_bytes
from smolforge.train.rank_context import RankContext

SCATTER = StateDictOptions(full_state_dict=True, strict=False)  # whole tensors on every rank; each keeps its shard


class FSDP(DDP):
    name = "fsdp"
    balances = False  # see the module docstring: per-block collectives hide a rank's own speed

    def __init__(self, context: RankContext | None = None, **config: Any):
        super().__init__(context, **config)
        self.model: torch.nn.Module | None = None

    # -- sharding -----------------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, device: torch.device) -> None:
        if self.model is not None:
            return
        self.device = device
        return_freed_memory()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        mesh = init_device_mesh(device.type, (self.world,))
        place = functools.partial(shard_dim, world=self.world)
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, shard_placement_fn=place)
        fully_shard(model, mesh=mesh, shard_placement_fn=place)
        if hasattr(model, "generate"):  # generation enters through the root, as forward does
            register_fsdp_forward_method(model, "generate")
        for unit in self._units(model):
            unit.set_custom_all_gather(_CountedAllGather(self))
            unit.set_custom_reduce_scatter(_CountedReduceScatter(self))
        self.model = model

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        if model is not self.model:
            raise RuntimeError("fsdp shards the model before its optimizer is made (smolforge.train.loop."
                               "make_optimizer calls Strategy.prepare)")
        self.device = device
        return model

    @staticmethod
    def _units(model: torch.nn.Module) -> list[FSDPModule]:
        return [m for m in model.modules() if isinstance(m, FSDPModule)]

    def accumulate(self, wrapped: torch.nn.Module, last: bool) -> ContextManager:
        wrapped.set_requires_gradient_sync(last)  # FSDP2's no_sync: accumulate unsharded, reduce once
        return nullcontext()

    def whole_model(self, model: torch.nn.Module) -> ContextManager:
        return self._whole(model)

    @contextmanager
    def _whole(self, model: torch.nn.Module) -> Iterator[None]:
        """Every unit all-gathered and kept so: forwards inside make no collective."""
        units = self._units(model)
        model._get_fsdp_state()._lazy_init()  # no-op after the first forward; the root must be root
        for unit in units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(unit is not model, recurse=False)  # FSDP's defaults

    # -- checkpoints --------------------------------------------------------------------------------

    def _trainable_names(self, model: torch.nn.Module) -> list[str]:
        return [n for n, p in model.named_parameters() if p.requires_grad]

    def model_state(self, model: torch.nn.Module, spool_dir: Path | None = None) -> Path | None:
        # The names `named_parameters` gives (a tied weight once), as a checkpoint of any strategy has them
        params = [(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad]
        self.checkpoint_bytes_sent += sum(_local_bytes(p) for _, p in params)
        return self._stream(params, "trainable", {"format": "pt"}, spool_dir)

    def load_model_state(self, model: torch.nn.Module, weights: TensorReader) -> None:
        """Each weight in turn, and of a sharded one only this rank's rows: resuming never holds more
        of the checkpoint than the rank keeps."""
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in weights.keys():
                p = params[name]
                if isinstance(p, DTensor):
                    p.to_local().copy_(weights.get(name, shard_index(p)).to(p.device, p.dtype))
                else:
                    p.copy_(weights.get(name).to(p.device, p.dtype))

    def optimizer_state(self, optimizer: torch.optim.Optimizer, spool_dir: Path | None = None) -> Path | None:
        """Streamed as `optimizer.state_dict()` would hold it (integer ids, same groups), tensors in the file."""
        self.checkpoint_bytes_sent += optimizer_state_bytes(optimizer)  # this rank's shards
        params = [p for group in optimizer.param_groups for p in group["params"]]
        tensors: list[tuple[str, torch.Tensor]] = []
        scalars: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(params):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    tensors.append((optimizer_file_key(i, key), value))
                else:
                    scalars.setdefault(i, {})[key] = value
        groups = optimizer.state_dict()["param_groups"]
        return self._stream(tensors, "optim", optimizer_file_metadata(groups, scalars), spool_dir)

    def _stream(self, entries: list[tuple[str, torch.Tensor]], kind: str, metadata: dict[str, str],
                spool_dir: Path | None) -> Path | None:
        """Every rank: each tensor gathered whole in turn (a collective for a sharded one); rank 0 writes
        it into a fresh safetensors file under `spool_dir` as it comes, and returns the file's path."""
        whole = ((name, t.full_tensor() if isinstance(t, DTensor) else t) for name, t in entries)
        if not self.is_main:
            for _ in whole:
                pass
            return None
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in entries]  # a DTensor's shape is the whole one
        return spool_tensor_file(spool_dir, kind, whole, specs, metadata)

    def load_optimizer_file(self, optimizer: torch.optim.Optimizer, tensors: TensorReader) -> None:
        """A streamed optimizer state, each moment read as only this rank's shard of it (a moment has its
        parameter's shape and sharding; `step` and other scalars are read whole)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        meta = tensors.metadata()
        state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in json.loads(meta.get("scalars", "{}")).items()}
        for key in tensors.keys():
            _, index, name = key.split(".", 2)
            p = params[int(index)]
            if isinstance(p, DTensor) and tensors.shape(key) == tuple(p.shape):
                local = tensors.get(key, shard_index(p)).to(p.device, p.dtype)
                value = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
            else:
                value = tensors.get(key).to(p.device)
            state.setdefault(int(index), {})[name] = value
        for group, saved in zip(optimizer.param_groups, optimizer_file_groups(meta)):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for index, values in state.items():
            optimizer.state[params[index]] = values

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        names = {i: name for name, i in self._ids(optimizer).items()}
        by_name = {"state": {names[int(i)]: st for i, st in state["state"].items()},
                   "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                    for g in state["param_groups"]]}
        set_optimizer_state_dict(self.model, optimizer, by_name, options=SCATTER)

    def _ids(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Parameter name -> the integer id `optimizer.state_dict()` gives it (its place in the groups)."""
        name_of = {p: n for n, p in self.model.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {name_of[p]: i for i, p in enumerate(params)}


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: the largest ModuleList whose items share one class (Llama/Qwen2's
    `model.layers`, GPT-2's `transformer.h`), found through PEFT's wrappers."""
    best: list[torch.nn.Module] = []
    best_size = 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = list(module), size
    return best


def shard_dim(param: torch.nn.Parameter, world: int) -> Shard | None:
    """FSDP shards dim 0; a parameter with fewer rows than ranks ((IA)^3's (1, d) scales) is split along
    a dimension that divides evenly instead, or one rank would hold all of it. None: FSDP's default."""
    if param.ndim == 0 or param.shape[0] >= world:
        return None
    dims = [d for d in sorted(range(param.ndim), key=lambda d: -param.shape[d]) if param.shape[d] % world == 0]
    return Shard(dims[0]) if dims else None


def shard_index(param: DTensor) -> tuple[slice, ...]:
    """The rows (or columns) of the whole tensor this rank's shard of `param` holds: FSDP2 places one
    `Shard(dim)` on a one-dimensional mesh and splits as `torch.chunk` does (ceil(n / world) each, the
    last ranks fewer or none)."""
    (placement,) = param.placements
    dim, n = placement.dim, param.shape[placement.dim]
    size = -(-n // param.device_mesh.size())
    start = min(n, param.device_mesh.get_local_rank() * size)
    return tuple(slice(None) for _ in range(dim)) + (slice(start, min(n, start + size)),)


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


class _CountedAllGather(DefaultAllGather):
    """FSDP's own all-gather, counting the shard this rank hands over."""

    def __init__(self, strategy: FSDP):
        super().__init__()
        self.strategy = strategy

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        self.strategy._count(input_tensor)
        with self.strategy.waiting():
            return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountedReduceScatter(DefaultReduceScatter):
    """FSDP's own reduce-scatter, counting the gradient buffer this rank hands over."""

    def __init__(self, strategy: FSDP):
        super().__init__()
        self.strategy = strategy

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False):
        self.strategy._count(input_tensor)
        with self.strategy.waiting():
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
