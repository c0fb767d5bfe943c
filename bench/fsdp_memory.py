"""Peak memory per rank: fsdp against ddp, full fine-tuning, 2 ranks under plain torchrun (no Ray).

The same engine and settings for both; each rank samples its own resident set every 10 ms and
reports the peak of each phase: loading the model, training (steps and the sharding before them),
and the end (final evaluation, the model's files, the last checkpoint). Ray is left out so the
numbers are the training's own; `bench/strategies.py` measures the same inside the cluster.

    .venv/bin/python bench/fsdp_memory.py [--model llama-100m --steps 5 --batch-size 2]

Goal (issue 11): fsdp's peak per rank <= 0.6x DDP's for full fine-tuning of llama-100m.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def worker(strategy: str, cfg_path: str, out_path: str) -> None:
    """One rank: train with `strategy`, write {"rank", "peak_mb": {phase: MB}, "maxrss_mb"} to out_path.rank<r>."""
    import resource

    import torch
    import torch.distributed as dist

    from smolforge.config import TrainConfig
    from smolforge.parallel.strategies import make_strategy
    from smolforge.train.engine import TrainHooks, train

    phase, peaks = ["load"], {}

    def sample() -> None:
        while True:
            now, p = rss_mb(), phase[0]
            peaks[p] = max(peaks.get(p, 0.0), now)
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = TrainConfig.model_validate({**json.loads(Path(cfg_path).read_text()), "output_dir": f"{out_path}.run{rank}"})
    torch.set_num_threads(1)

    def on_model(_model) -> None:
        phase[0] = "train"

    def on_eval(_metrics) -> None:
        phase[0] = "end"  # eval_every is 0: the only evaluation is the final one

    train(cfg, TrainHooks(on_model=on_model, on_eval=on_eval), strategy=make_strategy(strategy))
    time.sleep(0.05)
    Path(f"{out_path}.rank{rank}").write_text(json.dumps({
        "rank": rank, "peak_mb": {k: round(v) for k, v in peaks.items()},
        "maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
    dist.destroy_process_group()


def run(strategy: str, cfg_path: Path, tmp: Path) -> list[dict]:
    out = tmp / f"mem-{strategy}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    __file__, "--worker", strategy, str(cfg_path), str(out)],
                   check=True, env=env, capture_output=True, timeout=1800)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=2, help="per rank")
    ap.add_argument("--max-length", type=int, default=128)
    args = ap.parse_args()
    from dp_step_time import prepare

    tmp, data = prepare(args.model, "sfmem")
    cfg = {"model": args.model, "data": {"path": str(data), "max_length": args.max_length, "max_eval_samples": 64},
           "max_steps": args.steps, "batch_size": args.batch_size, "eval_accuracy": False, "save_every": 0,
           "eval_every": 0, "quiet": True, "tensorboard": False, "num_threads": 1, "seed": 0, "lr": 1e-4,
           "peft": {"method": "none"}}
    cfg_path = tmp / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    res = {s: run(s, cfg_path, tmp) for s in ("ddp", "fsdp")}
    print(f"{args.model}, full fine-tuning, 2 ranks, batch {args.batch_size}/rank, {args.steps} steps; "
          "peak RSS per rank in MB (rank 0 / rank 1)")
    print(f"{'phase':<8} {'ddp':>13} {'fsdp':>13} {'fsdp / ddp':>11}")
    for phase in ("load", "train", "end"):
        d = [r["peak_mb"].get(phase, 0) for r in res["ddp"]]
        f = [r["peak_mb"].get(phase, 0) for r in res["fsdp"]]
        print(f"{phase:<8} {d[0]:>6} /{d[1]:>5} {f[0]:>6} /{f[1]:>5} {max(f) / max(d):>11.3f}")
    worst = {s: max(r["maxrss_mb"] for r in rs) for s, rs in res.items()}
    print(json.dumps({"model": args.model, "steps": args.steps, "batch_per_rank": args.batch_size,
                      "peak_mb_per_rank": {s: [r["maxrss_mb"] for r in rs] for s, rs in res.items()},
                      "fsdp_peak_vs_ddp": round(worst["fsdp"] / worst["ddp"], 3), "goal": "<= 0.6"}))


if __name__ == "__main__":
    main()
