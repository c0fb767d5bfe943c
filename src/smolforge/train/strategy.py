"""The strategy interface: how a training loop shares learning with other processes.

The training loop (`smolforge.train.engine`) never imports torch.distributed. Everything a loop
needs from its peers goes through a `Strategy`:

- `wrap(model)`: the module to run forward/backward on (DDP wraps it; one process returns it as is)
- `prepare(model)`: before the optimizer is made (FSDP shards the parameters here)
- `make_optimizer(groups, cls, **defaults)`: the optimizer over the trainable groups (ZeRO shards it)
- `whole_model(model)`: a context in which every rank holds the whole weights (evaluation, generation)
- `load_model(name, run=)`: the model this rank trains, before PEFT (a pipeline rank reads its stage only,
  from its stage's part of the model when its node lacks the whole: the context's `model_part`; it sizes
  its stages' activations from the run's config, `run`);
  `eval_sums(...)`: evaluation the strategy runs itself (a pipeline: through its stages), else None
- `model_state(model)` / `load_model_state(model, weights)`: the trainable weights, whole, for a
  checkpoint or the final adapter, and back from a per-key reader (FSDP gathers shards, and reads back
  only its own; others read the model); `load_optimizer_file`: a streamed optimizer state, likewise
- `optimizer_state(optimizer)`: its whole state for a checkpoint, on the main rank (collective)
- `spool_dir=` (of those two): where they may stream state too big to hold in memory (a safetensors file
  whose path they return instead of a dict; FSDP does); the driver passes its output directory
- `accumulate(last)`: the context for one micro-batch's backward (skip gradient sync unless last)
- `forward_backward(wrapped, micro, how)`: forward and backward over a step's micro-batches (one after
  another here, each under `accumulate`; a pipeline runs them through its stages on a schedule)
- `reduce(values)`: sum numbers over every rank (eval sums, anything global)
- `step_reduce(values)` / `step_ranks`: sums over, and the number of, the ranks that average this
  optimizer step's gradients (every rank for DDP; only itself for DiLoCo's local inner steps)
- `step_targets(step, mine, counted=)` / `step_loss(loss_sum, targets, step_targets)`: the step's loss tokens
  (every rank's rows; `counted`: the data's own count of them, when it knows it), and the step's mean token
  loss as the loop logs it
- `at_boundary(step)`: may the loop checkpoint or pause after this step (DiLoCo: at outer steps)
- `start_at(step)`: where this process starts (a member joining a running elastic group: the others' step)
- `finish(model, optimizer)`: the loop ended: bring every rank to the shared weights
- `agree(code)`: every rank leaves the loop on the same step (the largest stop code wins)
- `shard(items)`: this rank's slice of a list (eval examples)
- `rows_for(step, total)` / `observe(rows, started, ended)`: this rank's slice of a step's global
  batch, and what the step cost it (synchronous strategies give a faster rank more rows: `balance`)
- `own_loss(step, loss_sum, targets)` / `last_loss`: this rank's part of the step's loss, for the job's
  `final_loss` (a parameter server's worker keeps only the parts the server applied)
- `after_step(step, model, optimizer, targets=)`: hook for strategies with an outer step (DiLoCo,
  parameter servers); `targets`: this rank's loss tokens in the step
- `gather_rng()` / `rng_for_rank(states)`: every rank's RNG state in a checkpoint, each rank its own
  back on resume (LoRA dropout differs per rank)
- `state_dict()` / `load_state_dict()`: the strategy's own state in checkpoints
- `next_step(done, steps)`: the step this rank takes next (None: none left); a parameter server hands
  steps out, so a fast rank takes more of them (may raise `StopRequested` when another rank stopped)
- `clip_grad_norm(params, max_norm)`: the step's gradient norm, clipped (a parameter server clips the
  sum of the ranks' gradients on the server instead)
- `checkpoint_step(step)` / `progress(step)`: the step a checkpoint taken now resumes from, and the
  job's steps done once the loop ends (a parameter server's version, not this rank's last step)
- `metrics()`: the strategy's own numbers for the job summary (staleness, waits, dropped gradients)
- `barrier()`, `bytes_sent`, `rank`, `world`, `is_main`

A strategy is made from its settings (`strategy_config`) and a `RankContext` (`train.rank_context`:
world, member, the parameter server, the membership service, balance, where a stage's part comes from),
and nothing sets its attributes afterwards.

This class is the single-process strategy: rank 0 of 1, every method the identity. The others live
in `smolforge.parallel.strategies`, one file each, picked by name from its registry.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager

import torch
from pydantic import BaseModel

from smolforge.train.rank_context import ALONE, RankContext
from smolforge.train.step_loss import NONE, StepLoss

if TYPE_CHECKING:
    from smolforge.config import TrainConfig
    from smolforge.train.tensor_reader import TensorReader

Batch = dict[str, torch.Tensor]


def target_tokens(batch: Batch) -> int:
    """Tokens that carry a loss: the shifted labels that are not -100."""
    return int((batch["labels"][:, 1:] != -100).sum())


def mask_tokens(batch: Batch) -> int:
    """Tokens a batch holds (its attention mask): what throughput counts."""
    return int(batch["attention_mask"].sum())


def batch_rows(batch: Batch) -> int:
    """Rows (sequences, samples) in a batch: the first dimension of its labels."""
    return int(batch["labels"].shape[0])


@dataclass(frozen=True)
class BatchLayout:
    """What a batch's loss is normalised by: the one answer to "which units of a batch carry a loss".

    A language model's batch is token ids with shifted labels (`TOKENS`); another model kind (a classifier:
    one label per row, `models.kinds`) gives its own functions. The loop and the strategies ask only this.
    """

    targets: Callable[[Batch], int] = target_tokens  # loss-carrying units: the divisor of the summed loss
    units: Callable[[Batch], int] = mask_tokens  # units of work, for throughput (tokens; a classifier: rows)
    rows: Callable[[Batch], int] = batch_rows  # rows, for balancing ranks by speed


TOKENS = BatchLayout()
"""A causal language model's batches: input_ids, attention_mask, labels (shifted in the loss)."""


@dataclass
class StepPass:
    """How the loop turns one step's micro-batches into gradients, handed to `Strategy.forward_backward`.

    The pieces rather than one closure: a strategy that does not run the whole model in this process
    (a pipeline stage) still needs the loss, its normalisation and the precision the loop would use.
    """

    forward: Callable[[torch.nn.Module, Batch], torch.Tensor]  # (module, batch) -> logits, under autocast
    loss_sum: Callable[[torch.Tensor, Batch], torch.Tensor]  # (logits, batch) -> summed token loss, fp32
    scale: float  # backward differentiates loss_sum * scale (the step's token normalisation)
    device: torch.device
    amp: torch.dtype | None = None  # autocast dtype (None: full precision)
    scaler: Any = None  # torch.amp.GradScaler for fp16 on CUDA, else None
    layout: BatchLayout = TOKENS  # what a batch's units are (throughput counts `layout.units`)

    def autocast(self) -> ContextManager:
        return torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()


class Strategy:
    name = "single"
    Settings: ClassVar[type[BaseModel] | None] = None  # the pydantic model of `strategy_config`, if any
    # Capabilities: what the job runner, the worker glue and the CLI ask of a strategy's class, before any
    # instance exists. A subclass sets the ones that differ; every strategy answers every question.
    needs_server: ClassVar[bool] = False  # the runner starts a parameter server for the job's round
    uses_process_group: ClassVar[bool] = True  # the ranks form a torch.distributed group (not a server's clients)
    elastic: ClassVar[bool] = False  # members may leave (a rank dies) or join a running group without a restart
    # the students of one distill base may train as one group under it (`distill --students-sync ddp`): each
    # rank takes its own slice of every step's rows from the shards, and no parameter server runs
    distill_students: ClassVar[bool] = False
    # each rank reads only its own stage's tensors (`load_model`): a node that lacks the job's model receives
    # the config and tokenizer before the ranks start, and each rank its stage's part once it has planned
    # the cut (`RankContext.model_part`, which the rank glue gives), never the whole model
    stage_parts: ClassVar[bool] = False

    @classmethod
    def check_settings(cls, config: dict[str, Any]) -> None:
        """Raise ValueError (pydantic's) for settings this strategy does not take; at submit time."""
        if cls.Settings is not None:
            cls.Settings(**config)
        elif config:
            raise ValueError(f"the {cls.name} strategy takes no settings (got {', '.join(map(str, config))})")

    @classmethod
    def settings_dict(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The settings as `check_settings` accepts them, every default filled in: what a `RankPlan` carries
        to the ranks and the parameter server. Raises as `check_settings` does."""
        if cls.Settings is None:
            cls.check_settings(config)
            return {}
        return cls.Settings(**config).model_dump()

    def __init__(self, context: RankContext | None = None, **config: Any):
        """`context`: this rank's facts (default: rank 0 of 1, `rank_context.ALONE`); `config`: the strategy's
        settings (`strategy_config`, checked at submit by `check_settings`)."""
        self.context = context or ALONE
        self.config = dict(config)
        self.bytes_sent = 0  # handed to collectives while training
        self.checkpoint_bytes_sent = 0  # handed to collectives to gather checkpoints
        self.checkpoint_bytes_read = 0  # read from a checkpoint on resume (a sharded strategy: its shards)
        self.rounds: int | None = None  # outer steps taken, for strategies that have them (DiLoCo)
        self.comm_wait_s = 0.0  # time spent waiting in collectives (for peers, for the network)
        # "auto": rows per rank in proportion to measured speed (synchronous strategies); from the context
        self.balance = self.context.balance
        self.notes: list[dict[str, Any]] = []  # what the strategy decided (a rebalance), for the job's events
        self.last_loss: StepLoss | None = None  # this rank's part of the latest step it counted in (`own_loss`)
        # where this node lacks the job's model and the strategy reads stage parts (the context's):
        # (bounds, stage index) -> a local model directory holding that stage's tensors, brought there now
        self.model_part: Callable[[list[int], int], str] | None = self.context.model_part

    # -- who we are ---------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return 0

    @property
    def world(self) -> int:
        return 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device_for(self, device: torch.device) -> torch.device:
        """The device this rank trains on (a GPU rank uses its local GPU)."""
        return device

    # -- the step -----------------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        return model

    def accumulate(self, wrapped: torch.nn.Module, last: bool) -> ContextManager:
        return nullcontext()

    def forward_backward(self, wrapped: torch.nn.Module, micro: list[Batch], how: StepPass) -> tuple[float, int]:
        """Forward and backward over this rank's micro-batches of a step, gradients accumulating in the
        parameters; returns (the summed loss of the step's rows, this rank's tokens for throughput).

        Here each micro-batch in turn runs through the whole model under `accumulate` (DDP and FSDP sync
        on the last one). A pipeline overrides it: its ranks each run one stage of every micro-batch."""
        loss_total, tokens = 0.0, 0
        for j, m in enumerate(micro):
            m = {k: v.to(how.device, non_blocking=True) for k, v in m.items()}
            with self.accumulate(wrapped, last=j == len(micro) - 1):
                with how.autocast():
                    logits = how.forward(wrapped, m)
                loss_sum = how.loss_sum(logits, m)
                del logits  # autograd does not need it: freed before the backward, not after
                how.backward(loss_sum * how.scale)
            loss_total += float(loss_sum.detach())
            tokens += how.layout.units(m)
        return loss_total, tokens

    def load_model(self, name: str, *, device: torch.device, dtype: str | None, training: bool = True,
                   run: TrainConfig | None = None):
        """The model this rank trains, before PEFT: the whole model here (a pipeline rank reads its stage only,
        and sizes its stages' activations from the run's config, `run`, when given)."""
        from smolforge.models.loading import load_model

        return load_model(name, device=device, dtype=dtype, training=training)

    def prepare(self, model: torch.nn.Module, device: torch.device) -> None:
        """Before the optimizer sees the parameters (`loop.make_optimizer`): FSDP replaces them with shards."""

    def whole_model(self, model: torch.nn.Module) -> ContextManager:
        """Inside, every rank holds the whole weights and may run the model alone (evaluation, generation:
        ranks make different numbers of forwards). Every rank enters (FSDP gathers its shards)."""
        return nullcontext()

    def eval_sums(self, model: torch.nn.Module, rows: list, examples: list, tokenizer: Any, *, batch_size: int,
                  max_new_tokens: int, device: torch.device) -> list[float] | None:
        """(loss sum, tokens, correct, answered) over every rank's eval rows and examples, when the strategy
        computes them itself (a pipeline: through its stages); None: the loop does, on `whole_model`."""
        return None

    def make_optimizer(self, groups: list[dict[str, Any]], optimizer_class: type[torch.optim.Optimizer],
                       **defaults: Any) -> torch.optim.Optimizer:
        return optimizer_class(groups, **defaults)

    def optimizer_state(self, optimizer: torch.optim.Optimizer,
                        spool_dir: Path | None = None) -> dict[str, Any] | Path | None:
        """The optimizer's whole state for a checkpoint: every rank calls it, the main rank gets it
        (or the path of the safetensors file it was streamed into under `spool_dir`, the run's output
        directory; the system's temp dir without one: `checkpoint.read_optimizer_file`).

        A checkpoint holds the whole state whatever the strategy, so that it resumes under any other
        strategy or world size (a sharded optimizer loads the whole state and keeps its own part)."""
        return optimizer.state_dict()

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                   targets: float = 0.0) -> None:
        """Called after every optimizer step (DiLoCo's outer step, a parameter server's push)."""

    def own_loss(self, step: int, loss_sum: float, targets: float) -> None:
        """This rank's rows of global step `step` are done: their summed token loss and loss tokens, kept as
        `last_loss`, from which the job's `final_loss` is merged (`smolforge.train.step_loss`). A parameter
        server's worker keeps a part only once the server says it applied it."""
        self.last_loss = (self.last_loss or NONE).then(step, loss_sum, targets)

    def start_at(self, step: int) -> int:
        """The step this process starts at: `step` (from its checkpoint), or for a member joining a
        running elastic group (DiLoCo) the step the others are at when they take it in."""
        return step

    def at_boundary(self, step: int) -> bool:
        """Whether the state after `step` is one every rank shares (a checkpoint or a pause may land)."""
        return True

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The last step is done: every rank ends with the shared weights (DiLoCo's last outer step)."""

    # -- agreeing -----------------------------------------------------------------------------------

    def reduce(self, values: list[float], device: torch.device) -> list[float]:
        return list(values)

    def step_targets(self, step: int, mine: float, device: torch.device,
                     counted: Callable[[int], float] | None = None) -> float:
        """The loss tokens of the whole step (every rank's rows), which normalise its loss: summed over the
        ranks here. `counted`: step -> those tokens as the data counts them (every rank's rows; the engine's
        `SampleSource.step_tokens`), or None where the data cannot say (a rank that computes its part alone,
        a parameter server's worker, reads it from there and still normalises as DDP does)."""
        return self.step_reduce([mine], device)[0]

    def step_reduce(self, values: list[float], device: torch.device) -> list[float]:
        """Sums over the ranks that average this step's gradients (the loss normalisation)."""
        return self.reduce(values, device)

    def step_loss(self, loss_sum: float, targets: float, step_targets: float, device: torch.device) -> float:
        """The step's mean token loss as this rank logs it, from its summed loss and loss tokens (`targets`) and
        the step's loss tokens (`step_targets`, from `step_targets`: already summed, so only the loss is
        reduced). A rank that computes its part alone (a parameter server's worker) overrides it: its rows' mean."""
        return self.step_reduce([loss_sum], device)[0] / max(1.0, step_targets)

    @property
    def step_ranks(self) -> int:
        """How many ranks average each step's gradients (DDP divides by it; the loss scale undoes that)."""
        return self.world

    def agree(self, code: int, device: torch.device) -> int:
        return code

    def shard(self, items: list) -> list:
        return items[self.rank::self.world]

    def rows_for(self, step: int, total: int) -> tuple[int, int]:
        """(first row, row count) of this rank's slice of the step's `total` rows (equal slices here)."""
        per = total // self.world
        return self.rank * per, per

    def observe(self, rows: int, started: float, ended: float, targets: float = 0.0) -> None:
        """A step's rows took this rank from `started` to `ended` (perf_counter) of forward and backward;
        `targets`: its loss tokens."""

    def next_step(self, done: int, steps: int) -> int | None:
        """The step this rank takes after `done` steps (None: the loop ends): the next one in order."""
        return done if done < steps else None

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float | None) -> float:
        """The global gradient norm of this step, clipped to `max_norm` when set."""
        if max_norm:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return float(torch.sqrt(sum((p.grad.detach().float() ** 2).sum() for p in params))) if params else 0.0

    def checkpoint_step(self, step: int) -> int:
        """The step a checkpoint taken after this rank's `step` resumes from (every rank calls it)."""
        return step

    def progress(self, step: int) -> int:
        """The job's steps done when this rank's loop ended at `step`."""
        return step

    def metrics(self) -> dict[str, float]:
        """This rank's strategy-specific numbers (name -> value) for the job summary and metrics."""
        return {}

    @property
    def rows(self) -> list[int] | None:
        """Rows per rank of the latest step when they are not equal slices (None: equal)."""
        return None

    def barrier(self) -> None:
        """Every rank reaches this point before any goes on."""

    # -- checkpoints --------------------------------------------------------------------------------

    def gather_rng(self) -> list[torch.Tensor] | None:
        """Every rank's CPU RNG state, rank order, on the main rank (None elsewhere)."""
        return [torch.get_rng_state()]

    def rng_for_rank(self, states: list[torch.Tensor]) -> torch.Tensor | None:
        """This rank's state among those a checkpoint kept; None when they came from another world size."""
        return states[self.rank] if len(states) == self.world else None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def model_state(self, model: torch.nn.Module,
                    spool_dir: Path | None = None) -> dict[str, torch.Tensor] | Path | None:
        """The trainable weights, whole, by parameter name, for a checkpoint or the final adapter, when the
        model cannot give them itself (FSDP holds shards): every rank calls it, the main rank gets them
        (or the path of a safetensors file they were streamed into under `spool_dir`, the run's output
        directory). None: read them from the model."""
        return None

    def load_model_state(self, model: torch.nn.Module, weights: TensorReader) -> None:
        """Put a checkpoint's trainable weights into the model, one tensor at a time (FSDP reads only its
        shards, a pipeline rank only its stage's tensors)."""
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in weights.keys():
                params[name].copy_(weights.get(name).to(params[name].device, params[name].dtype))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Restore what `optimizer_state` saved (strategies whose ranks differ keep one part per rank). A
        checkpoint of such a strategy (diloco's `per_rank`) resumes here with rank 0's part on every rank:
        `--strategy auto` decides again at a regroup and may move from diloco to a replicated strategy,
        whose ranks must start equal."""
        if "per_rank" in state:
            state = state["per_rank"][0]
        optimizer.load_state_dict(state)

    def load_optimizer_file(self, optimizer: torch.optim.Optimizer, tensors: TensorReader) -> None:
        """Restore a streamed optimizer state (`optim_state.safetensors`); a sharded strategy reads only
        its shards of it, the others read it whole."""
        self.load_optimizer_state(optimizer, tensors.optimizer_state())

    def count_checkpoint_read(self, nbytes: int) -> None:
        """`nbytes` more were read from a checkpoint on resume (`checkpoint_bytes_read`; a sharded strategy: its
        shards only)."""
        self.checkpoint_bytes_read += nbytes

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Strategies with state of their own (an outer optimizer, a staleness clock) restore it."""


SingleProcess = Strategy
