"""Serving across a capped link (netlab, root only): 2-stage generation and the placement rule.

A real cluster across network namespaces (tests/netlab.py): the coordinator (no CPUs lent: it runs
only the API) and workers w1 and w2, each in its own namespace, every node's upload capped with
`tc tbf` at --rate Mbit/s. Two serve jobs of the same model, one after the other, measured with
bench/serve.py's streams (greedy, tok/s = (n-1)/(t_last-t_first), one stream alone and eight at once),
the client in the coordinator's namespace as a user's would be on that machine:

- `stages: 2`: one stage on each worker, every token's hidden state crossing the capped link;
- `stages: auto`: the placement plan, from each worker's measured speed and memory, chooses; for a
  model that fits on one worker it keeps it there (a split adds a cut to every token).

Printed: both rates, the plan auto chose, and whether its choice was the faster one.

    .venv/bin/python bench/serve_wifi.py [--rate 100 --model llama-100m --max-tokens 32 --threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
sys.path.insert(0, str(ROOT / "tests" / "serve"))
from dp_step_time import prepare  # noqa: E402  (offline env, temp dir, preset built outside the timings)
from serve import measure, printable  # noqa: E402


def serve_job(client, spec: dict, timeout_s: float = 900) -> tuple[str, list[dict]]:
    """Submit a serve job; its id and events once it serves."""
    job_id = client.submit_job(spec)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        events = client.job_events(job_id)
        if any(e["kind"] == "serving" for e in events):
            return job_id, events
        st = client.get_job_status(job_id)
        if st["state"] not in ("pending", "running"):
            raise SystemExit(f"serve job {job_id} {st['state']}: {st.get('error')}")
        time.sleep(1)
    raise SystemExit(f"serve job {job_id} did not start in {timeout_s} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=100, help="link cap in Mbit/s")
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="CPUs per stage (and per worker)")
    args = ap.parse_args()
    import netlab
    from localcluster import free_port
    from netlab import NetCluster, Netlab

    reason = netlab.available()
    if reason:
        raise SystemExit(f"netlab unavailable: {reason}")
    tmp, _ = prepare(args.model, "sfsw")
    from smolforge.models.tiny import is_preset, preset_dir

    models = tmp / "models"  # what the workers hold (--models-dir): the model with a tokenizer that prints every id
    models.mkdir()
    src = Path(printable(str(preset_dir(args.model)) if is_preset(args.model) else args.model, models)).resolve()
    model = src.name
    if not (models / model).exists():
        (models / model).symlink_to(src)
    lab = Netlab(args.rate)
    results = {}
    (tmp / "cluster").mkdir()
    with lab, NetCluster(lab, tmp / "cluster", coordinator_cpus=0) as c:
        c.start_coordinator()
        c.add_workers(["w1", "w2"], cpus=args.threads, models_dir=models)
        c.wait_nodes(["w1", "w2"])
        client = c.client()
        for name, stages in (("2 stages", 2), ("auto", "auto")):
            port = free_port()
            spec = {"kind": "serve", "model": model, "stages": stages, "port": port, "model_name": "bench",
                    "cpus_per_stage": args.threads, "max_batch": 8}
            job_id, events = serve_job(client, spec)
            try:
                plan = next(e for e in events if e["kind"] == "plan")
                rates = measure(f"http://127.0.0.1:{port}", c.token, args.max_tokens,
                                where=lambda: lab.inside("coord"))
                results[name] = {**rates, "plan": plan["message"], "kept_on_one_node": plan["data"]["kept_on_one_node"],
                                 "nodes": plan["data"]["nodes"], "bounds": plan["data"]["bounds"]}
            finally:
                client.cancel_job(job_id)
                deadline = time.time() + 60
                while time.time() < deadline and client.get_job_status(job_id)["state"] != "cancelled":
                    time.sleep(0.5)
    two, auto = results["2 stages"], results["auto"]
    right = (auto["one_stream_tok_s"] >= two["one_stream_tok_s"]) == auto["kept_on_one_node"]
    print(f"{args.model} on netlab, {args.rate:g} Mbit/s per node, {args.threads} CPU(s) per stage, greedy, "
          f"{args.max_tokens} new tokens")
    print(f"{'':<28} {'2 stages':>9} {'auto':>9} {'auto/2':>7}")
    for key, label in (("one_stream_tok_s", "1 stream tok/s (median)"), ("one_stream_ttft_s", "1 stream TTFT s"),
                       ("eight_streams_tok_s", "8 streams aggregate tok/s")):
        print(f"{label:<28} {two[key]:>9.3f} {auto[key]:>9.3f} {auto[key] / two[key]:>7.2f}")
    print(f"auto's plan:\n{auto['plan']}")
    print(f"placement rule {'kept the model on one node' if auto['kept_on_one_node'] else 'split the model'}; "
          f"that was {'the faster choice' if right else 'NOT the faster choice'} for one stream")
    print(json.dumps({"args": vars(args), "results": results, "auto_choice_was_faster": right}))


if __name__ == "__main__":
    main()
