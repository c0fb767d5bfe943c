"""Pipeline training step time: 2 stages (GPipe and 1F1B, 4 and 8 micro-batches) against one process.

Every run trains the same model on the same rows with the same global batch: one process takes
M micro-batches of B rows a step (batch_size B, grad_accum M); the pipeline runs the same M
micro-batches through 2 stages, one process and one thread each, under plain torchrun (gloo, no
Ray), with the stage bounds given (half the layers each) so runs compare like for like. The
baseline is measured in the same run, one thread, as each stage has.

    .venv/bin/python bench/pipeline_step.py [--model small-llama --batch-size 2 --steps 8]

Printed per schedule and M: the median step time, its ratio to one process, and the bubble:
- ideal: (S - 1) / (M + S - 1), the idle share of a GPipe/1F1B step on S equal stages;
- measured: 1 - (one process's step / S) / (the pipeline's step), the share of each stage's
  step not spent on its half of the work (the bubble plus the sends, padding and schedule).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

STAGES = 2


def worker(cfg_path: str, strategy_json: str, out_path: str) -> None:
    """One rank (or the one process, when not under torchrun): train, write the step times."""
    import torch
    import torch.distributed as dist

    from smolforge.config import TrainConfig
    from smolforge.parallel.strategies import make_strategy
    from smolforge.train.engine import TrainHooks, train

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    cfg = TrainConfig.model_validate({**json.loads(Path(cfg_path).read_text()), "output_dir": f"{out_path}.run{rank}"})
    torch.set_num_threads(1)
    times: list[float] = []
    strategy = make_strategy("pipeline", json.loads(strategy_json)) if distributed else None
    train(cfg, TrainHooks(on_step=lambda info: times.append(time.perf_counter())), strategy=strategy)
    if rank == 0:
        gaps = sorted(b - a for a, b in zip(times[1:], times[2:]))  # the first step builds the schedule
        Path(out_path).write_text(json.dumps({"median_step_s": gaps[len(gaps) // 2], "steps": len(times)}))
    if distributed:
        dist.destroy_process_group()


def run(cfg: dict, tmp: Path, name: str, strategy: dict | None) -> float:
    cfg_path, out = tmp / f"cfg-{name}.json", tmp / f"out-{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [__file__, "--worker", str(cfg_path), json.dumps(strategy or {}), str(out)]
    if strategy is not None:
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(STAGES), *args]
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())["median_step_s"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=2, help="rows per micro-batch")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--microbatches", default="4,8")
    args = ap.parse_args()
    from dp_step_time import prepare

    from smolforge.models.partition import arch_of
    from smolforge.models.tiny import preset_dir

    tmp, data = prepare(args.model, "sfpp")
    from transformers import AutoConfig

    layers = arch_of(AutoConfig.from_pretrained(preset_dir(args.model))).num_layers
    bounds = [0, layers // 2, layers]
    rows = []
    for m in (int(x) for x in args.microbatches.split(",")):
        base = {"model": args.model, "data": {"path": str(data), "max_length": args.max_length, "max_eval_samples": 8},
                "max_steps": args.steps, "batch_size": args.batch_size, "eval_accuracy": False, "save_every": 0,
                "eval_every": 0, "quiet": True, "tensorboard": False, "num_threads": 1, "seed": 0, "lr": 1e-4,
                "peft": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0}}
        one = run({**base, "grad_accum": m}, tmp, f"one-{m}", None)
        for schedule in ("gpipe", "1f1b"):
            pp = run({**base, "grad_accum": m // STAGES}, tmp, f"{schedule}-{m}", {"schedule": schedule, "bounds": bounds})
            rows.append({"schedule": schedule, "microbatches": m, "one_process_step_s": round(one, 4),
                         "pipeline_step_s": round(pp, 4), "pipeline_vs_one": round(pp / one, 3),
                         "bubble_ideal": round((STAGES - 1) / (m + STAGES - 1), 3),
                         "bubble_measured": round(1 - (one / STAGES) / pp, 3)})
    print(f"{args.model} ({layers} layers, cut {bounds}), LoRA, {STAGES} stages x 1 thread vs 1 process x 1 thread, "
          f"{args.batch_size} rows per micro-batch, max_length {args.max_length}, median of {args.steps - 2} steps")
    print(f"{'schedule':<8} {'M':>3} {'1 proc s':>9} {'pipeline s':>11} {'ratio':>6} {'bubble ideal':>13} {'measured':>9}")
    for r in rows:
        print(f"{r['schedule']:<8} {r['microbatches']:>3} {r['one_process_step_s']:>9.3f} {r['pipeline_step_s']:>11.3f} "
              f"{r['pipeline_vs_one']:>6.2f} {r['bubble_ideal']:>13.2f} {r['bubble_measured']:>9.2f}")
    print(json.dumps({"model": args.model, "stages": STAGES, "rows": rows}))


if __name__ == "__main__":
    main()
