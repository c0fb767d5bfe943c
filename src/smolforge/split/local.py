"""The same training without the split: one process, the unsplit HF model with peft LoRA.

This is the yardstick split training is held to. It uses the same batches (`SampleOrder`), the
same seeded LoRA initial weights (`seeded_init` by full-model module name), the same loss
normalisation, learning-rate schedule, clipping (torch's `clip_grad_norm_`) and AdamW, but runs
`model(input_ids, attention_mask)` in one piece. With the fp32 codec a split run must match it step
for step; the benchmarks time it as the local baseline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from smolforge.config import PeftSpec
from smolforge.data.collate import collate
from smolforge.models.loading import load_model
from smolforge.models.peft_methods import apply_peft
from smolforge.split.lora import seeded_init
from smolforge.train.engine import SampleOrder
from smolforge.train.evaluate import token_loss_sum
from smolforge.train.schedule import lr_lambda

PEFT_PREFIX = "base_model.model."


def canonical(name: str) -> str:
    """peft's `base_model.model.model.layers.0...` -> `model.layers.0...` (the split code's names)."""
    return name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name


@dataclass
class LocalResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lora: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0
    steps_per_s: float = 0.0


def build(model_name: str, spec: PeftSpec, seed: int, device: str = "cpu"):
    """The full model with peft LoRA on every layer, A matrices seeded like the split parts'."""

    model = apply_peft(load_model(model_name, device=device), spec)
    seeded_init(model, seed, canonical)
    model.train()
    return model


@dataclass(frozen=True)
class LocalRun:
    """What `train_local` trains for: the settings a split run's client and trunk share (`SplitTrainConfig`'s)."""

    steps: int  # optimizer steps taken now
    batch_size: int  # rows per micro-batch
    grad_accum: int = 1  # micro-batches per step
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    scheduler: str = "linear"
    max_grad_norm: float | None = 1.0  # None or 0: no clipping (the norm is still measured)
    seed: int = 0  # the sample order's
    total_steps: int | None = None  # the schedule's length (default: `steps`)
    device: str = "cpu"


def train_local(model, rows, pad_id: int, run: LocalRun | None = None, *,
                on_step: Callable[[int], None] | None = None, **settings: Any) -> LocalResult:
    """Train `model` for `run.steps` optimizer steps (of a `run.total_steps` schedule) on `rows`; `settings`:
    `LocalRun`'s fields by name instead of `run` (`train_local(model, rows, pad, steps=3, batch_size=4)`; an
    unknown name is a TypeError).

    `on_step(step)` runs after each step (the benchmark reads CPU time there)."""
    r = run or LocalRun(**settings)
    steps, batch_size, grad_accum, lr, device = r.steps, r.batch_size, r.grad_accum, r.lr, r.device
    max_grad_norm = r.max_grad_norm
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=r.weight_decay)
    order = SampleOrder(len(rows), batch_size * grad_accum, r.seed)
    total = r.total_steps or steps
    out = LocalResult()
    t0 = time.perf_counter()
    for step0 in range(steps):
        idx = order.step_rows(step0)
        micro = [collate([rows[i] for i in idx[j:j + batch_size]], pad_id) for j in range(0, len(idx), batch_size)]
        denom = float(max(1, sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)))
        loss_total = 0.0
        for m in micro:
            m = {k: v.to(device) for k, v in m.items()}
            logits = model(input_ids=m["input_ids"], attention_mask=m["attention_mask"]).logits
            loss_sum, _ = token_loss_sum(logits, m["labels"])
            (loss_sum / denom).backward()
            loss_total += float(loss_sum.detach())
        if max_grad_norm:
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        else:
            norm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None)))
        for group in opt.param_groups:
            group["lr"] = lr * lr_lambda(step0, total, r.warmup_steps, r.scheduler, 0.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.losses.append(loss_total / denom)
        out.grad_norms.append(norm)
        if on_step:
            on_step(step0 + 1)
    out.seconds = time.perf_counter() - t0
    out.steps_per_s = steps / max(out.seconds, 1e-9)
    out.lora = {canonical(n): p.detach().cpu().float().clone() for n, p in model.named_parameters() if "lora_" in n}
    return out
