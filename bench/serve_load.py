"""Serving under load: Poisson arrivals against smolforge's engines and llama.cpp's `llama-server`.

One process: --requests requests with prompts of --prompt-min..--prompt-max tokens and answers of
--answer-min..--answer-max tokens (EOS switched off, so every answer is its length), a third of them
starting with the same --shared-token system prompt. The smolforge engines run in this process
without HTTP (the engine is what schedules); `llama-server` (issue 44 item 8, built once by
bench/llama_server.py from the llama.cpp llama-cpp-python vendors) serves the same q8_0 GGUF (the
llamacpp engine's own cached export) with the same threads and `-np --max-batch` slots, `-cb`, and is
sent the same token ids on `/completion` (streamed, `ignore_eos`) from one thread per request; its
times include loopback HTTP and SSE, which can only favour smolforge.

Capacity is measured first (every request at once) on the peer (`llama-server` when it is among
--engines, else the first engine); then, per --loads fraction of it, one Poisson arrival trace is
played against each engine in turn (per-step engine: continuous batching, prefix cache; and on the
torch engine static batching too, the engine before issue 44).

Prints one JSON object per line, per engine, schedule and load: `engine` (`llamacpp`, `torch`,
`llama-server`), `schedule`, `load`, `ttft_p50_s`, `ttft_p99_s`, `tokens_per_s`; on smolforge's rows
`ttft_p50_ratio`, `ttft_p99_ratio`, `throughput_ratio` (smolforge / llama-server at the same load:
TTFT <= 1.0 and throughput >= 1.0 mean as good or better), and on the torch per-step rows
`ttft_p99_ratio_vs_static` (static p99 / per-step p99: how many times better).

    .venv/bin/python bench/serve_load.py --model llama-100m --engines llamacpp,llama-server,torch \
        --requests 60 --prompt-max 256 --answer-max 96 --shared 150 --threads 2 --json
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
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Callable


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


Submit = Callable[[Work, Callable[[], None], Callable[[int], None]], None]


def play(submit: Submit, work: list[Work]) -> dict[str, float]:
    """Submit each request at its arrival; TTFT percentiles and output tokens/s over the whole run.

    submit(work, on_first, on_done) sends one request and calls on_first() at its first token and
    on_done(completion_tokens) at its end, from any thread."""
    first: dict[int, float] = {}
    sent: dict[int, float] = {}
    done = threading.Semaphore(0)
    tokens = [0]
    lock = threading.Lock()

    def hooks(i: int) -> tuple[Callable[[], None], Callable[[int], None]]:
        def on_first() -> None:
            with lock:
                first.setdefault(i, time.perf_counter())

        def on_done(n: int) -> None:
            with lock:
                first.setdefault(i, time.perf_counter())
                tokens[0] += n
            done.release()
        return on_first, on_done

    t0 = time.perf_counter()
    for i, w in enumerate(work):
        wait = t0 + w.at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        sent[i] = time.perf_counter()
        submit(w, *hooks(i))
    for _ in work:
        done.acquire()
    wall = time.perf_counter() - t0
    ttft = sorted(first[i] - sent[i] for i in sent)
    return {"ttft_p50_s": round(statistics.median(ttft), 4), "ttft_p99_s": round(ttft[int(0.99 * (len(ttft) - 1))], 4),
            "tokens_per_s": round(tokens[0] / wall, 1), "wall_s": round(wall, 2)}


def engine_run(model: Any, max_batch: int, continuous: bool, trace: list[Work]) -> dict[str, float]:
    """The trace against a fresh smolforge `Engine` (empty prefix cache) in this process."""
    from smolforge.serve.engine import Engine
    from smolforge.serve.events import TokenEvent
    from smolforge.serve.sampling import SamplingParams

    engine = Engine(model, max_batch=max_batch, continuous=continuous).start()

    def submit(w: Work, on_first: Callable[[], None], on_done: Callable[[int], None]) -> None:
        def sink(event: Any) -> None:
            if isinstance(event, TokenEvent):
                on_first()
            else:
                on_done(getattr(event, "completion_tokens", 0))
        engine.submit(w.ids, SamplingParams(max_tokens=w.answer, temperature=0), sink)

    try:
        return play(submit, trace)
    finally:
        engine.stop()


def stream_completion(base: str, w: Work, on_first: Callable[[], None], on_done: Callable[[int], None]) -> None:
    """One streamed `/completion` on llama-server: the token ids as they are, EOS ignored, greedy."""
    import httpx

    body = {"prompt": w.ids, "n_predict": w.answer, "ignore_eos": True, "temperature": 0, "stream": True,
            "cache_prompt": True}
    n = 0
    try:
        with httpx.stream("POST", f"{base}/completion", json=body, timeout=None) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                on_first()
                if chunk.get("stop"):
                    n = int(chunk.get("tokens_predicted") or chunk.get("timings", {}).get("predicted_n", 0))
    finally:
        on_done(n)


def peer_run(gguf: str, args: argparse.Namespace, trace: list[Work], port: int) -> dict[str, float]:
    """The trace against a fresh llama-server (empty prompt cache) on the same GGUF, threads and slots."""
    from llama_server import serving

    ctx = args.max_batch * (args.prompt_max + args.answer_max + 16)
    with serving(gguf, port, threads=args.threads, parallel=args.max_batch, ctx_size=ctx) as base:
        return play(lambda w, f, d: threading.Thread(target=stream_completion, args=(base, w, f, d),
                                                     daemon=True).start(), trace)


PEER = "llama-server"


def model_path(args: argparse.Namespace) -> str:
    """The model directory: a preset's, or --model as given."""
    from smolforge.models.tiny import is_preset, preset_dir

    return str(preset_dir(args.model)) if is_preset(args.model) else args.model


def load_model(args: argparse.Namespace, engine: str) -> Any:
    """The engine's model with EOS switched off (every answer is its asked length)."""
    from smolforge.serve.engines import EngineSpec, load_engine

    spec = EngineSpec(model=model_path(args), name=args.model, device="cpu", threads=args.threads,
                      max_batch=args.max_batch, quant=args.quant if engine == "llamacpp" else None)
    model = load_engine(engine, spec).model
    if dataclasses.is_dataclass(model):
        return dataclasses.replace(model, eos_ids=frozenset())
    model.eos_ids = frozenset()
    return model


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Runner = tuple[str, str, Callable[[list[Work]], dict[str, float]]]


def runners(args: argparse.Namespace, engines: list[str]) -> list[Runner]:
    """(engine, schedule, run(trace)) for each engine asked, the peer's GGUF being the llamacpp engine's."""
    out: list[Runner] = []
    for name in engines:
        if name == PEER:
            from smolforge.models.export.cache import cached_gguf

            gguf = str(cached_gguf(model_path(args), args.quant, threads=args.threads))
            out.append((PEER, "continuous", lambda t, g=gguf: peer_run(g, args, t, free_port())))
            continue
        model = load_model(args, name)
        out.append((name, "continuous", lambda t, m=model: engine_run(m, args.max_batch, True, t)))
        if name == "torch" and args.static:
            out.append((name, "static", lambda t, m=model: engine_run(m, args.max_batch, False, t)))
    return out


def lines(load: float, rows: list[tuple[str, str, dict[str, float]]], capacity: float) -> list[dict[str, Any]]:
    """One JSON row per engine and schedule, with the ratios against the peer and against static batching."""
    peer = next((r for e, _, r in rows if e == PEER), None)
    static = next((r for e, s, r in rows if s == "static"), None)
    out = []
    for engine, schedule, row in rows:
        line: dict[str, Any] = {"engine": engine, "schedule": schedule, "load": load, **row,
                                "capacity_rps": round(capacity, 3)}
        if peer is not None and engine != PEER:
            line["ttft_p50_ratio"] = round(row["ttft_p50_s"] / peer["ttft_p50_s"], 3)
            line["ttft_p99_ratio"] = round(row["ttft_p99_s"] / peer["ttft_p99_s"], 3)
            line["throughput_ratio"] = round(row["tokens_per_s"] / peer["tokens_per_s"], 3)
        if static is not None and engine == "torch" and schedule == "continuous":
            line["ttft_p99_ratio_vs_static"] = round(static["ttft_p99_s"] / row["ttft_p99_s"], 2)
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-100m", help="a preset or a model directory")
    ap.add_argument("--engines", default=f"llamacpp,{PEER},torch",
                    help=f"comma-separated, run in this order at each load: torch, llamacpp, {PEER}")
    ap.add_argument("--engine", help="one smolforge engine only (the bench before the peer); overrides --engines")
    ap.add_argument("--no-static", dest="static", action="store_false", help="skip the torch engine's static batching")
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--loads", default="0.5,0.9")
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--answer-min", type=int, default=16)
    ap.add_argument("--answer-max", type=int, default=256)
    ap.add_argument("--shared", type=int, default=300, help="tokens of the system prompt a third of them share")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--max-batch", type=int, default=8, help="the engines' batch and llama-server's slots (-np)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="only the JSON lines")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops its llama-server
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/llama_server.py
    from transformers import AutoTokenizer

    engines = [args.engine] if args.engine else [e.strip() for e in args.engines.split(",") if e.strip()]
    runs = runners(args, engines)
    work = workload(args, len(AutoTokenizer.from_pretrained(model_path(args))))
    first = next((r for r in runs if r[0] == PEER), runs[0])
    closed = first[2](work)  # every request at once: the peer's capacity
    capacity = args.requests / closed["wall_s"]
    if not args.json:
        print(f"capacity of {first[0]}: {capacity:.2f} requests/s ({closed})")
    rng = random.Random(args.seed + 1)
    for load in [float(x) for x in args.loads.split(",")]:
        at, trace = 0.0, []
        for w in work:
            trace.append(dataclasses.replace(w, at=at))
            at += rng.expovariate(load * capacity)
        rows = [(engine, schedule, run(trace)) for engine, schedule, run in runs]
        for line in lines(load, rows, capacity):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
