"""Pipeline parallelism: each rank of the group runs one stage (a range of layers) of every micro-batch.

`torch.distributed.pipelining` runs the schedule (`ScheduleGPipe`: every forward, then every backward;
`Schedule1F1B`: one backward as soon as each forward has reached the last stage, so fewer activations
are alive at once); this module decides what a stage is, what crosses a cut, and how the result stays
the one-process result. Why it looks like this:

- **Ranks are stages.** World size = stages; rank i runs stage i (`models.partition.cut`: the first also
  embeds, the last also normalises, projects and computes the loss). The ranks are the data-parallel
  runner's own processes, so the runner places a pipeline job as it places a ddp job (and restarts it
  from its last checkpoint when a stage's node dies). Unless `bounds` are given, every rank measures
  its node (matmul FLOP/s with its threads, free memory: `stage_costs.measure_node`), the ranks exchange
  that, and `stage_costs.plan_in_order` sizes each stage's layers to its node, counting its weights and
  the activations its in-flight micro-batches keep for the backward (`models.stage_memory`, from the
  run's batch, max length, PEFT method and schedule); rank 0 states the plan in the job's events
  (`pipeline_plan`).
- **Every rank gets the whole step's rows** (`rows_for`). Only the first stage reads the input ids and
  only the last the labels, but every stage needs the attention mask: it builds its own causal/padding
  mask and position ids from it (right padding: positions 0..w-1, what HF builds), so only hidden
  states go forward over a cut and only their gradients come back. A step therefore holds
  batch_size x grad_accum x stages rows, like a ddp step: the global batch of a job does not depend on
  the strategy, and `samples` count as they do for ddp.
- **Each rank reads only its stage** (`load_model`, `models.stage_load`): the whole model is built on the
  meta device, the stages are planned and cut on it, and only this rank's stage's parameters are read
  from the checkpoint's safetensors by key (a tied head: the embedding matrix, on the first and the last
  rank); every other parameter gets a tensor with no elements. No rank ever loads the whole model. On a
  node that lacks the model (it travels), the skeleton is built from the config and tokenizer the runner
  sent there, and once the cut is planned `model_part` (set by the rank glue) brings this rank only its
  stage's part, whose one safetensors file is then all it reads (`stage_load.part_tensors`). PEFT
  is then applied to the whole (mostly empty) model as the loop does, so its seeded initialisation is
  one process's, and the names, `requires_grad`, the parameter order and the optimizer's ids stay the
  whole model's; `prepare` cuts it again and frees the other stages' adapter weights. Each rank's
  optimizer holds only its stage's trainable parameters. (A model handed in already loaded is cut and
  freed the same way.)
- **Micro-batches are the loop's** (`microbatches` unset): batch_size rows each, grad_accum x stages of
  them per step, which 1F1B needs (at least one per stage). Each runs at its own width (its longest
  row), exactly as the loop runs it alone, so every micro-batch's gradient is the one-process gradient,
  accumulated in the same order: pipeline training with batch_size B and grad_accum A on N stages equals
  one process with batch_size B and grad_accum A x N. The schedule's buffers have one shape, so
  micro-batches cross the cuts padded to the step's width (`pipeline_micro.StageStep` crops and pads back); a step of
  another width rebuilds the stage and schedule (a two-message handshake with each neighbour).
  `microbatches: M` regroups the step's rows into M micro-batches instead (fewer, larger sends).
- **Shapes are given, not inferred**: `PipelineStage` gets input and output examples on the meta
  device, so nothing runs to infer them and no pickled metadata (`send_object_list`) crosses the network.
- **Loss**: the loop's (`StepPass`): the summed token loss times the step's normalisation (the loop's
  `scale`), computed on the last stage in fp32 (`scale_grads=False`: the schedule must not also divide
  by the micro-batch count). The step's loss is broadcast from the last rank, so every rank reports it.
- **Tied embeddings** (tiny presets, GPT-2): the first and the last stage each hold the matrix. When it
  trains, the last rank's head gradient and the first rank's embedding gradient are summed between the
  two (an all-reduce on their own subgroup) before clipping; both then take the same AdamW step from the
  same state, so the copies stay equal. Checkpoints and the final model take the first rank's.
- **Gradient clipping** uses the global norm, computed as `clip_grad_norm_` computes it in one process:
  each parameter's norm on the rank that holds it, gathered in the model's order, the norm of those.
- **Checkpoints hold the whole state, keyed as every strategy keys it**: trainable weights by parameter
  name and the optimizer by the whole model's integer ids (the groups `loop.make_optimizer` builds), so a
  pipeline checkpoint resumes under pipeline (any stage count), single, ddp or fsdp, and the other way
  round. Rank 0 gathers them: each rank sends a JSON header (names, dtypes, shapes) as a byte tensor, then
  its tensors, which rank 0 writes as they come (the optimizer's into a safetensors file, as FSDP does).
- **Evaluation runs through the stages** (`eval_sums`, `pipeline_eval.StageEval`): forward only, every
  rank every eval row, hidden states over the cuts; the last stage computes the loss and the greedy
  tokens of the accuracy check and shares the numbers, so no rank ever holds the whole model.
  `whole_model` is therefore empty: the final adapter or model is written from the gathered weights
  (`model_state`), never from the modules.
- Not supported: prefix and prompt tuning (their virtual tokens are not layers), fp16 with loss scaling
  (a rank that skips a step on an overflow would leave the others behind), speed-balanced rows. With
  dropout the weights are not one process's: each rank draws random numbers for its own layers only.
- GPU: every tensor this module sends lives on `device_for(device)` (NCCL sends device tensors).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ContextManager, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from smolforge.errors import SmolforgeError
from smolforge.models.partition import Stage, arch_of, check_bounds, cut
from smolforge.models.stage_costs import NodeCapacity, measure_node, model_info, plan_in_order
from smolforge.models.stage_memory import TrainShape, Workload, training_workload
from smolforge.models.peft import peft_method
from smolforge.models.peft_methods import base_transformer, model_method
from smolforge.parallel.strategies.ddp import DDP
from smolforge.parallel.strategies.pipeline_micro import StageStep, concat_micro_batches
from smolforge.parallel.strategies.pipeline_state import PipelineCheckpoints
from smolforge.config import TrainConfig
from smolforge.train.precision import autocast_dtype
from smolforge.train.rank_context import RankContext
from smolforge.train.strategy import Batch, StepPass

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


_NAME_BYTES = 64  # a node's name in the measured-nodes exchange


class PipelineSettings(BaseModel):
    """`strategy_config` of `pipeline` (`--set strategy_config.KEY=VALUE`)."""

    model_config = ConfigDict(extra="forbid")
    schedule: Literal["gpipe", "1f1b"] = Field("1f1b", description="the order of forwards and backwards")
    microbatches: int | None = Field(None, ge=1, description="micro-batches per step (default: the loop's, "
                                                             "batch_size rows each)")
    bounds: list[int] | None = Field(None, description="layer bounds, stages+1 of them (default: planned "
                                                       "from each rank's measured node)")

    @field_validator("bounds")
    @classmethod
    def _starts_at_zero_and_grows(cls, bounds: list[int] | None) -> list[int] | None:
        """What can be checked before the model is known (`partition.check_bounds` checks the rest)."""
        if bounds is not None and (len(bounds) < 2 or bounds[0] != 0
                                   or any(a > b for a, b in zip(bounds, bounds[1:]))):
            raise ValueError(f"bounds {bounds}: give stages+1 non-decreasing layer indices from 0 to the layer count")
        return bounds


@dataclass
class _Layout:
    """Who holds which parameter, worked out on every rank from the whole model before anything is freed."""

    names: list[str]  # `named_parameters()` order (a tied weight once): the whole model's
    params: list[nn.Parameter]
    owners: list[tuple[int, ...]]  # the ranks whose stage uses each parameter (rank 0 for one no stage uses)
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    trainable: list[bool]
    grad_upto: list[bool]  # per stage: its output depends on a trainable parameter (of it or an earlier stage)
    index: dict[str, int] = field(default_factory=dict)

    def primary(self, i: int) -> int:
        """The rank that speaks for parameter i (a tied matrix: the first stage)."""
        return self.owners[i][0]


@dataclass
class _Step:
    """What the loss function needs about the step the schedule is running."""

    batch: Batch  # every row of the step, at the step's width
    per_token: set[str]  # the batch's keys with a sequence dimension (cropped to a micro-batch's width)
    how: StepPass
    sums: list[torch.Tensor] = field(default_factory=list)  # each micro-batch's loss sum (last stage)


class Pipeline(PipelineCheckpoints, DDP):
    name = "pipeline"
    stage_parts = True  # each rank reads only its stage: a node without the model receives only that part
    balances = False  # every rank runs every row: there are no rows to move to a faster rank
    distill_students = False  # its stages need the same rows; a distill student takes its own slice
    Settings = PipelineSettings

    def __init__(self, context: RankContext | None = None, **config: Any):
        self.settings = PipelineSettings(**config)
        super().__init__(context)
        self.config = self.settings.model_dump()
        self.layout: _Layout | None = None
        self.runner: StageStep | None = None
        self.full = False  # full fine-tuning: the final weights are the whole model (streamed to a file)
        self.ties: list[tuple[int, dist.ProcessGroup]] = []  # trainable parameters held by several stages
        self.global_ids: dict[int, int] = {}  # id(parameter) -> its integer id in a whole-model optimizer
        self.global_groups: list[list[int]] = []
        self._schedule = None
        self._schedule_key: tuple | None = None
        self._step: _Step | None = None
        self.planned: list[int] | None = None  # the bounds `load_model` cut at
        self.shapes: dict[int, torch.Size] = {}  # id(parameter) -> its shape, for those loaded without storage
        self.read: dict[str, int] | None = None  # what `load_model` read from the checkpoint
        self.run: TrainConfig | None = None  # the run's config `load_model` was given (its stages' activations)

    # -- cutting ------------------------------------------------------------------------------------

    def load_model(self, name: str, *, device: torch.device, dtype: str | None, training: bool = True,
                   run: TrainConfig | None = None) -> nn.Module:
        """The whole model with storage for this rank's stage only, read by key (see the module doc)."""
        from smolforge.models.stage_load import materialize, part_tensors, skeleton

        self._use(device)
        self.run = run
        net, merged, torch_dtype = skeleton(name, device=device, dtype=dtype or "fp32", training=training)
        import peft  # noqa: F401  (~25 MB the rank holds from its first step: in what it measures, not after)

        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.planned = self._bounds(net)  # measuring draws random matrices: PEFT's seeded init must not see it
        stages = cut(net, self.planned)
        staged = {id(p) for stage in stages for p in stage.parameters()}
        keep = {id(p) for p in stages[self.rank].parameters()}
        if self.rank == 0:  # a parameter no stage uses is rank 0's (`_layout`)
            keep |= {id(p) for p in net.parameters() if id(p) not in staged}
        self.shapes = {id(p): p.shape for p in net.parameters()}
        if self.model_part is not None:  # this node lacks the model: its stage's part is brought now
            merged = part_tensors(self.model_part(list(self.planned), self.rank))
        self.read = materialize(net, keep, merged, device, torch_dtype)
        return net.eval()  # as from_pretrained returns it

    def _use(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def prepare(self, model: nn.Module, device: torch.device) -> None:
        if self.layout is not None:
            return
        self._use(device)
        kind = peft_method(model_method(model))
        if not kind.pipeline_trains:
            raise kind.refusal("pipeline", where="--strategy pipeline")
        self.full = kind.full_model
        base = base_transformer(model)
        stages = cut(base, self.planned or self._bounds(base))
        self.layout = _layout(model, stages, self.shapes)
        stage = stages[self.rank]
        self.hidden_size = arch_of(base.config).hidden_size
        self.hidden_dtype = base.get_input_embeddings().weight.dtype
        head = base.get_output_embeddings().weight
        self.vocab = next(shape for p, shape in zip(self.layout.params, self.layout.shapes) if p is head)[0]
        self.runner = StageStep(stage, self.hidden_dtype)
        self._free_other_stages()
        self.ties = self._tie_groups()

    def _bounds(self, base: nn.Module) -> list[int]:
        """The settings' bounds, or the ranges `plan_in_order` sizes from every rank's measured node."""
        layers = arch_of(base.config).num_layers
        if self.settings.bounds is None:
            nodes = self._measure_nodes()
            info = model_info(base)
            weights = next(base.parameters()).dtype
            plan = plan_in_order(info, nodes, workload=self._workload(base.config, info, weights))
            if self.rank == 0:
                self.notes.append({"event": "pipeline_plan", "message": plan.describe(), "bounds": plan.bounds,
                                   "nodes": plan.nodes, "throughput_share": plan.throughput_share})
            return plan.bounds
        bounds = list(self.settings.bounds)
        check_bounds(bounds, layers)
        if len(bounds) - 1 != self.world:
            raise SmolforgeError(f"strategy_config.bounds {bounds} cut {len(bounds) - 1} stages, but the group "
                                 f"has {self.world} ranks (one stage per rank)",
                                 fix=f"give {self.world + 1} bounds, or leave them out to have them planned")
        return bounds

    def _workload(self, config, info, weights: torch.dtype) -> Workload:
        """A training stage's memory: weights x 1.2, plus its micro-batches' activations when the run's
        config is known (`load_model`'s `run`, from the engine): `models.stage_memory`. Autocast copies
        a weight only when its dtype differs (a bf16 model under bf16 autocast keeps no copies)."""
        cfg = self.run
        if cfg is None:
            return Workload(training=True)
        rows = cfg.batch_size * cfg.grad_accum * self.world  # a step's rows (`rows_for`: every rank all of them)
        micro = self.settings.microbatches or cfg.grad_accum * self.world
        shape = TrainShape(rows=max(1, rows // micro), length=cfg.data.max_length, microbatches=micro,
                           schedule=self.settings.schedule, method=cfg.peft.method, dropout=cfg.peft.dropout,
                           rank=cfg.peft.r, checkpointing=cfg.gradient_checkpointing,
                           autocast_bytes=_element_bytes(_cast_to(autocast_dtype(cfg.precision, self.device), weights)))
        return training_workload(config, info.dtype_bytes, shape, layer_bytes=max(info.layer_bytes, default=0))

    def _measure_nodes(self) -> list[NodeCapacity]:
        """Every rank's node (FLOP/s with its threads, free memory), in rank order, exchanged as tensors
        (names as fixed-width bytes: nothing pickled crosses the network). One rank: itself."""
        name = os.environ.get("SMOLFORGE_NODE_NAME", "")  # set on a cluster's nodes
        mine = measure_node(name or f"rank {self.rank}", self.device if self.device.type == "cuda" else None)
        if not (dist.is_available() and dist.is_initialized()) or self.world == 1:
            return [mine]
        dev = self.device_for(self.device)
        raw = name.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
        row = torch.tensor([mine.throughput, float(mine.free_memory_bytes), *raw], dtype=torch.float64, device=dev)
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row)
        nodes = []
        for rank, r in enumerate(rows):
            r = r.cpu()
            label = bytes(int(v) for v in r[2:]).rstrip(b"\0").decode(errors="replace")
            nodes.append(NodeCapacity(f"{label} (rank {rank})" if label else f"rank {rank}",
                                      throughput=float(r[0]), free_memory_bytes=int(r[1])))
        return nodes

    def _holds(self, i: int) -> bool:
        return self.rank in self.layout.owners[i]

    def _free_other_stages(self) -> None:
        """Drop the storage of parameters only other stages use (the Parameter objects stay)."""
        for i in range(len(self.layout.params)):
            if not self._holds(i):
                self._free(i)

    def _free(self, i: int) -> None:
        """Parameter i without storage: all its dimensions 0, their number kept (`make_optimizer` puts
        matrices and vectors in different weight-decay groups by it)."""
        p = self.layout.params[i]
        p.data = torch.empty((0,) * p.ndim, dtype=p.dtype, device=self.device)

    def _tie_groups(self) -> list[tuple[int, dist.ProcessGroup]]:
        """A subgroup for each set of stages sharing a trainable parameter; every rank takes part in making it."""
        lay, groups, mine = self.layout, {}, []
        for i, owners in enumerate(lay.owners):
            if len(owners) > 1 and lay.trainable[i]:
                if owners not in groups:
                    groups[owners] = dist.new_group(list(owners))
                if self._holds(i):
                    mine.append((i, groups[owners]))
        return mine

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        if self.layout is None:
            raise RuntimeError("pipeline cuts the model before its optimizer is made (smolforge.train.loop."
                               "make_optimizer calls Strategy.prepare)")
        self.device = device
        return model

    def make_optimizer(self, groups: list[dict[str, Any]], optimizer_class: type[torch.optim.Optimizer],
                       **defaults: Any) -> torch.optim.Optimizer:
        """Over this stage's parameters only; the whole model's integer ids are kept for checkpoints."""
        every = [p for group in groups for p in group["params"]]
        self.global_ids = {id(p): i for i, p in enumerate(every)}
        self.global_groups = [[self.global_ids[id(p)] for p in group["params"]] for group in groups]
        index = {id(p): i for i, p in enumerate(self.layout.params)}
        mine = [{**group, "params": [p for p in group["params"] if self._holds(index[id(p)])]} for group in groups]
        return optimizer_class(mine, **defaults)

    # -- the step -----------------------------------------------------------------------------------

    def accumulate(self, wrapped: nn.Module, last: bool) -> ContextManager:
        return nullcontext()

    def rows_for(self, step: int, total: int) -> tuple[int, int]:
        return 0, total  # every stage sees every row (see the module docstring)

    def observe(self, rows: int, started: float, ended: float, targets: float = 0.0) -> None:
        """Nothing to balance: every rank runs every row."""

    @property
    def rows(self) -> list[int] | None:
        return None

    def step_reduce(self, values: list[float], device: torch.device) -> list[float]:
        return list(values)  # every rank has every row: its sums are the step's

    @property
    def step_ranks(self) -> int:
        return 1  # nothing averages gradients over ranks: the loss scale is the loop's for one process

    def forward_backward(self, wrapped: nn.Module, micro: list[Batch], how: StepPass) -> tuple[float, int]:
        """The step's micro-batches through the pipeline; returns (the step's loss sum, this rank's share of
        its tokens: summed over the ranks, the step's, so throughput counts each token once).

        `how.forward` is not called: the stages are the model's forward (the plain one, logits aligned with
        the input ids); `how.loss_sum` and `how.scale` are the loop's, on the last stage."""
        if how.scaler is not None:
            raise SmolforgeError("the pipeline strategy does not train in fp16 with loss scaling",
                                 fix="use --precision bf16 or fp32 with --strategy pipeline")
        batch, per_token = concat_micro_batches([{k: v.to(how.device, non_blocking=True) for k, v in m.items()} for m in micro])
        rows, width = batch["input_ids"].shape
        n = self.settings.microbatches or len(micro)
        if rows % n:
            raise SmolforgeError(f"strategy_config.microbatches={n} does not divide the step's {rows} rows",
                                 fix="choose a divisor of batch_size x grad_accum x stages, or leave it unset")
        schedule = self._schedule_for(rows // n, width, n, how.amp)
        self._step = _Step(batch, per_token, how)
        first, last = self.rank == 0, self.rank == self.world - 1
        try:
            with how.autocast():
                schedule.step(*((batch["input_ids"],) if first else ()),
                              target=torch.arange(rows, device=how.device) if last else None,
                              return_outputs=False, attention_mask=batch["attention_mask"])
            loss_total = self._step_loss()
        finally:
            self._step = None
        self._count_sends(rows, width)
        self._sum_tied_grads()
        tokens = int(batch["attention_mask"].sum())
        return loss_total, tokens * (self.rank + 1) // self.world - tokens * self.rank // self.world

    def _schedule_for(self, rows: int, width: int, n: int, amp: torch.dtype | None):
        """The schedule for micro-batches of `rows` x `width` (rebuilt when the step's width changes)."""
        key = (rows, width, n, amp)
        if key != self._schedule_key:
            if self.settings.schedule == "1f1b" and n < self.world:
                raise SmolforgeError(f"1f1b needs at least one micro-batch per stage ({n} for {self.world} stages)",
                                     fix="raise strategy_config.microbatches or grad_accum, or use schedule=gpipe")
            inputs, outputs = self._examples(rows, width, amp)
            stage = PipelineStage(self.runner, self.rank, self.world, self.device, input_args=inputs,
                                  output_args=outputs)
            self._schedule = SCHEDULES[self.settings.schedule](stage, n, loss_fn=self._loss, scale_grads=False)
            self._schedule_key = key
        return self._schedule

    def _examples(self, rows: int, width: int, amp: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """What crosses this stage's cuts, on the meta device (shapes, dtypes, whether gradients come back)."""
        meta, lay = torch.device("meta"), self.layout

        def hidden(grad: bool) -> torch.Tensor:
            shape = (rows, width, self.hidden_size)
            return torch.empty(shape, dtype=self.hidden_dtype, device=meta).requires_grad_(grad)

        first, last = self.rank == 0, self.rank == self.world - 1
        inputs = (torch.empty(rows, width, dtype=torch.long, device=meta) if first
                  else hidden(lay.grad_upto[self.rank - 1]))
        if last:  # logits go to the loss, not over a cut: their shape is never checked against a buffer
            return inputs, torch.empty(rows, width, self.vocab, dtype=amp or self.hidden_dtype, device=meta)
        return inputs, hidden(lay.grad_upto[self.rank])

    def _loss(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's loss for one micro-batch (`rows`: its row numbers): the loop's loss, scaled as the
        loop scales it, on the micro-batch's rows at its own width, in fp32."""
        step = self._step
        lo = int(rows[0])
        part = {k: v[lo:lo + rows.numel(), :logits.shape[1]] if k in step.per_token else v[lo:lo + rows.numel()]
                for k, v in step.batch.items()}
        with torch.autocast(step.how.device.type, enabled=False):
            loss_sum = step.how.loss_sum(logits, part)
        step.sums.append(loss_sum.detach())
        return loss_sum * step.how.scale

    def _step_loss(self) -> float:
        """The step's loss sum, added up micro-batch by micro-batch as the loop adds it, from the last rank."""
        total = 0.0
        for s in self._step.sums:
            total += float(s)
        t = torch.tensor([total], dtype=torch.float64, device=self.device)
        if self.rank == self.world - 1:
            self._count(t)
        dist.broadcast(t, src=self.world - 1)
        return float(t.item())

    def _count_sends(self, rows: int, width: int) -> None:
        """Bytes the schedule sent: hidden states to the next stage, their gradients to the previous one."""
        n = self._schedule_key[2]
        one = rows * width * self.hidden_size * torch.empty((), dtype=self.hidden_dtype).element_size()
        forward = self.rank < self.world - 1
        backward = self.rank > 0 and self.layout.grad_upto[self.rank - 1]
        self.bytes_sent += n * one * (int(forward) + int(backward))

    def _sum_tied_grads(self) -> None:
        """A matrix two stages hold (tied embeddings) gets the sum of both stages' gradients on both."""
        for i, group in self.ties:
            p = self.layout.params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._count(p.grad)
            with self.waiting():
                dist.all_reduce(p.grad, group=group)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float | None) -> float:
        """The global norm as one process computes it: from every trainable parameter's own norm (or sum of
        squares), in the model's parameter order, each from the rank that speaks for it."""
        lay = self.layout
        index = {id(p): i for i, p in enumerate(lay.params)}
        parts = torch.zeros(len(lay.params), dtype=torch.float32, device=self.device)
        for p in params:
            i = index[id(p)]
            if lay.primary(i) == self.rank:
                g = p.grad.detach()
                parts[i] = torch.linalg.vector_norm(g, 2.0) if max_norm else (g.float() ** 2).sum()
        self._count(parts)
        with self.waiting():
            dist.all_reduce(parts)  # each entry is non-zero on one rank only: the sum is exact
        trained = [parts[i] for i in range(len(lay.params)) if lay.trainable[i]]
        if not trained:
            return 0.0
        if not max_norm:
            return float(torch.sqrt(sum(trained)))
        total = torch.linalg.vector_norm(torch.stack(trained), 2.0)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    # -- evaluation ---------------------------------------------------------------------------------

    def whole_model(self, model: nn.Module) -> ContextManager:
        """Nothing here needs whole weights: evaluation runs through the stages, saving uses `model_state`."""
        return nullcontext()

    def eval_sums(self, model: nn.Module, rows: list, examples: list, tokenizer: Any, *, batch_size: int,
                  max_new_tokens: int, device: torch.device) -> list[float]:
        """(loss sum, tokens, correct, answered) over every eval row and example, through the stages (forward
        only), computed on the last stage and the same on every rank (see `pipeline_eval`)."""
        from smolforge.parallel.strategies.pipeline_eval import StageEval

        runner = StageEval(self.runner.stage, self.rank, self.world, self.device, self.hidden_size,
                           self.hidden_dtype, count=self._count)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self.waiting():
                loss_sum, count = runner.loss_sums(rows, tokenizer.pad_token_id, batch_size)
                correct, total = runner.exact_match(tokenizer, examples, max_new_tokens, 64) if examples else (0, 0)
        finally:
            model.train(was_training)
        return runner.shared([loss_sum, count, correct, total])

    def metrics(self) -> dict[str, float]:
        stage = self.runner.stage if self.runner else None
        out = {"stage_layers": float(len(stage.layer_ids))} if stage is not None else {}
        if self.read is not None:
            out["stage_read_bytes"] = float(self.read["bytes"])
        return out


def _cast_to(autocast: torch.dtype | None, weights: torch.dtype) -> torch.dtype | None:
    """The dtype autocast copies the weights into, or None when it copies nothing (no autocast, or
    weights already in its dtype)."""
    return None if autocast is None or autocast == weights else autocast


def _element_bytes(dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 0


def _layout(model: nn.Module, stages: list[Stage], shapes: dict[int, torch.Size]) -> _Layout:
    """`shapes`: the true shapes of the parameters `load_model` left without storage."""
    named = list(model.named_parameters())
    index = {id(p): i for i, (_, p) in enumerate(named)}
    owners: list[set[int]] = [set() for _ in named]
    for rank, stage in enumerate(stages):
        for p in stage.parameters():
            owners[index[id(p)]].add(rank)
    trainable = [p.requires_grad for _, p in named]
    grad_upto, seen = [], False
    for rank in range(len(stages)):
        seen = seen or any(trainable[i] and rank in owners[i] for i in range(len(named)))
        grad_upto.append(seen)
    return _Layout(names=[n for n, _ in named], params=[p for _, p in named],
                   owners=[tuple(sorted(o)) or (0,) for o in owners],
                   shapes=[shapes.get(id(p), p.shape) for _, p in named],
                   dtypes=[p.dtype for _, p in named], trainable=trainable, grad_upto=grad_upto,
                   index={n: i for i, (n, _) in enumerate(named)})
