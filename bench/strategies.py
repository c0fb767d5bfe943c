"""Data-parallel strategies side by side: 2 workers, the same model, data, per-rank batch and steps.

For each strategy (ddp, zero1, fsdp, diloco fp32 and int8, ssp, sync-ps, async-ps fp32 and int8) one
job on an embedded cluster of this machine, against plain torchrun DDP (same engine, no Ray) measured
in the same run. Printed per strategy, as ratios to the baselines: samples/s ÷ torchrun DDP's; bytes
sent per rank per sample (collectives, or pushes to a parameter server), peak RSS and optimizer state
per rank ÷ our DDP's; eval loss at equal samples.

    .venv/bin/python bench/strategies.py [--model small-llama --steps 100 --peft lora|none --inner-steps 20 --only fsdp]

Goals (issue 11): zero1 step <= 1.15x DDP with optimizer state <= 0.55x; diloco bytes <= 1/100 of
DDP's (H = 100, int8) with the final loss within 2%; fsdp peak memory per rank <= 0.6x DDP's for
full fine-tuning of llama-100m.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_step_time import prepare, run_torchrun  # noqa: E402  (the same baseline as the step-time benchmark)


def train_cfg(args, data: str) -> dict:
    peft = {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0} if args.peft == "lora" else {"method": "none"}
    return {"model": args.model, "data": {"path": data, "max_length": args.max_length, "max_eval_samples": 64},
            "max_steps": args.steps, "batch_size": args.batch_size, "eval_accuracy": False, "save_every": 0,
            "quiet": True, "tensorboard": False, "num_threads": 1, "seed": 0, "lr": args.lr, "peft": peft}


def run_strategy(args, cluster, data: str, strategy: str, config: dict) -> dict:
    spec = {"kind": "data_parallel", "num_workers": 2, "strategy": strategy, "strategy_config": config,
            "train": train_cfg(args, data)}
    t0 = time.time()
    st = cluster.wait_for_job(cluster.submit_job(spec), timeout=3600)
    if st["state"] != "completed":
        raise SystemExit(f"{strategy} job {st['state']}: {st['error']}")
    res = st["result"]
    res["wall_s"] = time.time() - t0
    return res


def samples_per_s(args, r: dict) -> float:
    """Samples trained per second between rank 0's first and last step (a parameter server's rank 0 takes
    parts, not whole steps: the job's samples over the same span)."""
    return args.steps * args.batch_size * 2 * (1 - 1 / max(2, r["steps"])) / r["train_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--peft", choices=["lora", "none"], default="lora", help="none: full fine-tuning")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--inner-steps", type=int, default=20, help="diloco's H")
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.5)
    ap.add_argument("--only", default="", help="comma-separated subset, e.g. fsdp,zero1 (ddp always runs)")
    args = ap.parse_args()
    tmp, data = prepare(args.model, "sfs")
    from smolforge.cluster.embedded import EmbeddedCluster

    outer = {"inner_steps": args.inner_steps, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    plan = [("ddp", "ddp", {}), ("zero1", "zero1", {}), ("fsdp", "fsdp", {}), ("diloco-fp32", "diloco", outer),
            ("diloco-int8", "diloco", {**outer, "codec": "int8"}), ("ssp", "ssp", {"staleness_bound": 2}),
            ("sync-ps", "sync-ps", {}), ("async-ps", "async-ps", {}), ("async-ps-int8", "async-ps", {"codec": "int8"})]
    if args.only:  # ddp stays: it is every ratio's baseline
        plan = [p for p in plan if p[0] == "ddp" or p[0] in args.only.split(",")]
    torchrun_step, _ = run_torchrun(train_cfg(args, str(data)), tmp, 0)
    cluster = EmbeddedCluster(state_dir=tmp / "state", num_cpus=2)
    results = {}
    try:
        for name, strategy, config in plan:
            results[name] = run_strategy(args, cluster, str(data), strategy, config)
            r = results[name]
            print(f"{name}: {samples_per_s(args, r):.1f} samples/s, eval loss {r['eval']['eval_loss']:.4f}, "
                  f"{max(r['comm_bytes_sent_per_rank']) / 1e6:.2f} MB sent per rank", flush=True)
    finally:
        cluster.close()
    ddp = results["ddp"]
    samples = args.steps * args.batch_size * 2
    table = {}
    for name, r in results.items():
        table[name] = {
            "samples_per_s": round(samples_per_s(args, r), 2),
            "samples_per_s_vs_torchrun_ddp": round(samples_per_s(args, r) * torchrun_step / (2 * args.batch_size), 3),
            "bytes_per_rank_per_sample": round(max(r["comm_bytes_sent_per_rank"]) / samples),
            "bytes_vs_ddp": round(max(r["comm_bytes_sent_per_rank"]) / max(ddp["comm_bytes_sent_per_rank"]), 4),
            "peak_rss_vs_ddp": round(max(r["peak_rss_mb_per_rank"]) / max(ddp["peak_rss_mb_per_rank"]), 3),
            "peak_rss_mb_per_rank": [round(m) for m in r["peak_rss_mb_per_rank"]],
            "optimizer_state_vs_ddp": round(max(r["optimizer_state_bytes_per_rank"])
                                            / max(ddp["optimizer_state_bytes_per_rank"]), 3),  # a server's is 0
            "eval_loss": round(r["eval"]["eval_loss"], 4),
            "eval_loss_vs_ddp": round(r["eval"]["eval_loss"] / ddp["eval"]["eval_loss"], 4),
            "rounds": r.get("rounds"),
        }
    print(json.dumps({"model": args.model, "peft": args.peft, "steps": args.steps, "batch_per_rank": args.batch_size,
                      "ranks": 2, "torchrun_ddp_ms_per_step": round(torchrun_step * 1000, 1),
                      "diloco": outer, "strategies": table}, indent=2))


if __name__ == "__main__":
    main()
