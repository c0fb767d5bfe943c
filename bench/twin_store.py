"""Teacher store at the published vocabularies: bytes per response token at k = 32 for the full-size
Qwen2.5-0.5B-Instruct (V = 151,936) and Llama-3.2-1B-Instruct (V = 128,256) twins as teachers.

The twins have the published shapes and random weights (models/twins): their next-token distributions
are flatter than a trained model's, which is the hard case for the values (every one of the k log-probs
is close to the others) and the usual case for the ids (k ids spread over the whole vocabulary).
Against it, the fp16 full-vocabulary store a naive teacher would write: 2·V bytes per token.

    OMP_NUM_THREADS=2 .venv/bin/python bench/twin_store.py --prompts 16 --tokens 32
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TWINS = ("twin:qwen2.5-0.5b-instruct@full", "twin:llama-3.2-1b-instruct@full")


def measure(name: str, prompts: int, tokens: int, k: int, dtype: str) -> dict:
    from smolforge.distill.prompts import GenSettings, PromptItem
    from smolforge.distill.store import encode_shard
    from smolforge.distill.teacher import make_teacher

    teacher = make_teacher(name, "hf", device="cpu", dtype=dtype)
    items = [PromptItem(i, [{"role": "user", "content": f"Question {i}: what is {i} times {i + 7}? Explain."}])
             for i in range(prompts)]
    records = teacher.generate(items, GenSettings(max_new_tokens=tokens, top_k=k, batch_size=8))
    _, manifest = encode_shard(0, records, vocab_size=teacher.vocab_size, k=k, tok_hash=teacher.tok_hash)
    rec = manifest["reconstruction"]
    return {"twin": name, "vocab": teacher.vocab_size, "tokens": manifest["num_response_tokens"],
            "bytes_per_token": manifest["bytes_per_token"], "fp16_full": 2 * teacher.vocab_size,
            "kl_mean": rec["kl_mean"], "kl_max": rec["kl_max"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--dtype", default="bf16", help="the teacher's weights dtype (the store is the same either way)")
    ap.add_argument("--twin", action="append", help=f"twins to run (default: {', '.join(TWINS)})")
    args = ap.parse_args()
    print(f"| twin | V | response tokens | bytes/token (k={args.k}) | fp16 full vocab | ratio | KL codec mean (max) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in args.twin or TWINS:
        r = measure(name, args.prompts, args.tokens, args.k, args.dtype)
        print(f"| {r['twin']} | {r['vocab']:,} | {r['tokens']} | {r['bytes_per_token']:.1f} | {r['fp16_full']:,} | "
              f"{r['bytes_per_token'] / r['fp16_full']:.5f} | {r['kl_mean']:.1e} ({r['kl_max']:.1e}) |", flush=True)


if __name__ == "__main__":
    main()
