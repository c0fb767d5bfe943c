"""Where a request's time to first token goes in the llamacpp engine (issue 44): a bench-only trace.

Plays bench/serve_load.py's workload (same flags, same seeds) against the llamacpp engine in this
process, with every request at once (`--load 0`, the capacity run) or as a Poisson trace at
`--load` x `--rps` requests/s, and records, without changing what the engine does:

- per request: the wait in the queue (submit -> its prefill's first call), the prefill (-> first token);
- per `llama_decode`: its tokens, its outputs, its seconds, and whether it carried prompt tokens;
- per engine step: its seconds, the share inside llama_decode, snapshots/restores of the prefix cache;
- the engine's counters (prefill tokens, prefix hits and tokens reused).

    PYTHONPATH=src .venv/bin/python bench/serve_trace.py --model llama-100m --requests 30 --prompt-max 256 \
        --answer-max 64 --shared 150 --threads 2 [--load 0.5 --rps 0.22] [--peer] [--kv-unified]

Per request it also splits admit-to-first-token into the first token sampled and the text held back
after it (a token with no text, half a character): since stop 56 every token is told at once.

`--peer` also plays the same requests (all at once) against llama-server and prints its wall and the
per-request `timings` it returns (prompt_n, prompt_ms, predicted_ms).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_load  # noqa: E402


class Trace:
    """Timestamps and counts gathered by wrapping the model's and the engine's methods."""

    def __init__(self) -> None:
        self.decodes: list[tuple[float, int, int, bool]] = []  # seconds, tokens, outputs, has prompt tokens
        self.steps: list[tuple[float, float]] = []  # step seconds, of which llama_decode seconds
        self.snap_s = self.restore_s = 0.0
        self.admitted: dict[str, float] = {}
        self.sampled: dict[str, float] = {}  # a request's first token sampled (its text may be held back)
        self._in_decode = 0.0

    def wrap(self, model: Any, engine: Any) -> None:
        """Wrap `model._decode`, `snapshot`, `restore` and `engine.step` / `_next_group` (instance attributes)."""
        decode, snap, restore, step, next_group, advance = (model._decode, model.snapshot, model.restore,
                                                            engine.step, engine._next_group, engine._advance)

        def _decode(entries: Any) -> None:
            entries = list(entries)
            t = time.perf_counter()
            decode(entries)
            dt = time.perf_counter() - t
            self._in_decode += dt
            tokens = len(entries)
            outs = sum(1 for e in entries if e[3])
            self.decodes.append((dt, tokens, outs, tokens > 0 and tokens != outs))

        def _timed(fn: Any, attr: str) -> Any:
            def inner(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    setattr(self, attr, getattr(self, attr) + time.perf_counter() - t)
            return inner

        def _step() -> None:
            self._in_decode = 0.0
            t = time.perf_counter()
            step()
            self.steps.append((time.perf_counter() - t, self._in_decode))

        def _next_group(budget: int) -> Any:
            group = next_group(budget)
            if group is not None:
                now = time.perf_counter()
                for r in group.active:
                    self.admitted.setdefault(r.id, now)
            return group

        def _advance(r: Any, token: int) -> bool:
            self.sampled.setdefault(r.id, time.perf_counter())
            return advance(r, token)

        model._decode = _decode
        engine._advance = _advance
        model.snapshot, model.restore = _timed(snap, "snap_s"), _timed(restore, "restore_s")
        engine.step, engine._next_group = _step, _next_group

    def summary(self) -> dict[str, Any]:
        """The totals the report needs."""
        pre = [d for d in self.decodes if d[3]]
        dec = [d for d in self.decodes if not d[3]]
        step_s = sum(s for s, _ in self.steps)
        in_dec = sum(d for _, d in self.steps)
        return {
            "steps": len(self.steps), "step_s": round(step_s, 2), "in_llama_decode_s": round(in_dec, 2),
            "outside_decode_s": round(step_s - in_dec, 2),
            "outside_per_step_ms": round(1000 * (step_s - in_dec) / max(1, len(self.steps)), 2),
            "prefill_calls": len(pre), "prefill_tokens": sum(d[1] for d in pre),
            "prefill_s": round(sum(d[0] for d in pre), 2),
            "prefill_tok_per_call_mean": round(statistics.mean([d[1] for d in pre]), 1) if pre else 0,
            "prefill_tok_per_s": round(sum(d[1] for d in pre) / max(1e-9, sum(d[0] for d in pre)), 1),
            "decode_calls": len(dec), "decode_tokens": sum(d[1] for d in dec),
            "decode_s": round(sum(d[0] for d in dec), 2),
            "decode_rows_mean": round(statistics.mean([d[1] for d in dec]), 2) if dec else 0,
            "decode_ms_per_call": round(1000 * sum(d[0] for d in dec) / max(1, len(dec)), 2),
            "snapshot_s": round(self.snap_s, 2), "restore_s": round(self.restore_s, 2),
        }


def run_engine(args: argparse.Namespace, trace: list[serve_load.Work]) -> dict[str, Any]:
    """The trace against a fresh llamacpp Engine with the wrappers; per-request waits and the totals."""
    from smolforge.serve.engine import Engine
    from smolforge.serve.events import TokenEvent
    from smolforge.serve.sampling import SamplingParams

    model = serve_load.load_model(args, "llamacpp")
    engine = Engine(model, max_batch=args.max_batch, step_tokens=args.step_tokens)
    tr = Trace()
    tr.wrap(model, engine)
    engine.start()
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    done = threading.Semaphore(0)
    t0 = time.perf_counter()

    def submit(w: serve_load.Work) -> None:
        box: dict[str, str] = {}

        def sink(event: Any) -> None:
            if isinstance(event, TokenEvent):
                first.setdefault(box["id"], time.perf_counter())
            else:
                first.setdefault(box["id"], time.perf_counter())
                done.release()
        now = time.perf_counter()
        r = engine.submit(w.ids, SamplingParams(max_tokens=w.answer, temperature=0), sink)
        box["id"] = r.id
        sent[r.id] = now

    for w in trace:
        wait = t0 + w.at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        submit(w)
    for _ in trace:
        done.acquire()
    wall = time.perf_counter() - t0
    engine.stop()
    queue = sorted(tr.admitted[i] - sent[i] for i in sent)
    ttft = sorted(first[i] - sent[i] for i in sent)
    prefill = sorted(first[i] - tr.admitted[i] for i in sent)
    sampled = sorted(tr.sampled[i] - tr.admitted[i] for i in sent)
    held = sorted(first[i] - tr.sampled[i] for i in sent)
    pct = lambda xs, q: round(xs[int(q * (len(xs) - 1))], 3)  # noqa: E731
    return {"wall_s": round(wall, 2), "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "queue_p50_s": pct(queue, 0.5), "queue_p99_s": pct(queue, 0.99),
            "admit_to_first_p50_s": pct(prefill, 0.5), "admit_to_first_p99_s": pct(prefill, 0.99),
            "admit_to_sampled_p50_s": pct(sampled, 0.5), "admit_to_sampled_p99_s": pct(sampled, 0.99),
            "text_held_p50_s": pct(held, 0.5), "text_held_p99_s": pct(held, 0.99),
            "tokens_per_s": round(sum(w.answer for w in trace) / wall, 1),
            **tr.summary(), **engine.counters()}


def run_peer(args: argparse.Namespace, trace: list[serve_load.Work]) -> dict[str, Any]:
    """The trace against llama-server; its wall, TTFT and the sums of its own per-request timings."""
    import httpx
    from llama_server import serving

    from smolforge.models.export.cache import cached_gguf

    gguf = str(cached_gguf(serve_load.model_path(args), args.quant, threads=args.threads))
    ctx = args.max_batch * (args.prompt_max + args.answer_max + 16)
    timings: list[dict[str, Any]] = []
    with serving(gguf, serve_load.free_port(), threads=args.threads, parallel=args.max_batch, ctx_size=ctx) as base:
        def submit(w: serve_load.Work, on_first: Any, on_done: Any) -> None:
            def go() -> None:
                body = {"prompt": w.ids, "n_predict": w.answer, "ignore_eos": True, "temperature": 0,
                        "stream": False, "cache_prompt": True}
                t = time.perf_counter()
                resp = httpx.post(f"{base}/completion", json=body, timeout=None).json()
                timings.append({**resp.get("timings", {}), "wall": time.perf_counter() - t})
                on_first()
                on_done(int(resp.get("tokens_predicted", 0)))
            threading.Thread(target=go, daemon=True).start()
        row = serve_load.play(submit, trace)
    keys = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n")
    return {"wall_s": row["wall_s"], "tokens_per_s": row["tokens_per_s"],
            **{f"sum_{k}": round(sum(t.get(k, 0) for t in timings), 1) for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--answer-min", type=int, default=16)
    ap.add_argument("--answer-max", type=int, default=64)
    ap.add_argument("--shared", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--step-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load", type=float, default=0.0, help="0: every request at once; else x --rps Poisson")
    ap.add_argument("--rps", type=float, default=0.22, help="the peer's capacity the load is a fraction of")
    ap.add_argument("--peer", action="store_true", help="also the same requests (all at once) on llama-server")
    ap.add_argument("--kv-unified", action="store_true",
                    help="one KV stream for every sequence (the engine before stop 56: the A/B's before)")
    args = ap.parse_args()
    if args.kv_unified:
        from smolforge.serve.llamacpp import LlamaCppModel

        LlamaCppModel.KV_UNIFIED = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed trace still stops its llama-server
    from transformers import AutoTokenizer

    work = serve_load.workload(args, len(AutoTokenizer.from_pretrained(serve_load.model_path(args))))
    if args.load > 0:
        rng, at = random.Random(args.seed + 1), 0.0
        for w in work:
            w.at = at
            at += rng.expovariate(args.load * args.rps)
    print(json.dumps({"engine": "llamacpp", "load": args.load, **run_engine(args, work)}), flush=True)
    if args.peer:
        print(json.dumps({"engine": "llama-server", "load": args.load, **run_peer(args, work)}), flush=True)


if __name__ == "__main__":
    main()
