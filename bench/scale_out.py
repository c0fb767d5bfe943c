"""Does a second machine make the job finish sooner? One node against two on netlab links (issue 45, item 1).

A real cluster across network namespaces (tests/netlab.py: coordinator, w1, w2, each node's upload capped
with `tc tbf`; this kernel has no `tc netem`, so no added round-trip latency: the queue's own delay only).
Each worker lends one CPU (its ranks run one thread, OMP_NUM_THREADS=1), so two nodes use the machine's two
cores and one node uses one. Per link and workload:

- **one node**: a 1-worker job for `--steps` N steps, held-out loss every `--eval-every` steps on the same
  rows; its last eval loss is the **target**, its time from first step to that eval the one-node time.
  Every time here is training time: the wall time less the evaluations' own seconds (`time_to`; each
  eval event carries its `eval_s`), so the figure does not depend on the cadence, and a two-node run,
  which reaches the target between two evals, is timed to within `--eval-every` steps of the crossing
  (the wall times with the evals are in each row's detail).
- **the ideal, measured here**: two independent 1-worker jobs at once (w1 and w2) against one alone; they
  share the machine's memory and caches, so each is slower than alone: ideal = 2 × (alone's step time ÷
  together's), measured once (at the first link) and used for every row.
- **two nodes**: `auto`, ddp, diloco int8, diloco int4 and (where diloco has it) diloco sparse, each a 2-worker job with
  the same per-rank batch, up to N steps; the time from its first step to the first eval at or under the
  target. DDP at a slow link on a large model would take hours: with `--ddp-steps K` it runs K steps and
  its time is extrapolated (its median step time × the step at which the quickest two-node run reached the
  target: an assumption, that ddp over the same global batch needs no more steps), said in its row;
  where auto chose that very plan (ddp on a fast link), auto's full run is its measurement instead.

Printed with `--json`: one JSON object per line, per link and workload, with `workload`, `link_mbit`,
`speedup` (one node's time ÷ auto's), `ideal`, `efficiency` (speedup ÷ ideal), `bytes_per_sync` (auto's,
per node), `model_bytes` (fp32), `utilisation` (auto's rank 0: 1 − its collective waits ÷ its training
time), `target_loss`, `auto_vs_best` (the best hand-picked strategy's time ÷ auto's), `baselines` (each
hand-picked strategy's speedup) and `detail` (per run: seconds, eval losses, what auto chose and why).

    .venv/bin/python bench/scale_out.py --json            # the issue's run: llama-100m full, LoRA on the 0.5B twin
    .venv/bin/python bench/scale_out.py --json --quick    # tiny-llama, few steps: the whole path in minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
from dp_step_time import prepare  # noqa: E402  (offline env, temp dir, preset, data)

LORA = {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0}
WORKLOADS = {  # name: (model, peft, dtype, lr)
    "llama-100m-full": ("llama-100m", {"method": "none"}, "fp32", 1e-4),
    "qwen2.5-0.5b-lora": ("twin:qwen2.5-0.5b-instruct@full", LORA, "bf16", 1e-3),
    "tiny-llama-full": ("tiny-llama", {"method": "none"}, "fp32", 1e-3),  # --quick
    "tiny-llama-lora": ("tiny-llama", LORA, "fp32", 1e-3),  # --quick
}


def spec(args, data: Path, workload: str, workers: int, nodes: list[str], strategy: str, config: dict,
         steps: int | None = None) -> dict:
    model, peft, dtype, lr = WORKLOADS[workload]
    return {"kind": "data_parallel", "num_workers": workers, "strategy": strategy, "strategy_config": config,
            "max_retries": 0, "allowed_nodes": nodes,
            "train": {"model": model, "data": {"path": str(data), "max_length": args.max_length,
                                               "max_eval_samples": args.eval_rows, "eval_fraction": 0.1},
                      "max_steps": steps or args.steps, "batch_size": args.batch_size, "dtype": dtype,
                      "eval_every": args.eval_every, "eval_accuracy": False, "save_every": 0, "seed": 0,
                      "lr": lr, "log_every": 1, "peft": peft}}


def submit(client, job: dict) -> str:
    return client.submit_job(job)


def finish(client, job_id: str, timeout_s: float = 4 * 3600) -> dict:
    """The job's result, its eval curve [(ts, step, eval_loss, eval_s)] and auto's plan (None for another strategy)."""
    st = client.wait_for_job(job_id, timeout=timeout_s, poll=1.0)
    if st["state"] != "completed":
        raise SystemExit(f"job {job_id} {st['state']}: {st['error']}")
    res = dict(st["result"])
    events = client.job_events(job_id)
    res["evals"] = sorted((d["ts"], d.get("step"), d["eval_loss"], d.get("eval_s", 0.0))  # (ts, step, loss, its s)
                          for d in (e.get("data") or {} for e in events if e["kind"] == "eval")
                          if d.get("eval_loss") is not None)
    res["plan"] = next((e["data"] for e in events if e["kind"] == "strategy_plan"), None)
    return res


def time_to(res: dict, target: float, with_evals: bool = False) -> float | None:
    """Seconds of training from the job's first step to its first eval at or under `target` (None: never
    reached): the wall time to that eval's end less every evaluation's own seconds up to it (`eval_s`,
    rank 0's): the evaluations are the instrument, not the job, and they cost each run differently (a
    two-node run evaluates half the rows on each rank), so leaving them out makes the figure the same
    at any `--eval-every`, and a finer cadence only sharpens when the target was crossed. With
    `with_evals`, the wall time itself."""
    spent = 0.0
    for ts, _, loss, eval_s in res["evals"]:
        spent += eval_s
        if loss <= target + 1e-9:
            return ts - res["first_step_ts"] - (0.0 if with_evals else spent)
    return None


def measure_ideal(client, args, data: Path, workload: str) -> dict:
    """2 × (one job alone's median step ÷ the same job's with a second one beside it on the other core)."""
    alone = finish(client, submit(client, spec(args, data, workload, 1, ["w1"], "ddp", {}, args.ideal_steps)))
    ids = [submit(client, spec(args, data, workload, 1, [n], "ddp", {}, args.ideal_steps)) for n in ("w1", "w2")]
    together = [finish(client, i) for i in ids]
    ratio = sum(alone["median_step_s"] / t["median_step_s"] for t in together) / len(together)
    return {"ideal": 2 * ratio, "alone_step_s": alone["median_step_s"],
            "together_step_s": [t["median_step_s"] for t in together]}


def hand_picked(args, sparse: bool) -> dict[str, tuple[str, dict]]:
    from smolforge.parallel.auto_choice import FRAGMENTS, SHORT_OUTER, STREAMED_MERGE

    outer = {"inner_steps": args.inner_steps}
    picks = {"ddp": ("ddp", {}), "diloco-int8": ("diloco", {**outer, "codec": "int8"}),
             "diloco-int8-damped": ("diloco", {**outer, "codec": "int8", **SHORT_OUTER}),  # auto's short-run step
             "diloco-int4": ("diloco", {**outer, "codec": "int4"}),
             # Streaming DiLoCo at the same H: auto's fragments (4), each sent behind one step (τ 1), merged as
             # the paper mixes (local <- 0.5 local + 0.5 global) or as auto merges (global + the step's progress)
             "diloco-int8-streamed": ("diloco", {**outer, "codec": "int8", "fragments": FRAGMENTS, "overlap": 1}),
             "diloco-int8-streamed-delta": ("diloco", {**outer, "codec": "int8", "fragments": FRAGMENTS, "overlap": 1,
                                                       "merge": STREAMED_MERGE})}
    if sparse:
        picks["diloco-sparse"] = ("diloco", {**outer, "codec": "sparse"})
    return picks


def two_node_runs(client, args, data: Path, workload: str, target: float, sparse: bool) -> dict[str, dict]:
    """auto and each hand-picked strategy on w1 + w2: seconds to the target, and how they got there."""
    runs = {"auto": ("auto", {})} | hand_picked(args, sparse)
    if args.runs:  # a subset (`--runs auto`): the rows' ratios then cover only these
        runs = {k: v for k, v in runs.items() if k in args.runs.split(",")}
    out = {}
    for name, (strategy, config) in runs.items():
        short = name == "ddp" and args.ddp_steps
        res = finish(client, submit(client, spec(args, data, workload, 2, ["w1", "w2"], strategy, config,
                                                 args.ddp_steps if short else None)))
        reached_at = next((step for _, step, loss, _ in res["evals"] if loss <= target + 1e-9), None)
        out[name] = {"seconds": None if short else time_to(res, target), "extrapolated": bool(short),
                     "seconds_with_evals": None if short else time_to(res, target, with_evals=True),
                     "target_step": None if short else reached_at,
                     "median_step_s": res["median_step_s"], "eval_losses": [round(x[2], 4) for x in res["evals"]],
                     "bytes_sent_per_rank": res.get("comm_bytes_sent_per_rank"), "rounds": res.get("rounds"),
                     "wait_s_per_rank": res.get("comm_wait_s_per_rank"), "train_s": res.get("train_s"),
                     "plan": res["plan"], "steps": res["steps"]}
    adopt_autos_run(out, runs)
    reached = [r for r in out.values() if r["seconds"] is not None and not r["extrapolated"]]
    for r in out.values():  # ddp's from its step time × the step at which the quickest run reached the target
        if r["extrapolated"] and reached:  # (not its seconds ÷ its median step: a diloco step's median leaves
            best = min(reached, key=lambda x: x["seconds"])  # its syncs out: 1.7x ddp's steps on llama-100m)
            r["seconds"] = r["median_step_s"] * best["target_step"]
    return out


def adopt_autos_run(out: dict[str, dict], runs: dict[str, tuple[str, dict]]) -> None:
    """A hand-picked run that was only extrapolated (`--ddp-steps`) takes auto's full run as its measurement
    where auto's plan is that very strategy and config (ddp on a fast link): the same job run in full beats
    an estimate from a few steps (which leaves out the evals' waits and a job's start, so it read 0.91 of
    auto's time for what was auto's own plan: LoRA on the 0.5B twin at 1 Gbit/s, stop 59)."""
    auto = out.get("auto") or {}
    plan = auto.get("plan") or {}
    for name, (strategy, config) in runs.items():
        r = out.get(name)
        if name != "auto" and r and r["extrapolated"] and (plan.get("strategy"), plan.get("config")) == (strategy, config):
            r.update(seconds=auto["seconds"], extrapolated=False, target_step=auto["target_step"],
                     seconds_with_evals=auto.get("seconds_with_evals"), measured_by="auto's run (the same plan)")


def row(workload: str, link: float, one: dict, target: float, runs: dict, ideal: dict) -> dict:
    """The issue's keys for one link and workload."""
    one_s = time_to(one, target)
    speed = {k: (one_s / r["seconds"] if r["seconds"] else 0.0) for k, r in runs.items()}
    auto = runs["auto"]
    picked = [r["seconds"] for k, r in runs.items() if k != "auto" and r["seconds"]]
    rounds = auto["rounds"] or auto["steps"]
    sent = max(auto["bytes_sent_per_rank"] or [0])
    util = 1 - (auto["wait_s_per_rank"] or [0])[0] / auto["train_s"] if auto["train_s"] else None  # rank 0's
    return {"workload": workload, "link_mbit": link, "speedup": round(speed["auto"], 3),
            "ideal": round(ideal["ideal"], 3), "efficiency": round(speed["auto"] / ideal["ideal"], 3),
            "bytes_per_sync": int(sent / max(rounds, 1)), "model_bytes": int(one["total_params"]) * 4,
            "utilisation": round(util, 3) if util is not None else None, "target_loss": round(target, 4),
            "auto_vs_best": round(min(picked) / auto["seconds"], 3) if picked and auto["seconds"] else None,
            "baselines": {k: round(v, 3) for k, v in speed.items() if k != "auto"},
            "detail": {"one_node_s": one_s, "one_node_s_with_evals": time_to(one, target, with_evals=True),
                       "one_node_evals": [round(x[2], 4) for x in one["evals"]],
                       "ideal": ideal, "runs": runs, "netem": False}}


def plan_only(args, workloads: list[str]) -> None:
    """What `auto` decides for each workload at each link, without training: two ranks in netlab namespaces
    run the probe and the decision (tests/cluster/test_auto_netlab.py's worker); minutes, not hours."""
    import subprocess

    from netlab import IFACE, Netlab

    worker = str(ROOT / "tests" / "cluster" / "test_auto_netlab.py")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": IFACE, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    for link in [float(x) for x in args.links.split(",")]:
        with Netlab(link, names=("w1", "w2")) as lab:
            for i, workload in enumerate(workloads):
                model, peft, dtype, _ = WORKLOADS[workload]
                procs = [lab.popen(node, [sys.executable, worker, "auto-worker", str(rank), lab.addr("w1"),
                                          str(29541 + i), model, peft["method"], dtype, str(args.steps)], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                         for rank, node in enumerate(("w1", "w2"))]
                outs = [p.communicate(timeout=900)[0] for p in procs]
                line = [x for x in outs[0].splitlines() if x.startswith("{")]
                if not line:
                    raise SystemExit(f"{workload} at {link:g} Mbit/s: the probe failed:\n{outs[0][-3000:]}")
                d = json.loads(line[-1])["decision"]
                print(json.dumps({"workload": workload, "link_mbit": link, "auto": d["strategy"],
                                  "config": d["config"], "reason": d["reason"], "numbers": d["numbers"]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per line (else a table)")
    ap.add_argument("--quick", action="store_true", help="tiny-llama full fine-tuning, few steps: the path end to end")
    ap.add_argument("--links", default="1000,20", help="link caps in Mbit/s, comma-separated")
    ap.add_argument("--workloads", default=None, help=f"comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument("--steps", type=int, default=None, help="N: the one-node run's steps (default 200; quick 12)")
    ap.add_argument("--eval-every", type=int, default=None, help="default 5; quick 3 (evals are left out "
                    "of the times: a finer cadence costs the benchmark's wall time only)")
    ap.add_argument("--eval-rows", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=None, help="rows per rank (default 8; quick 4)")
    ap.add_argument("--max-length", type=int, default=None, help="default 256; quick 64")
    ap.add_argument("--inner-steps", type=int, default=None, help="the hand-picked diloco's H (default 20; quick 3)")
    ap.add_argument("--ddp-steps", type=int, default=None, help="K: ddp runs K steps, its time extrapolated "
                    "(default 3; quick 0 = a full run)")
    ap.add_argument("--runs", default=None, help="only these two-node runs, comma-separated (auto, ddp, "
                    "diloco-int8, diloco-int8-damped, diloco-int4, diloco-int8-streamed, diloco-int8-streamed-delta, "
                    "diloco-sparse; default all)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (the clusters' state, checkpoints)")
    ap.add_argument("--plan-only", action="store_true", help="only what auto decides per workload and link "
                    "(the probe and the decision, no training)")
    ap.add_argument("--ideal-steps", type=int, default=None, help="steps of the ideal's jobs (default 10; quick 6)")
    args = ap.parse_args()
    if args.runs and "auto" not in args.runs.split(","):
        ap.error("--runs must include auto (every row is auto's, the others its baselines)")
    q = args.quick
    for key, full, quick in (("steps", 200, 12), ("eval_every", 5, 3), ("batch_size", 8, 4), ("max_length", 256, 64),
                             ("inner_steps", 20, 3), ("ddp_steps", 3, 0), ("ideal_steps", 10, 6)):
        if getattr(args, key) is None:
            setattr(args, key, quick if q else full)
    unknown = sorted(set((args.runs or "auto").split(",")) - {"auto", *hand_picked(args, sparse=True)})
    if unknown:
        ap.error(f"--runs: unknown {', '.join(unknown)} (known: auto, {', '.join(hand_picked(args, sparse=True))})")
    workloads = (args.workloads or ("tiny-llama-full" if q else "llama-100m-full,qwen2.5-0.5b-lora")).split(",")
    os.environ["OMP_NUM_THREADS"] = "1"
    import netlab
    from netlab import NetCluster, Netlab

    reason = netlab.available()
    if reason:
        raise SystemExit(f"netlab unavailable: {reason}")
    if args.plan_only:
        return plan_only(args, workloads)
    tmp, data = prepare("tiny-llama", "sfso")
    from smolforge.parallel.auto_probe import diloco_features

    sparse, ideal, ones, t_start = "sparse" in diloco_features(), {}, {}, time.time()
    for link in [float(x) for x in args.links.split(",")]:
        lab = Netlab(link, uncapped_to=("coord",))  # the link under test is w1 <-> w2's (module docstring)
        (tmp / f"cluster-{link:g}").mkdir()
        with lab, NetCluster(lab, tmp / f"cluster-{link:g}", coordinator_cpus=0) as c:
            c.start_coordinator()
            c.add_workers(["w1", "w2"])
            c.wait_nodes(["w1", "w2"])
            client = c.client()
            for workload in workloads:
                if workload not in ideal:
                    ideal[workload] = measure_ideal(client, args, data, workload)
                if workload not in ones:  # one node sends nothing over the link: its run is the same at every cap
                    ones[workload] = finish(client, submit(client, spec(args, data, workload, 1, ["w1"], "ddp", {})))
                one = ones[workload]
                target = one["evals"][-1][2]
                runs = two_node_runs(client, args, data, workload, target, sparse)
                out = row(workload, link, one, target, runs, ideal[workload])
                print(json.dumps(out) if args.json else
                      f"{workload} at {link:g} Mbit/s: speedup {out['speedup']}x of ideal {out['ideal']}x "
                      f"(efficiency {out['efficiency']}), auto_vs_best {out['auto_vs_best']}, "
                      f"baselines {out['baselines']}", flush=True)
    if not args.keep:  # every job's checkpoints and rank outputs (llama-100m full: GBs a job; 62 GB for two runs)
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"wall_s": round(time.time() - t_start, 1), "args": vars(args), "sparse_codec": sparse,
                      "netem": "none: this kernel has no tc netem (tbf queue delay only)",
                      "coordinator": "traffic to it uncapped (on one of the home machines)"}), flush=True)


if __name__ == "__main__":
    main()
