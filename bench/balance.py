"""Speed-balanced batches: a 2-worker group where one worker is 3x slower than the other.

A real cluster of processes on this machine (coordinator + workers w1 and w2, one CPU each; the
coordinator lends none). w2 is made 3x slower than w1 by fault injection: it sleeps 2c per sample in
every forward, where c is w1's measured seconds per sample, so a sample costs it 3c. Measured in the
same run: each worker's solo throughput (a 1-worker job on it, same per-rank batch), then the pair
with `--balance off` and `--balance auto` (global batch twice the per-rank one). Printed: samples/s
of auto / off (goal >= 1.4) and auto / (solo w1 + solo w2) (goal >= 0.85), and the rows per rank
that auto chose.

The diloco row (issue 45 item 5): the pair under `--strategy diloco` with `inner_steps_by_speed`
(each rank's inner steps per round follow its measured speed; `--diloco-h` steps a round) against the
same summed solo throughput (goal >= 0.85). Its samples/s is the whole run's: every step's rows over
rank 0's first to last step (`train_s`), the first round (split evenly: nothing measured yet) and every
outer sync included, since its rank 0's step times are inner steps of uneven rounds, not global steps.

    .venv/bin/python bench/balance.py [--model small-llama --steps 60 --batch-size 8] [--diloco-only]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
from dp_step_time import prepare  # noqa: E402  (offline env, temp dir, preset, data)


def spec(args, data: Path, workers: int, batch: int, balance: str, nodes: list[str], **job) -> dict:
    return {"kind": "data_parallel", "num_workers": workers, "balance": balance, "allowed_nodes": nodes, **job,
            "train": {"model": args.model, "data": {"path": str(data), "max_length": args.max_length,
                                                    "max_eval_samples": 8},
                      "max_steps": args.steps, "batch_size": batch, "eval_accuracy": False, "save_every": 0,
                      "seed": 0, "lr": 1e-3, "peft": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0}}}


def completed(client, job: dict, timeout_s: float = 3600) -> dict:
    """The job's result, once it completed (exits with its state and error otherwise)."""
    job_id = client.submit_job(job)
    st = client.wait_for_job(job_id, timeout=timeout_s, poll=0.5)
    if st["state"] != "completed":
        raise SystemExit(f"job {job_id} {st['state']}: {st['error']}")
    return st["result"]


def throughput(client, job: dict) -> dict:
    """Samples per second over the steady steps (median step time), and the job's result."""
    res = completed(client, job)
    batch = job["train"]["batch_size"] * job["num_workers"]
    return {"samples_per_s": batch / res["median_step_s"], "median_step_s": res["median_step_s"],
            "whole_run_samples_per_s": batch * res["steps"] / res["train_s"],
            "rows": res.get("batch_rows_per_rank"), "nodes": res["nodes"],
            "wait_s": res.get("comm_wait_s_per_rank")}


def whole_run(client, job: dict) -> dict:
    """Samples per second over the whole run (every step's rows over rank 0's first to last step)."""
    res = completed(client, job)
    samples = job["train"]["batch_size"] * job["num_workers"] * res["steps"]
    return {"samples_per_s": samples / res["train_s"], "train_s": res["train_s"], "rounds": res.get("rounds"),
            "nodes": res["nodes"], "wait_s": res.get("comm_wait_s_per_rank")}


def diloco(args, data: Path, b: int) -> dict:
    """The pair under diloco with inner steps by speed."""
    config = {"inner_steps": args.diloco_h, "inner_steps_by_speed": True}
    return spec(args, data, 2, b, "off", ["w1", "w2"], strategy="diloco", strategy_config=config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--slower", type=float, default=3.0, help="how much slower w2 is")
    ap.add_argument("--diloco-h", type=int, default=10, help="the diloco row's steps per round")
    ap.add_argument("--diloco-only", action="store_true", help="the solo runs and the diloco row only")
    args = ap.parse_args()
    tmp, data = prepare(args.model, "sfb")
    from localcluster import LocalCluster

    out: dict = {"model": args.model, "steps": args.steps, "batch_per_rank": args.batch_size}
    (tmp / "cluster").mkdir()
    with LocalCluster(tmp / "cluster", coordinator_cpus=0) as c:
        c.start_coordinator()
        c.add_workers(["w1", "w2"])
        c.wait_nodes(["w1", "w2"])
        client = c.client()
        b = args.batch_size
        fast = throughput(client, spec(args, data, 1, b, "off", ["w1"]))
        delay = (args.slower - 1) / fast["samples_per_s"]  # c per sample already; add (slower - 1) c
        fault = tmp / "cluster" / "node-w2" / "node" / "fault-sample-delay-s"
        fault.parent.mkdir(parents=True, exist_ok=True)
        fault.write_text(f"{delay:.6f}")
        slow = throughput(client, spec(args, data, 1, b, "off", ["w2"]))
        if not args.diloco_only:
            out["off"] = throughput(client, spec(args, data, 2, b, "off", ["w1", "w2"]))
            out["auto"] = throughput(client, spec(args, data, 2, b, "auto", ["w1", "w2"]))
        out["diloco_by_speed"] = whole_run(client, diloco(args, data, b))
    solo_sum = fast["samples_per_s"] + slow["samples_per_s"]
    out.update(delay_s_per_sample=delay, solo_w1=fast, solo_w2=slow,
               measured_slowdown=fast["samples_per_s"] / slow["samples_per_s"],
               diloco_over_solo_sum=out["diloco_by_speed"]["samples_per_s"] / solo_sum,
               # the same measure on both sides: every step's rows over first to last step
               diloco_over_solo_sum_whole_run=out["diloco_by_speed"]["samples_per_s"]
               / (fast["whole_run_samples_per_s"] + slow["whole_run_samples_per_s"]))
    if not args.diloco_only:
        out.update(auto_over_off=out["auto"]["samples_per_s"] / out["off"]["samples_per_s"],
                   auto_over_solo_sum=out["auto"]["samples_per_s"] / solo_sum)
    print(json.dumps(out, indent=1))
    print(f"\nw2 {out['measured_slowdown']:.2f}x slower than w1 (solo: {fast['samples_per_s']:.1f} and "
          f"{slow['samples_per_s']:.1f} samples/s)")
    print(f"pair, diloco, inner steps by speed (H {args.diloco_h}): {out['diloco_by_speed']['samples_per_s']:.1f} "
          f"samples/s; / (solo w1 + solo w2) = {out['diloco_over_solo_sum']:.2f} (goal >= 0.85); against the "
          f"solo runs' whole-run rates {out['diloco_over_solo_sum_whole_run']:.2f}")
    if args.diloco_only:
        return
    off, auto = out["off"], out["auto"]
    print(f"pair, equal slices (off): {off['samples_per_s']:.1f} samples/s")
    print(f"pair, balanced (auto):    {auto['samples_per_s']:.1f} samples/s, rows per rank {auto['rows']} "
          f"on {auto['nodes']}")
    print(f"auto / off = {out['auto_over_off']:.2f} (goal >= 1.4); auto / (solo w1 + solo w2) = "
          f"{out['auto_over_solo_sum']:.2f} (goal >= 0.85)")


if __name__ == "__main__":
    main()
