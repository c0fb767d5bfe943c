"""The distillation student's training speed against the plain engine, same model and batches.

A tiny teacher writes a top-k store; the student trains on it with the KD loss (streaming shards,
`smolforge.distill.student.train_student`). The engine (`smolforge.train.engine.train`) trains the
same student model on the very same token rows with plain cross-entropy, same batch size, same
LoRA, fp32. Both are timed step by step in one process, interleaved A B A B, and tokens/s of the
timed steps (after warm-up) are compared. Goal: student >= 0.95 x engine (the KD term costs a
top-k gather per target token; everything else is the same loop work).

    python bench/student_throughput.py --steps 30 --repeats 3 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from smolforge.config import DataSpec, PeftSpec, TrainConfig  # noqa: E402
from smolforge.data.encode import EncodeStats  # noqa: E402
from smolforge.data.splits import Splits  # noqa: E402
from smolforge.distill.losses import KDConfig  # noqa: E402
from smolforge.distill.shard_source import DirShardSource  # noqa: E402
from smolforge.distill.store import read_shard  # noqa: E402
from smolforge.distill.student import StudentConfig, rows_from_shard, template_tail_ids, train_student  # noqa: E402
from smolforge.distill.teacher import GenSettings, run_teacher_local  # noqa: E402
from smolforge.models.loading import load_tokenizer  # noqa: E402
from smolforge.train.engine import SampleOrder, TrainHooks, train  # noqa: E402

CLOCK = time.perf_counter
PEFT = PeftSpec(method="lora", r=8, alpha=16, dropout=0.0)


def _tps(tokens: list[int], times: list[float], warmup: int) -> float:
    return sum(tokens[warmup + 1:]) / (times[-1] - times[warmup])


def run_student(args, store: Path, step_tokens: list[int]) -> float:
    times: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        cfg = StudentConfig(base_model=args.model, output_dir=d, max_steps=args.steps + args.warmup,
                            batch_size=args.batch_size, lr=1e-4, device="cpu", num_threads=args.threads, peft=PEFT,
                            kd=KDConfig(kd_ratio=0.5), eval_accuracy=False, save_every=0, precision="fp32")
        train_student(cfg, DirShardSource(store, poll_s=0.01), on_step=lambda info: times.append(CLOCK()))
    return _tps(step_tokens, times, args.warmup)


def run_engine(args, splits: Splits, tok, step_tokens: list[int]) -> float:
    times: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        cfg = TrainConfig(model=args.model, data=DataSpec(path="bundled", max_eval_samples=1), peft=PEFT,
                          output_dir=d, max_steps=args.steps + args.warmup, batch_size=args.batch_size, lr=1e-4,
                          quiet=True, tensorboard=False, eval_accuracy=False, precision="fp32",
                          num_threads=args.threads, log_every=10_000)
        train(cfg, TrainHooks(on_step=lambda info: times.append(CLOCK())), splits=splits, tokenizer=tok)
    return _tps(step_tokens, times, args.warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    work = Path(tempfile.mkdtemp(prefix="student-bench-"))
    store = work / "teacher_outputs"
    n_rows = args.batch_size * (args.steps + args.warmup)
    run_teacher_local(args.model, "bundled", store, num_shards=1, max_samples=n_rows,
                      settings=GenSettings(max_new_tokens=24, top_k=16, batch_size=32), device="cpu")
    rows = rows_from_shard(read_shard(store, 0), tok, True, 256, template_tail_ids(tok))
    # The same rows for both; each loop batches them in its own seeded order, so tokens/s is
    # counted from each loop's own batches.
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0 * 1_000_003 + 7919)).tolist()
    stream = [rows[i] for i in order]  # the student's epoch-0 order (RowStream)
    train_rows = [{"input_ids": r.input_ids, "labels": r.labels} for r in rows]
    splits = Splits(train=train_rows, eval=train_rows[:1], eval_examples=[], format="shard", skipped=0,
                    train_stats=EncodeStats(), eval_stats=EncodeStats())
    steps = range(args.steps + args.warmup)
    student_tokens = [sum(len(r.input_ids) for r in stream[s * args.batch_size:(s + 1) * args.batch_size])
                      for s in steps]
    engine_order = SampleOrder(len(train_rows), args.batch_size, 0)
    engine_tokens = [sum(len(train_rows[i]["input_ids"]) for i in engine_order.step_rows(s)) for s in steps]
    results: dict[str, list[float]] = {"engine": [], "student": []}
    for r in range(args.repeats):
        results["engine"].append(run_engine(args, splits, tok, engine_tokens))
        results["student"].append(run_student(args, store, student_tokens))
        print(f"  repeat {r + 1}: engine {results['engine'][-1]:.0f} tok/s, student {results['student'][-1]:.0f} tok/s",
              file=sys.stderr, flush=True)
    base = statistics.median(results["engine"])
    print(f"\nmodel {args.model}, batch {args.batch_size}, {len(rows)} teacher rows, LoRA r=8, fp32, "
          f"{args.steps} timed steps x {args.repeats} repeats, {args.threads} threads, {args.clock} clock")
    print(f"{'loop':10s} {'median tok/s':>12s} {'ratio vs engine':>16s}")
    for name, vals in results.items():
        print(f"{name:10s} {statistics.median(vals):12.0f} {statistics.median(vals) / base:16.3f}")


if __name__ == "__main__":
    main()
