"""Training throughput: the smolforge engine against a plain PyTorch loop and the HF Trainer.

Same model, LoRA config, data (packed bundled tasks) and batch for all three, measured in the same
run and interleaved (A B C A B C ...) so that noise from a shared machine hits all alike. Prints
tokens/s and the ratio to the plain loop. Also measures bf16 autocast on CPU against fp32, which
decides the engine's `precision: auto` on CPU.

    python bench/train_throughput.py --model tiny-llama --steps 30 --repeats 3
    python bench/train_throughput.py --model llama-100m --steps 6 --repeats 2 --batch-size 4
    python bench/train_throughput.py --threads 1 --clock cpu   # on a busy machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from smolforge.config import DataSpec, PeftSpec, TrainConfig  # noqa: E402
from smolforge.data.collate import collate  # noqa: E402
from smolforge.data.splits import load_splits  # noqa: E402
from smolforge.models.loading import load_model, load_tokenizer  # noqa: E402
from smolforge.models.peft_methods import apply_peft  # noqa: E402
from smolforge.train.engine import SampleOrder, train  # noqa: E402
from smolforge.train.evaluate import token_loss_sum  # noqa: E402


# Wall clock by default; `--clock cpu` counts this process's CPU time instead, which stays
# meaningful when other work shares the machine (use it with --threads 1).
CLOCK = time.perf_counter


def make_cfg(args, out: str, precision: str = "fp32") -> TrainConfig:
    return TrainConfig(model=args.model, data=DataSpec(path="bundled", max_length=args.seq, packing=True,
                                                       max_eval_samples=1),
                       peft=PeftSpec(method="lora", r=8, alpha=16, dropout=0.0), output_dir=out,
                       max_steps=args.steps + args.warmup, batch_size=args.batch_size, lr=1e-4, quiet=True,
                       tensorboard=False, eval_accuracy=False, precision=precision, num_threads=args.threads,
                       log_every=10_000)


def run_engine(args, splits, tok, precision="fp32") -> float:
    with tempfile.TemporaryDirectory() as d:
        cfg = make_cfg(args, d, precision)
        times: list[float] = []
        from smolforge.train.engine import TrainHooks

        hooks = TrainHooks(on_step=lambda info: times.append(CLOCK()))
        torch.manual_seed(0)
        model = apply_peft(load_model(args.model), cfg.peft)
        train(cfg, hooks, splits=splits, model=model, tokenizer=tok)
    # tokens in the timed steps only (after warm-up)
    return _tps(args, splits, times)


def _step_tokens(args, splits) -> list[int]:
    order = SampleOrder(len(splits.train), args.batch_size, 0)
    return [sum(len(splits.train[i]["input_ids"]) for i in order.step_rows(s)) for s in range(args.steps + args.warmup)]


def _tps(args, splits, times: list[float]) -> float:
    toks = _step_tokens(args, splits)
    timed = toks[args.warmup + 1:]
    return sum(timed) / (times[-1] - times[args.warmup])


def run_plain(args, splits, tok) -> float:
    """The loop a person would write by hand: same batches, same loss, AdamW, clipping."""
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = apply_peft(load_model(args.model), PeftSpec(method="lora", r=8, alpha=16, dropout=0.0))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    order = SampleOrder(len(splits.train), args.batch_size, 0)
    times = []
    for step in range(args.steps + args.warmup):
        batch = collate([splits.train[i] for i in order.step_rows(step)], tok.pad_token_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss_sum, n = token_loss_sum(logits, batch["labels"])
        (loss_sum / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(CLOCK())
    return _tps(args, splits, times)


def run_hf_trainer(args, splits, tok) -> float:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    model = apply_peft(load_model(args.model), PeftSpec(method="lora", r=8, alpha=16, dropout=0.0))
    order = SampleOrder(len(splits.train), args.batch_size, 0)
    rows = [splits.train[i] for s in range(args.steps + args.warmup) for i in order.step_rows(s)]
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            times.append(CLOCK())

    with tempfile.TemporaryDirectory() as d:
        targs = TrainingArguments(output_dir=d, max_steps=args.steps + args.warmup, per_device_train_batch_size=args.batch_size,
                                  learning_rate=1e-4, report_to=[], save_strategy="no", logging_strategy="no",
                                  use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=1.0,
                                  remove_unused_columns=False)
        trainer = Trainer(model=model, args=targs, train_dataset=rows,
                          data_collator=lambda f: collate(f, tok.pad_token_id), callbacks=[Clock()])
        torch.set_num_threads(args.threads)
        trainer.train()
    return _tps(args, splits, times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--no-hf", action="store_true", help="skip the HF Trainer")
    p.add_argument("--bf16", action="store_true", help="also measure bf16 autocast in the engine")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    tok = load_tokenizer(args.model)
    splits = load_splits(DataSpec(path="bundled", max_length=args.seq, packing=True, max_eval_samples=1), tok)
    runners = {"plain": lambda: run_plain(args, splits, tok), "engine": lambda: run_engine(args, splits, tok)}
    if not args.no_hf:
        runners["hf_trainer"] = lambda: run_hf_trainer(args, splits, tok)
    if args.bf16:
        runners["engine_bf16"] = lambda: run_engine(args, splits, tok, "bf16")
    results: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(args.repeats):
        for name, fn in runners.items():
            results[name].append(fn())
            print(f"  repeat {r + 1} {name:12s} {results[name][-1]:10.0f} tok/s", file=sys.stderr, flush=True)
    base = statistics.median(results["plain"])
    print(f"\nmodel {args.model}, batch {args.batch_size} x {args.seq} tokens (packed), LoRA r=8, "
          f"{args.steps} timed steps x {args.repeats} repeats, {args.threads} threads, {args.clock} clock")
    print(f"{'loop':14s} {'median tok/s':>12s} {'ratio vs plain':>15s}")
    for name, vals in results.items():
        med = statistics.median(vals)
        print(f"{name:14s} {med:12.0f} {med / base:15.3f}")


if __name__ == "__main__":
    main()
