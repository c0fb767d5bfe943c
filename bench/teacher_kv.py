"""The llamacpp teacher's batched decode, two versions of `distill/llamacpp_batch.py` alternated in one process.

Stop 51: the teacher's `BatchDecoder` had a KV stream per sequence and moved the highest running
sequence into each finished one's slot (`_compact`: llama.cpp cuts a batch over separate streams into
micro-batches of consecutive ids); the serving engine had one unified stream. Both now use
`models/llamacpp_context.py` (unified). This times `LlamaCppTeacher.generate` (prefill, decode, top-k:
no store writing) with the old module (a file: `git show REV:src/smolforge/distill/llamacpp_batch.py`)
and the current one, each in its own teacher (its own context, kept across calls as a teacher keeps
it), alternated ABBA per round after one warm-up each; medians, the new/old ratio, and how the records
agree with each other and with the teacher's one-at-a-time path (batch 1, no `BatchDecoder`): equal
responses, top-1 agreement and the largest |Δ top-1 log-prob| on the rows both read the same tokens.

    git show b62106b:src/smolforge/distill/llamacpp_batch.py > /tmp/old_llamacpp_batch.py
    python bench/teacher_kv.py --old /tmp/old_llamacpp_batch.py --model llama-100m --quant q8_0 \
        --prompts 16 --batch-size 16 --max-new-tokens 24 --threads 1 --rounds 4
    python bench/teacher_kv.py --old /tmp/old_llamacpp_batch.py ... --temperature 1.0 --extra-stops 1500
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_old(path: str):
    """The old module's `BatchDecoder` (its imports are smolforge's own, which still exist)."""
    spec = importlib.util.spec_from_file_location("old_llamacpp_batch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BatchDecoder


def agreement(a, b) -> tuple[int, float, float]:
    """(records with equal responses, top-1 agreement and max |Δ top-1 log-prob| over the rows both
    computed on the same tokens: each response's common prefix and the row after it)."""
    import numpy as np

    same = sum(x.response_ids == y.response_ids for x, y in zip(a, b))
    hits = rows = 0
    worst = 0.0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x.response_ids), len(y.response_ids)) and x.response_ids[n] == y.response_ids[n]:
            n += 1
        n = min(n + 1, len(x.response_ids), len(y.response_ids))
        hits += int((x.topk_indices[:n, 0] == y.topk_indices[:n, 0]).sum())
        rows += n
        worst = max(worst, float(np.abs(x.topk_logprobs[:n, 0] - y.topk_logprobs[:n, 0]).max()))
    return same, hits / max(1, rows), worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the old llamacpp_batch.py (a file)")
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled (seeded), so sequences end apart")
    ap.add_argument("--extra-stops", type=int, default=0,
                    help="ids 100..100+N-1 also end a response (a random model rarely says EOS): sequences end apart")
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from smolforge.distill import teacher_llamacpp
    from smolforge.distill.prompts import GenSettings
    from smolforge.distill.teacher import prompts_from_dataset

    arms = {"old": load_old(args.old), "new": teacher_llamacpp.BatchDecoder}
    teachers = {name: teacher_llamacpp.LlamaCppTeacher(args.model, quant=args.quant, n_threads=args.threads)
                for name in arms}
    for teacher in teachers.values():
        teacher.stops = frozenset(teacher.stops) | frozenset(range(100, 100 + args.extra_stops))
    items = prompts_from_dataset("bundled", max_samples=args.prompts)
    settings = GenSettings(max_new_tokens=args.max_new_tokens, top_k=args.top_k, batch_size=args.batch_size,
                           temperature=args.temperature)
    times: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}  # this process's CPU seconds: less of the load
    records: dict[str, list] = {}

    def run(name: str) -> float:
        teacher_llamacpp.BatchDecoder = arms[name]  # what `_batch_decoder` makes (once per teacher)
        t0, c0 = time.perf_counter(), time.process_time()
        records[name] = teachers[name].generate(items, settings)
        cpu[name].append(time.process_time() - c0)
        return time.perf_counter() - t0

    for name in arms:
        run(name)  # warm-up: the context is made here
        cpu[name].clear()
    warm = dict(records)
    for r in range(args.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            times[name].append(run(name))
    tokens = sum(len(rec.response_ids) for rec in records["new"])
    lengths = sorted(len(rec.response_ids) for rec in records["new"])
    print(f"model {args.model} {args.quant}, {len(items)} prompts, batch {args.batch_size}, "
          f"{args.max_new_tokens} new tokens, temperature {args.temperature}, {args.extra_stops} extra stops, "
          f"{args.threads} thread(s), "
          f"{args.rounds} rounds (ABBA); {tokens} response tokens (lengths {lengths}); load average {os.getloadavg()[0]:.1f}")
    for name in arms:
        med = statistics.median(times[name])
        print(f"{name}: median {med:.3f}s ({tokens / med:.1f} tokens/s), all {[round(t, 3) for t in times[name]]}")
    ratio = statistics.median(times["old"]) / statistics.median(times["new"])
    pairs = sorted(o / n for o, n in zip(times["old"], times["new"]))
    print(f"old/new median time {ratio:.3f}x (>1: new faster); per-round old/new {[round(p, 3) for p in pairs]}")
    cpu_pairs = sorted(o / n for o, n in zip(cpu["old"], cpu["new"]))
    print(f"CPU seconds: old median {statistics.median(cpu['old']):.3f}, new {statistics.median(cpu['new']):.3f}, "
          f"old/new {statistics.median(cpu['old']) / statistics.median(cpu['new']):.3f}x; "
          f"per-round {[round(p, 3) for p in cpu_pairs]}")
    one = teachers["new"].generate(items, GenSettings(**{**settings.__dict__, "batch_size": 1}))  # no BatchDecoder
    for label, (x, y) in {"new vs old": (records["new"], records["old"]),
                          "new vs one at a time": (records["new"], one),
                          "old vs one at a time": (records["old"], one),
                          "old vs its warm-up": (records["old"], warm["old"]),
                          "new vs its warm-up": (records["new"], warm["new"])}.items():
        same, top1, dlp = agreement(x, y)
        print(f"{label}: equal responses {same}/{len(items)}, top-1 on shared rows {top1:.1%}, "
              f"max |d top-1 logprob| {dlp:.2e}")


if __name__ == "__main__":
    main()
