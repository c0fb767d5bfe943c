"""Data-parallel time per step: 2 Ray workers (smolforge's worker group) vs plain torchrun DDP.

Both sides run the same engine, model, data, per-rank batch and threads, so the ratio is the cost of
the cluster layer per step: Ray actors, the rendezvous, progress reporting and the pause/cancel poll.
Both are measured the same way: the median gap between consecutive `on_step` callbacks on rank 0.
Runs alternate (baseline, cluster, baseline, cluster…) so background load hits both alike; on a
shared machine the per-round pair ratio (each cluster run over the baseline run just before it) and
the ratio of the best runs are steadier than the ratio of medians, so all three are printed.

    .venv/bin/python bench/dp_step_time.py [--model small-llama --steps 60 --batch-size 4 --repeats 2]

Goal: ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_cfg(args, data: str) -> dict:
    return {"model": args.model, "data": {"path": data, "max_length": args.max_length, "max_eval_samples": 4},
            "max_steps": args.steps, "batch_size": args.batch_size, "eval_accuracy": False, "save_every": 0,
            "quiet": True, "tensorboard": False, "num_threads": 1, "seed": 0,
            "peft": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0}}


def prepare(model: str, prefix: str) -> tuple[Path, Path]:
    """A temp dir (Ray's too), offline settings, the model preset built outside the timings, and the data."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.setdefault("RAY_TMPDIR", str(tmp / "ray"))
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    preset_dir(model)
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(2000, seed=11)))
    return tmp, data


def run_torchrun(cfg: dict, tmp: Path, i: int) -> tuple[float, float]:
    """(median step s, CPU s per step) of `cfg` under plain torchrun DDP, 2 ranks (no Ray)."""
    cfg_path, out = tmp / f"cfg-{i}.json", tmp / f"torchrun-{i}.json"
    cfg_path.write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(ROOT / "bench" / "dp_torchrun_worker.py"), str(cfg_path), str(out)],
                   check=True, env=env, capture_output=True, timeout=900)
    res = json.loads(out.read_text())
    return res["median_step_s"], res["cpu_step_s"]


def run_cluster(args, cluster, data: str) -> tuple[float, float, float]:
    spec = {"kind": "data_parallel", "num_workers": 2, "train": train_cfg(args, data)}
    t0 = time.time()
    job_id = cluster.submit_job(spec)
    st = cluster.wait_for_job(job_id, timeout=900)
    if st["state"] != "completed":
        raise SystemExit(f"cluster job {st['state']}: {st['error']}")
    res = st["result"]
    return res["median_step_s"], res["cpu_step_s"], res["first_step_ts"] - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tmp, data = prepare(args.model, "sfb")
    from smolforge.cluster.embedded import EmbeddedCluster

    t0 = time.time()
    cluster = EmbeddedCluster(state_dir=tmp / "state", num_cpus=2)
    ray_start = time.time() - t0
    base, ours, first, base_cpu, ours_cpu = [], [], [], [], []
    try:
        for i in range(args.repeats):
            step, cpu = run_torchrun(train_cfg(args, str(data)), tmp, i)
            base.append(step)
            base_cpu.append(cpu)
            step, cpu, to_first = run_cluster(args, cluster, str(data))
            ours.append(step)
            ours_cpu.append(cpu)
            first.append(to_first)
            print(f"round {i}: torchrun {base[-1] * 1000:.1f} ms/step ({base_cpu[-1] * 1000:.1f} CPU-ms), "
                  f"smolforge {ours[-1] * 1000:.1f} ms/step ({ours_cpu[-1] * 1000:.1f} CPU-ms)", flush=True)
    finally:
        cluster.close()
    b, o = statistics.median(base), statistics.median(ours)
    pair_ratios = [x / y for x, y in zip(ours, base)]
    print(json.dumps({"model": args.model, "steps": args.steps, "batch_per_rank": args.batch_size, "ranks": 2,
                      "torchrun_ms_per_step": round(b * 1000, 2), "smolforge_ms_per_step": round(o * 1000, 2),
                      "ratio_of_medians": round(o / b, 3),
                      "median_pair_ratio": round(statistics.median(pair_ratios), 3),
                      "ratio_of_best": round(min(ours) / min(base), 3),
                      "pair_ratios": [round(r, 3) for r in pair_ratios], "goal": "<= 1.10",
                      "torchrun_cpu_ms_per_step": round(statistics.median(base_cpu) * 1000, 2),
                      "smolforge_cpu_ms_per_step": round(statistics.median(ours_cpu) * 1000, 2),
                      "cpu_ratio": round(statistics.median(ours_cpu) / statistics.median(base_cpu), 3),
                      "submit_to_first_step_s": round(statistics.median(first), 2),
                      "embedded_cluster_start_s": round(ray_start, 2)}, indent=2))


if __name__ == "__main__":
    main()
