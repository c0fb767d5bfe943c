"""The Wi-Fi case: data-parallel strategies across links capped like home Wi-Fi (netlab, root only).

A real cluster across network namespaces (tests/netlab.py): the coordinator, w1 and w2 each in its
own namespace, every node's upload capped with `tc tbf` at each rate given (Mbit/s). For each
strategy (ddp, zero1, diloco fp32, diloco int8, async-ps int8) one 2-worker job with the same model, data, batch
and steps. Time to a target loss: the train loss (rank 0's, smoothed by an EMA over steps) against
wall-clock time from the job's first step; the target is the worst final smoothed loss among the
strategies at that rate, so every strategy reaches it. Printed per rate and strategy: seconds to the
target, its ratio to ddp's, bytes each rank handed to collectives, and the final eval loss.

    .venv/bin/python bench/wifi.py [--rates 100,20 --model small-llama --peft lora --steps 120 --only ...]

Goals: diloco reaches the target >= 5x sooner than ddp at 20 Mbit/s (issue 11); async-ps int8 against
ddp and diloco there (issue 12).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
from dp_step_time import prepare  # noqa: E402  (offline env, temp dir, preset, data)


def job(args, data: Path, strategy: str, config: dict) -> dict:
    peft = {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0} if args.peft == "lora" else {"method": "none"}
    return {"kind": "data_parallel", "num_workers": 2, "strategy": strategy, "strategy_config": config,
            "max_retries": 0, "allowed_nodes": ["w1", "w2"],
            "train": {"model": args.model, "data": {"path": str(data), "max_length": args.max_length,
                                                    "max_eval_samples": 32},
                      "max_steps": args.steps, "batch_size": args.batch_size, "eval_accuracy": False,
                      "save_every": 0, "seed": 0, "lr": args.lr, "log_every": 1, "peft": peft}}


def smoothed(rows: list[dict], alpha: float = 0.1) -> list[tuple[float, float]]:
    """(ts, EMA of the loss) per step, in step order."""
    out, ema = [], None
    for r in sorted(rows, key=lambda r: r["step"]):
        ema = r["value"] if ema is None else alpha * r["value"] + (1 - alpha) * ema
        out.append((r["ts"], ema))
    return out


def run(client, spec: dict, timeout_s: float = 7200) -> dict:
    job_id = client.submit_job(spec)
    st = client.wait_for_job(job_id, timeout=timeout_s)
    if st["state"] != "completed":
        raise SystemExit(f"job {job_id} {st['state']}: {st['error']}")
    res = st["result"]
    res["curve"] = smoothed(client.job_metrics(job_id, "loss"))
    res["t0"] = res.get("first_step_ts") or res["curve"][0][0]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100,20", help="link caps in Mbit/s, comma-separated")
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--peft", choices=["lora", "none"], default="lora", help="none: full fine-tuning")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated subset, e.g. diloco-int8,async-ps-int8")
    args = ap.parse_args()
    import netlab
    from netlab import NetCluster, Netlab

    reason = netlab.available()
    if reason:
        raise SystemExit(f"netlab unavailable: {reason}")
    tmp, data = prepare(args.model, "sfw")
    outer = {"inner_steps": args.inner_steps, "outer_lr": 1.0, "outer_momentum": 0.5}
    strategies = {"ddp": ("ddp", {}), "zero1": ("zero1", {}), "diloco-fp32": ("diloco", outer),
                  "diloco-int8": ("diloco", {**outer, "codec": "int8"}),
                  "async-ps-int8": ("async-ps", {"codec": "int8"})}
    if args.only:  # ddp stays: the ratios' baseline
        strategies = {k: v for k, v in strategies.items() if k == "ddp" or k in args.only.split(",")}
    report: dict = {"args": vars(args), "rates": {}}
    for rate in [float(r) for r in args.rates.split(",")]:
        lab = Netlab(rate)
        (tmp / f"cluster-{rate:g}").mkdir()
        with lab, NetCluster(lab, tmp / f"cluster-{rate:g}", coordinator_cpus=0) as c:
            c.start_coordinator()
            c.add_workers(["w1", "w2"])
            c.wait_nodes(["w1", "w2"])
            client = c.client()
            results = {name: run(client, job(args, data, s, cfg)) for name, (s, cfg) in strategies.items()}
        target = max(r["curve"][-1][1] for r in results.values())
        rows = {}
        for name, r in results.items():
            reached = next((ts for ts, loss in r["curve"] if loss <= target), r["curve"][-1][0])
            rows[name] = {"seconds_to_target": reached - r["t0"], "median_step_s": r["median_step_s"],
                          "comm_bytes_sent_per_rank": r["comm_bytes_sent_per_rank"],
                          "eval_loss": r["eval_loss"], "final_smoothed_loss": r["curve"][-1][1],
                          "rounds": r.get("rounds")}
        for row in rows.values():
            row["vs_ddp"] = rows["ddp"]["seconds_to_target"] / max(row["seconds_to_target"], 1e-9)
        report["rates"][f"{rate:g}"] = {"target_loss": target, "strategies": rows}
        print(f"\n{rate:g} Mbit/s per link, target smoothed train loss {target:.4f}")
        print(f"{'strategy':<13} {'s to target':>11} {'ddp / it':>9} {'step s':>7} {'MB sent/rank':>13} {'eval loss':>9}")
        for name, row in rows.items():
            print(f"{name:<13} {row['seconds_to_target']:>11.1f} {row['vs_ddp']:>8.2f}x {row['median_step_s']:>7.3f} "
                  f"{max(row['comm_bytes_sent_per_rank']) / 1e6:>13.2f} {row['eval_loss']:>9.4f}")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
