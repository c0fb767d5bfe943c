"""Teacher backends side by side: the `hf` teacher in fp32 against the `llamacpp` teacher at f16 and q8_0.

One process, the same prompts, model, greedy settings and thread count for every arm. Each arm's
time covers what a teacher task does per shard: generate the responses, take every response token's
top-k and tail mass, encode the shard (codec sorted-rice-q8) and write it into a store directory.
The GGUF exports are made first (cached per node, as the backend does) and not timed; their
seconds are printed. Best of --repeat runs per arm, after one warm-up prompt. Beside the speed,
each llamacpp arm's agreement with the fp32 teacher: the share of prompts with the same greedy
response, and over the response tokens the two share, the top-1 ids and the mean |Δ log-prob| of
the top-1.

    python bench/teacher_backends.py --model llama-100m --prompts 4 --max-new-tokens 32 --threads 1
    python bench/teacher_backends.py --model twin:qwen2.5-0.5b-instruct@full --prompts 16 --batch-size 16 --quants q8_0

Each llamacpp quantization runs at batch 1 (one sequence at a time) and at --batch-size (batched
decode, `distill/llamacpp_batch.py`), or at each of --llamacpp-batch-sizes; the hf arm at --batch-size
or each of --hf-batch-sizes, and every llamacpp row is compared with hf's best (each backend at its
best batch setting). KL to hf fp32 is KL(HF fp32's exact distribution || the store's top-k with its tail
spread evenly) over each store's own responses, teacher-forced in HF; the hf row's is what top-k
truncation alone costs, so a llamacpp row's excess over it, printed as "of it the quantization's", is
what the quantization costs (on a random twin's flat rows the truncation dominates the KL).

    python bench/teacher_backends.py --model twin:qwen2.5-0.5b-instruct@full --prompts 32 --threads 2 \
        --hf-batch-sizes 8,16,32 --llamacpp-batch-sizes 16,32 --quants q8_0
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from smolforge.distill.prompts import GenSettings  # noqa: E402 (after the offline switch)


def timed_store(teacher, items, settings, repeat: int) -> tuple[float, list]:
    """(best seconds, records) of generate + encode + write, every shard the whole prompt list."""
    from smolforge.distill.teacher import produce_shards
    from smolforge.distill.store import write_shard_bytes

    best = float("inf")
    teacher.generate(items[:1], settings)  # warm-up
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            for manifest, data in produce_shards(teacher, items, {0: (0, len(items))}, settings):
                write_shard_bytes(out, manifest, data)
            best = min(best, time.perf_counter() - t0)
    records = teacher.generate(items, settings)
    return best, records


def agreement(got, want) -> tuple[float, float, float]:
    """(share of equal responses, top-1 agreement, mean |Δ top-1 log-prob|) over shared prefixes."""
    import numpy as np

    same_resp = sum(a.response_ids == b.response_ids for a, b in zip(got, want)) / max(1, len(want))
    hits = rows = 0
    diffs = []
    for a, b in zip(got, want):
        n = 0
        while n < min(len(a.response_ids), len(b.response_ids)) and a.response_ids[n] == b.response_ids[n]:
            n += 1
        n = min(n + 1, len(a.response_ids), len(b.response_ids))  # the first differing row still has the same prefix
        hits += int((a.topk_indices[:n, 0] == b.topk_indices[:n, 0]).sum())
        rows += n
        diffs.extend(np.abs(a.topk_logprobs[:n, 0] - b.topk_logprobs[:n, 0]).tolist())
    return same_resp, hits / max(1, rows), float(np.mean(diffs)) if diffs else 0.0


def kl_to_hf(model, recs) -> float:
    """Mean KL(HF fp32 exact || stored top-k with the tail spread evenly), nats per response token: what
    the quantized teacher's store costs against the fp32 teacher, measured on the store's own
    responses (HF teacher-forced over prompt + response)."""
    import math

    import torch

    total = rows = 0.0
    with torch.no_grad():
        for r in recs:
            n, p = len(r.response_ids), len(r.prompt_ids)
            logits = model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0, p - 1:p - 1 + n].float()
            logp = torch.log_softmax(logits, -1)
            v, k = logp.shape[-1], r.topk_indices.shape[-1]
            tail = torch.from_numpy(r.tail_mass).clamp_min(1e-30)
            approx = (tail.log() - math.log(v - k))[:, None].expand(n, v).clone()
            approx.scatter_(-1, torch.from_numpy(r.topk_indices), torch.from_numpy(r.topk_logprobs))
            total += float((logp.exp() * (logp - approx)).sum())
            rows += n
    return total / max(1.0, rows)


def batch_sizes(text: str) -> list[int]:
    return sorted({int(b) for b in text.split(",") if b.strip()})


def run_hf(args, items, settings) -> tuple[float, list, object, float]:
    """The hf fp32 arm at each of its batch sizes; (its best tokens/s, that run's records, the model)."""
    from smolforge.distill.teacher import HFTeacher

    hf = HFTeacher(args.model, device="cpu", dtype="fp32")
    best = (0.0, None)
    for batch in batch_sizes(args.hf_batch_sizes or str(args.batch_size)):
        secs, recs = timed_store(hf, items, GenSettings(**{**settings.__dict__, "batch_size": batch}), args.repeat)
        tokens = sum(len(r.response_ids) for r in recs)
        print(f"{f'hf fp32 (batch {batch})':<28}: {tokens} tokens in {secs:.2f}s = {tokens / secs:7.1f} tokens/s", flush=True)
        best = max(best, (tokens / secs, recs), key=lambda x: x[0])
    hf_kl = kl_to_hf(hf.model, best[1])
    print(f"{'hf fp32 (best)':<28}: {best[0]:7.1f} tokens/s; KL to hf fp32 {hf_kl:.4e} nats/token (its own top-k: "
          "the truncation alone)", flush=True)
    return best[0], best[1], hf.model, hf_kl


def run_llamacpp(args, quant, items, settings, hf) -> None:
    """One quantization at each batch size: tokens/s against hf's best, agreement, KL and the quantization's
    own share of it (this row's KL minus the hf row's, which is what top-k truncation alone costs)."""
    from smolforge.distill.teacher_llamacpp import LlamaCppTeacher

    hf_rate, hf_recs, hf_model, hf_kl = hf
    teacher = LlamaCppTeacher(args.model, quant=quant, n_threads=args.threads)
    for batch in batch_sizes(args.llamacpp_batch_sizes or f"1,{args.batch_size}"):
        s, recs = timed_store(teacher, items, GenSettings(**{**settings.__dict__, "batch_size": batch}), args.repeat)
        tokens = sum(len(r.response_ids) for r in recs)
        same, top1, dlp = agreement(recs, hf_recs)
        kl = kl_to_hf(hf_model, recs)
        print(f"{f'llamacpp {quant} (batch {batch})':<28}: {tokens} tokens in {s:.2f}s = {tokens / s:7.1f} tokens/s "
              f"({(tokens / s) / hf_rate:.2f}x hf fp32's best); same response {same:.0%}, top-1 {top1:.1%}, "
              f"mean |d logprob| {dlp:.1e}, KL to hf fp32 {kl:.4e} nats/token, of it the quantization's "
              f"{kl - hf_kl:.4g}", flush=True)
    teacher.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4,
                    help="the hf teacher's batch, and the llamacpp teacher's batched decode (also run at 1)")
    ap.add_argument("--hf-batch-sizes", default="", help="comma list: the hf arm at each (default: --batch-size)")
    ap.add_argument("--llamacpp-batch-sizes", default="",
                    help="comma list: each llamacpp arm at each (default: 1 and --batch-size)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--quants", default="f16,q8_0")
    args = ap.parse_args()

    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    from smolforge.distill.teacher import prompts_from_dataset
    from smolforge.models.export.cache import cached_gguf

    quants = [q for q in args.quants.split(",") if q]
    for quant in quants:
        t0 = time.perf_counter()
        path = cached_gguf(args.model, quant, threads=args.threads)
        print(f"GGUF {quant}: {path} ({path.stat().st_size / 2**20:.1f} MiB, ready in {time.perf_counter() - t0:.1f}s)")
    items = prompts_from_dataset("bundled", max_samples=args.prompts)
    settings = GenSettings(max_new_tokens=args.max_new_tokens, top_k=args.top_k, batch_size=args.batch_size)
    print(f"model {args.model}, {len(items)} prompts x {args.max_new_tokens} greedy tokens, top-{args.top_k}, "
          f"{args.threads} thread(s), best of {args.repeat}, store writing included", flush=True)
    hf = run_hf(args, items, settings)
    for quant in quants:
        run_llamacpp(args, quant, items, settings, hf)


if __name__ == "__main__":
    main()
