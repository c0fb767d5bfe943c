"""Parameter servers with one worker 3x slower: samples/s of ssp, sync-ps and async-ps ÷ DDP's.

A real cluster of processes on this machine (coordinator + workers w1 and w2, one CPU each; the
coordinator lends none). w2 is made `--slower` times slower than w1 by fault injection (it sleeps
per sample in every forward; the delay is set from w1's measured solo speed, as bench/balance.py
does). Measured in the same run, same data, global batch and samples: ddp (equal slices: `balance
off`, and speed-balanced: `auto`), ssp (K = 2), sync-ps, async-ps. Printed per strategy: samples/s
(the job's samples over rank 0's first to last step) ÷ ddp's, and eval loss ÷ ddp's.

    .venv/bin/python bench/param_servers.py [--model small-llama --steps 60 --batch-size 4]

Goals (issue 12): async-ps >= 1.5x ddp, ssp >= 1.3x ddp, each at an eval loss within 3% of ddp's.
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


def spec(args, data: Path, workers: int, strategy: str, config: dict, balance: str, nodes: list[str]) -> dict:
    return {"kind": "data_parallel", "num_workers": workers, "balance": balance, "allowed_nodes": nodes,
            "strategy": strategy, "strategy_config": config,
            "train": {"model": args.model, "data": {"path": str(data), "max_length": args.max_length,
                                                    "max_eval_samples": 64},
                      "max_steps": args.steps, "batch_size": args.batch_size, "eval_accuracy": False,
                      "save_every": 0, "seed": 0, "lr": 1e-3,
                      "peft": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0}}}


def run(client, job: dict) -> dict:
    job_id = client.submit_job(job)
    st = client.wait_for_job(job_id, timeout=3600, poll=0.5)
    if st["state"] != "completed":
        raise SystemExit(f"job {job_id} {st['state']}: {st['error']}")
    res = st["result"]
    samples = job["train"]["max_steps"] * job["train"]["batch_size"] * job["num_workers"]
    return {"samples_per_s": samples * (1 - 1 / max(2, res["steps"])) / res["train_s"],
            "eval_loss": res["eval"]["eval_loss"], "nodes": res["nodes"],
            "parts_per_rank": res.get("parts_done_per_rank"), "staleness_max": res.get("staleness_max_per_rank"),
            "dropped": res.get("dropped_per_rank"), "bytes_sent_per_rank": res["comm_bytes_sent_per_rank"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--slower", type=float, default=3.0, help="how much slower w2 is")
    args = ap.parse_args()
    tmp, data = prepare(args.model, "sfp")
    from localcluster import LocalCluster

    out: dict = {"model": args.model, "steps": args.steps, "batch_per_rank": args.batch_size, "slower": args.slower}
    (tmp / "cluster").mkdir()
    with LocalCluster(tmp / "cluster", coordinator_cpus=0) as c:
        c.start_coordinator()
        c.add_workers(["w1", "w2"])
        c.wait_nodes(["w1", "w2"])
        client = c.client()
        solo = run(client, spec(args, data, 1, "ddp", {}, "off", ["w1"]))
        per_sample = 1 / solo["samples_per_s"]
        fault = tmp / "cluster" / "node-w2" / "node" / "fault-sample-delay-s"
        fault.parent.mkdir(parents=True, exist_ok=True)
        fault.write_text(f"{(args.slower - 1) * per_sample:.6f}")
        pair = ["w1", "w2"]
        plan = [("ddp", "ddp", {}, "off"), ("ddp-balanced", "ddp", {}, "auto"),
                ("ssp", "ssp", {"staleness_bound": 2}, "off"), ("sync-ps", "sync-ps", {}, "off"),
                ("async-ps", "async-ps", {}, "off")]
        rows = {}
        for name, strategy, config, balance in plan:
            rows[name] = run(client, spec(args, data, 2, strategy, config, balance, pair))
            print(f"{name}: {rows[name]['samples_per_s']:.1f} samples/s, eval loss {rows[name]['eval_loss']:.4f}",
                  flush=True)
    ddp = rows["ddp"]
    for r in rows.values():
        r["samples_per_s_vs_ddp"] = round(r["samples_per_s"] / ddp["samples_per_s"], 3)
        r["eval_loss_vs_ddp"] = round(r["eval_loss"] / ddp["eval_loss"], 4)
    out.update(solo_w1_samples_per_s=solo["samples_per_s"], strategies=rows)
    print(json.dumps(out, indent=1))
    for name, r in rows.items():
        print(f"{name:13s} {r['samples_per_s_vs_ddp']:.2f}x ddp's samples/s, eval loss {r['eval_loss_vs_ddp']:.3f}x")
    print("goals: async-ps >= 1.5x, ssp >= 1.3x, eval loss within 3%")


if __name__ == "__main__":
    main()
