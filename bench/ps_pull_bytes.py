"""A parameter server's bytes per sync, push + pull, by codec, with the fp32 pull (`pull: full`) and the
compressed one (`pull: codec`, `parallel/strategies/ps_pull.py`).

In one process (tests/test_ps_inprocess.py's harness: the server core in this process, each worker a
thread running the training engine): sync-ps, two workers, every step's parts arriving, each worker
pulling every step. Printed per codec and pull: bytes a worker pushed and pulled per part (one part per
step each: a sync), their sum (each worker's first pull, the weights whole, spread over the run), the sum
past that first pull (`steady_bytes_per_sync`), the sum ÷ the fp32 job's, and the eval loss after `--steps`
steps. The job's final pull (the server's weights, whole) is not a sync and is left out.

    .venv/bin/python bench/ps_pull_bytes.py [--model tiny-llama --steps 20 --lr 1e-2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

RUNS = [("fp32", "full"), ("int8", "full"), ("int8", "codec"), ("sparse", "full"), ("sparse", "codec")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args()
    from test_ps_inprocess import GATE_S, run_ps  # the in-process harness (threads against one server)

    fp32 = None
    with tempfile.TemporaryDirectory() as tmp:
        for codec, pull in RUNS:
            config = {"deadline_s": GATE_S, "deadline_max_s": GATE_S, "codec": codec, "pull": pull}
            results, server, workers = run_ps(Path(tmp) / f"{codec}-{pull}", "sync-ps", config, model=args.model,
                                              max_steps=args.steps, lr=args.lr)
            parts = sum(w.n["parts"] for w in workers)
            # the final pull (the job's weights, fp32 whole) is not a sync: taken out
            final = 4 * int(server.flat.numel()) * len(workers)
            push = sum(w.bytes_sent for w in workers) / parts
            pulled = (sum(w.bytes_pulled for w in workers) - final) / parts
            # each worker's first pull is the weights whole (a keyframe, whatever the codec): past it, the steady rate
            steady = (sum(w.bytes_pulled for w in workers) - 2 * final) / (parts - len(workers))
            row = {"codec": codec, "pull": pull, "trainable_params": int(server.flat.numel()),
                   "push_bytes_per_sync": round(push), "pull_bytes_per_sync": round(pulled),
                   "bytes_per_sync": round(push + pulled), "steady_bytes_per_sync": round(push + steady),
                   "keyframes": server.pulls.n["pull_keyframes"],
                   "eval_loss": round(results[0].eval["eval_loss"], 4)}
            fp32 = fp32 or row["bytes_per_sync"]
            row["vs_fp32"] = round(row["bytes_per_sync"] / fp32, 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
