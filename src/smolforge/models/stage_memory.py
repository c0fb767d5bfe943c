"""What a stage must hold (`Workload`, which `models.stage_costs` sizes stages with), and for a pipeline
training stage what it holds besides its weights: the activations its micro-batches keep
alive for the backward, sized from the model's config and the run's batch, so the stage planner
(`models.stage_costs`) keeps every training rank under its node's memory (issue 31).

Where the numbers come from: autograd's saved tensors, counted. A Llama block run forward with
`torch.autograd.graph.saved_tensors_hooks` summing every saved tensor's storage (each once, the
parameters left out), at two hidden sizes, two intermediate sizes and two sequence lengths, gives per
token and per layer, in elements of the compute dtype (hidden h, intermediate i):

- full fine-tuning: 10 h + 4 i (norm inputs, q/k/v, rotary outputs, attention output, the MLP's
  gate, up, SiLU and product), plus one per head (SDPA's log-sum-exp) and 2 (the norms' variances);
- LoRA without dropout, IA3: 8 h + 4 i (frozen weights need no copy of a linear's input for a
  weight gradient; the adapters' small outputs add 7 x rank for LoRA); an adapter: 8 h + 3 i;
- LoRA's dropout (on by default, 0.05): 10 h + i more (each adapted linear's dropped input and mask).

Nothing scales with the sequence squared (SDPA keeps no attention matrix). Under autocast (bf16 on an
fp32 model) every linear's weight is cast for each forward, and the cast copy is what the backward
multiplies by: a micro-batch keeps a half-precision copy of each frozen weight of its stage (counted the
same way: 2 bytes per parameter per layer, at any length), trained weights one copy per step. With
gradient checkpointing a layer keeps only its input (h), and one layer's full set lives again while it
is recomputed. The
last stage also holds each micro-batch's logits and the loss's fp32 log-softmax and gradient (vocab x
(dtype + 8 bytes) per token); every stage holds the schedule's receive buffers for every micro-batch
(a hidden state in, its gradient back). How many micro-batches are alive at once is the schedule's:
GPipe runs every forward before any backward (all M); 1F1B lets stage j of k run k - j forwards
before its first backward (`torch.distributed.pipelining.Schedule1F1B`'s warm-up).

Calibrated once against measured peaks (BENCHMARKS.md, "Memory under a cap"): the reduced Llama of
`tests/cluster/test_memory_cap.py` (16 layers, hidden 1,024, fp32), LoRA, 1 row x 24 tokens, 2
micro-batches, 8 + 8 layers. A rank grew from the RSS it measured its node with to its peak by 703.5
and 674.6 MB (2 gloo ranks under torchrun) and 710 and 658 MB (the same job on the capped cluster),
against 709.6 and 680.2 MB planned (weights x 1.2: 649.5 and 649.4; activations: 60.1 and 30.8).
Weights x 1.2 alone fell 54 MB short on the first stage, which holds 2 micro-batches under 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Workload:
    """What the stages will run: it sets the memory to reserve and what a cut costs per token."""

    training: bool = False        # forward + backward: ~3x the FLOPs; activations go forward, gradients back
    tokens_per_message: int = 1   # tokens crossing a cut together (1: one sequence decoding; batch x seq in training)
    kv_tokens: int = 0            # KV cache to reserve on every layer (serving: batch x context)
    headroom: float = 1.2         # weights x headroom must fit: allocator slack, runtime growth (serving: activations)
    # Sequences (or microbatches) in the pipeline at once. None: enough to keep every stage busy, so
    # a token leaves every slowest-stage time. 1: one sequence decoding alone walks through every
    # stage in turn, so it waits for the sum and a split only pays by reaching a faster node.
    in_flight: int | None = None
    # Training a pipeline (`models.stage_memory.training_workload`): what one micro-batch keeps alive for
    # its backward, per layer of a stage and on the last stage (logits, the loss); one more layer's worth
    # on every stage (a recompute); the schedule's buffers for every micro-batch; how many are alive at once.
    activation_layer_bytes: float = 0.0
    activation_layer_once_bytes: float = 0.0  # per layer, whatever is in flight: autocast's copy of trained weights
    activation_head_bytes: float = 0.0
    activation_stage_bytes: float = 0.0
    buffer_bytes: float = 0.0
    microbatches: int = 1
    holds_every_microbatch: bool = False  # GPipe; 1F1B (False): stage j of k holds k - j of them

    def held(self, j: int, k: int) -> int:
        """Micro-batches whose activations stage j of k holds at once (at its first backward)."""
        return self.microbatches if self.holds_every_microbatch else max(1, min(self.microbatches, k - j))

    def activation_bytes(self, layers: int, last: bool, j: int = 0, k: int = 1) -> float:
        """What stage j of k, holding `layers` layers (and the head when `last`), keeps for the backward."""
        if not self.training:
            return 0.0
        per_micro = self.activation_layer_bytes * layers + self.activation_head_bytes * last
        return (self.held(j, k) * per_micro + self.activation_layer_once_bytes * layers + self.activation_stage_bytes
                + self.buffer_bytes)

    def layer_bytes(self, j: int, k: int) -> float:
        """Activations per layer of stage j of k (what `activation_bytes` adds per layer)."""
        if not self.training:
            return 0.0
        return self.held(j, k) * self.activation_layer_bytes + self.activation_layer_once_bytes

    @property
    def counted(self) -> str:
        """What a stage's bytes count, for the messages: weights x headroom, and the rest when there is one."""
        extra = " + KV cache" if self.kv_tokens else ""
        if self.activation_bytes(1, True):
            extra += f" + activations of up to {self.microbatches} micro-batch{'es' * (self.microbatches > 1)}"
        return f"weights x {self.headroom:g} headroom{extra}"

    def per_token_s(self, stage_seconds: Sequence[float]) -> float:
        slowest = max(stage_seconds)
        return slowest if self.in_flight is None else max(slowest, sum(stage_seconds) / self.in_flight)


# elements kept per token per layer, in the compute dtype: (x hidden, x intermediate) for the method,
# and what the adapters' dropout adds on top when it is on (see the module docstring)
KEPT = {"none": (10, 4), "lora": (8, 4), "ia3": (8, 4), "adapter": (8, 3)}
DROPOUT_KEPT = {"lora": (10, 1)}
RANK_OUTPUTS = {"lora": 7}  # q, k, v, o, gate, up, down: each adapted linear keeps its rank-r intermediate
SCHEDULE_HOLDS_ALL = {"gpipe": True, "1f1b": False}  # GPipe: every forward before any backward
# Autocast casts a weight for every forward; a frozen weight's copy is kept by each micro-batch's graph
# (its input's gradient needs it), a trained weight's is cached once for the step (autocast's cache)
CAST_COPY_ONCE = {"none": True}


@dataclass(frozen=True)
class TrainShape:
    """The run's batch as a pipeline stage sees it."""

    rows: int               # rows per micro-batch
    length: int             # their longest (the run's max length: the bound)
    microbatches: int       # per step
    schedule: str = "1f1b"
    method: str = "lora"    # the PEFT method (`none`: full fine-tuning)
    dropout: float = 0.0    # the adapters' dropout
    rank: int = 8           # LoRA's rank
    checkpointing: bool = False
    autocast_bytes: int = 0  # bytes per element of the autocast dtype (bf16, fp16: 2); 0: no autocast


def layer_elements_per_token(config, shape: TrainShape) -> float:
    """Elements one decoder layer keeps per token for the backward (module docstring)."""
    h = int(config.hidden_size)
    i = int(getattr(config, "intermediate_size", None) or 4 * h)
    heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 1))
    ch, ci = KEPT.get(shape.method, KEPT["none"])
    if shape.dropout > 0:
        dh, di = DROPOUT_KEPT.get(shape.method, (0, 0))
        ch, ci = ch + dh, ci + di
    return ch * h + ci * i + heads + 2 + RANK_OUTPUTS.get(shape.method, 0) * shape.rank


def training_workload(config, dtype_bytes: int, shape: TrainShape, layer_bytes: float = 0.0,
                      headroom: float = 1.2) -> Workload:
    """The `Workload` of a pipeline training stage: its weights x `headroom`, plus the activations above.
    `layer_bytes`: one decoder layer's weights (in `dtype_bytes` per element), for autocast's copies.
    Under autocast the elements are counted at `dtype_bytes` still (most are half that: an upper bound)."""
    tokens = shape.rows * shape.length
    cast = layer_bytes / dtype_bytes * shape.autocast_bytes
    once = CAST_COPY_ONCE.get(shape.method, False)
    h = int(config.hidden_size)
    per_layer = layer_elements_per_token(config, shape) * dtype_bytes * tokens
    recompute = 0.0
    if shape.checkpointing:  # a layer keeps its input; one layer's set lives again during its recompute
        per_layer, recompute = h * dtype_bytes * tokens, per_layer
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    return Workload(
        training=True, tokens_per_message=tokens, headroom=headroom,
        activation_layer_bytes=per_layer + cast * (not once), activation_layer_once_bytes=cast * once,
        activation_head_bytes=vocab * (dtype_bytes + 8) * tokens + 2 * h * dtype_bytes * tokens,
        activation_stage_bytes=recompute,
        buffer_bytes=2 * h * dtype_bytes * tokens * shape.microbatches,
        microbatches=shape.microbatches,
        holds_every_microbatch=SCHEDULE_HOLDS_ALL.get(shape.schedule, True),
    )
