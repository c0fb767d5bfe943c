"""Serving under load: Poisson arrivals against the generation engine, time to first token and throughput.

One process, no HTTP (the engine is what schedules): --requests requests with prompts of
--prompt-min..--prompt-max tokens and answers of --answer-min..--answer-max tokens (EOS switched
off, so every answer is its length), a third of them starting with the same --shared-token system
prompt. Capacity is measured first (every request at once, the per-step engine); then, per --loads
fraction of it, the same Poisson arrival trace is played against the per-step engine (continuous
batching, prefix cache) and, on the torch engine, against static batching (a batch runs until its
longest answer ends: the engine before issue 44), in one run.

Prints one JSON object per line, per engine, schedule and load: `engine`, `schedule`, `load`,
`ttft_p50_s`, `ttft_p99_s`, `tokens_per_s`, and on the per-step rows of the torch engine
`ttft_p99_ratio_vs_static` (static p99 / per-step p99: how many times better).
llama.cpp's own `llama-server` as the peer (issue 44 item 8) is not run yet.

    .venv/bin/python bench/serve_load.py --model small-llama --requests 60 --prompt-max 200 \
        --answer-max 96 --shared 120 --threads 2 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import threading
import time
from typing import Any


@dataclasses.dataclass
class Work:
    """One request of the trace: its prompt ids, its answer length and its arrival (s after the start)."""

    ids: list[int]
    answer: int
    at: float = 0.0


def workload(args: argparse.Namespace, vocab: int) -> list[Work]:
    """The requests, seeded: a third begin with the shared system prompt."""
    rng = random.Random(args.seed)
    system = [rng.randrange(10, vocab) for _ in range(args.shared)]
    work = []
    for i in range(args.requests):
        n = rng.randint(args.prompt_min, args.prompt_max)
        if i % 3 == 0:
            n = max(n, args.shared + args.prompt_min)
            ids = system + [rng.randrange(10, vocab) for _ in range(n - args.shared)]
        else:
            ids = [rng.randrange(10, vocab) for _ in range(n)]
        work.append(Work(ids, rng.randint(args.answer_min, args.answer_max)))
    return work


def play(engine: Any, work: list[Work]) -> dict[str, float]:
    """Submit each request at its arrival; TTFT percentiles and output tokens/s over the whole run."""
    from smolforge.serve.events import TokenEvent
    from smolforge.serve.sampling import SamplingParams

    first: dict[int, float] = {}
    sent: dict[int, float] = {}
    done = threading.Semaphore(0)
    tokens = [0]

    def sink(i: int):
        def on(event) -> None:
            first.setdefault(i, time.perf_counter())
            if not isinstance(event, TokenEvent):
                tokens[0] += getattr(event, "completion_tokens", 0)
                done.release()
        return on

    t0 = time.perf_counter()
    for i, w in enumerate(work):
        wait = t0 + w.at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        sent[i] = time.perf_counter()
        engine.submit(w.ids, SamplingParams(max_tokens=w.answer, temperature=0), sink(i))
    for _ in work:
        done.acquire()
    wall = time.perf_counter() - t0
    ttft = sorted(first[i] - sent[i] for i in sent)
    return {"ttft_p50_s": round(statistics.median(ttft), 4), "ttft_p99_s": round(ttft[int(0.99 * (len(ttft) - 1))], 4),
            "tokens_per_s": round(tokens[0] / wall, 1), "wall_s": round(wall, 2)}


def load_model(args: argparse.Namespace) -> Any:
    """The engine's model with EOS switched off (every answer is its asked length)."""
    from smolforge.models.tiny import is_preset, preset_dir
    from smolforge.serve.engines import EngineSpec, load_engine

    path = str(preset_dir(args.model)) if is_preset(args.model) else args.model
    spec = EngineSpec(model=path, name=args.model, device="cpu", threads=args.threads, max_batch=args.max_batch,
                      quant=args.quant if args.engine == "llamacpp" else None)
    model = load_engine(args.engine, spec).model
    if dataclasses.is_dataclass(model):
        return dataclasses.replace(model, eos_ids=frozenset())
    model.eos_ids = frozenset()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-100m", help="a preset or a model directory")
    ap.add_argument("--engine", default="torch", choices=["torch", "llamacpp"])
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--loads", default="0.5,0.9")
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--answer-min", type=int, default=16)
    ap.add_argument("--answer-max", type=int, default=256)
    ap.add_argument("--shared", type=int, default=300, help="tokens of the system prompt a third of them share")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="only the JSON lines")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from smolforge.serve.engine import Engine

    model = load_model(args)
    work = workload(args, len(model.tokenizer))
    schedules = {"continuous": True} if args.engine == "llamacpp" else {"continuous": True, "static": False}

    def run(continuous: bool, trace: list[Work]) -> dict[str, float]:
        engine = Engine(model, max_batch=args.max_batch, continuous=continuous).start()
        try:
            return play(engine, trace)
        finally:
            engine.stop()

    closed = run(True, work)  # every request at once: the per-step engine's capacity
    capacity = args.requests / closed["wall_s"]
    if not args.json:
        print(f"capacity {capacity:.2f} requests/s ({closed})")
    rng = random.Random(args.seed + 1)
    for load in [float(x) for x in args.loads.split(",")]:
        at, trace = 0.0, []
        for w in work:
            trace.append(dataclasses.replace(w, at=at))
            at += rng.expovariate(load * capacity)
        rows = {name: run(flag, trace) for name, flag in schedules.items()}
        for name, row in rows.items():
            line = {"engine": args.engine, "schedule": name, "load": load, **row, "capacity_rps": round(capacity, 3)}
            if name == "continuous" and "static" in rows:
                line["ttft_p99_ratio_vs_static"] = round(rows["static"]["ttft_p99_s"] / row["ttft_p99_s"], 2)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
