"""Teacher-output store: bytes per token and reconstruction KL of the VERSION 2 codec, VERSION 1, and
fp16 full-vocabulary logits, at k = 8, 32, 64.

Two sources of teacher distributions:
- synthetic, V = 32,000 (the size the goal is stated for): Zipf-shaped rows, p(rank r) ∝ (r+1)^-a
  with a drawn per row from [0.8, 2.5] (flat to peaked), plus N(0, 0.5) logit noise, and ranks
  assigned with a bias toward low ids (frequent tokens have low ids in BPE vocabularies). Records
  carry ~40 prompt ids and text, as a teacher's shard does. No model has a 32k vocabulary and real
  weights offline here, so this is the stand-in for a real 32k teacher;
- the trained demo teacher (tiny-llama fine-tuned on the bundled task, V = 1,024; cached under
  $SMOLFORGE_HOME/demo, trained on first use, ~2 minutes): real distributions, small vocabulary.

"KL codec" is the manifest's reconstruction KL: KL(stored k+1 buckets ‖ the exact k+1 buckets),
nats per token, mean (max). "KL top-k" is what keeping only k drops: KL(full ‖ top-k + tail spread
evenly), the same for every format. fp16 full-vocab: KL(softmax of the fp16-rounded log-probs ‖ full).
"bytes/token" is the whole shard file over response tokens (VERSION 1 computed with its layout:
fp16 values, ids bit-packed to ceil(log2 V) bits, fp16 tail, no compressor).

    OMP_NUM_THREADS=1 .venv/bin/python bench/distill_store.py --rows 4096 --prompts 64
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402


def zipf_logits(rows: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, vocab] synthetic teacher logits, Zipf-shaped (see the module docstring)."""
    ranks_logp = -np.log(np.arange(1, vocab + 1, dtype=np.float64))
    out = np.empty((rows, vocab), dtype=np.float32)
    ids = np.arange(vocab)
    for r in range(rows):
        a = rng.uniform(0.8, 2.5)
        order = np.argsort(np.log1p(ids) + rng.normal(scale=3.0, size=vocab))  # low ids tend to rank high
        row = np.empty(vocab)
        row[order] = a * ranks_logp
        out[r] = row + rng.normal(scale=0.5, size=vocab)
    return out


def records_from_logits(logits: np.ndarray, k: int, rng: np.random.Generator, prompt_len: int = 40):
    """TeacherRecords of ~16 response tokens each over the rows of `logits`, plus the exact log-probs."""
    import torch

    from smolforge.distill.store import TeacherRecord
    from smolforge.distill.teacher import topk_from_logits, truncation_kl

    lt = torch.from_numpy(logits)
    vals, idx, tail = topk_from_logits(lt, k)
    trunc = truncation_kl(lt, idx, tail)
    recs, pos, i = [], 0, 0
    while pos < len(logits):
        n = min(int(rng.integers(8, 25)), len(logits) - pos)
        recs.append(TeacherRecord(
            example_id=i, prompt_messages=[{"role": "user", "content": f"Question {i}: what is {i} + {2 * i}?"}],
            prompt_ids=rng.integers(0, logits.shape[1], size=prompt_len).tolist(),
            response_ids=idx[pos:pos + n, 0].tolist(), response_text=f"{3 * i}", answer=str(3 * i),
            topk_logprobs=vals[pos:pos + n].numpy(), topk_indices=idx[pos:pos + n].numpy().astype(np.int64),
            tail_mass=tail[pos:pos + n].numpy(), truncation_kl=trunc[pos:pos + n].numpy()))
        pos, i = pos + n, i + 1
    return recs


def v1_bytes_and_kl(records, vocab: int, k: int) -> tuple[int, float, float]:
    """Size of the VERSION 1 shard for these records (its layout, re-created), and its codec KL."""
    from smolforge.distill.store import index_bits, pack_indices, safetensors_bytes
    from smolforge.distill.topk_codec import bucket_kl

    with_k = [r for r in records if r.has_topk]
    vals = np.concatenate([r.topk_logprobs for r in with_k]).astype(np.float32)
    idx = np.concatenate([r.topk_indices for r in with_k])
    tail = np.concatenate([r.tail_mass for r in with_k]).astype(np.float32)
    text = [{"prompt_messages": r.prompt_messages, "response": r.response_text, "answer": r.answer} for r in records]
    import json

    flat = lambda seqs: np.array([t for s in seqs for t in s], dtype=np.uint16)  # noqa: E731
    offs = lambda seqs: np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)  # noqa: E731
    tensors = {
        "prompt_ids": flat([r.prompt_ids for r in records]), "prompt_offsets": offs([r.prompt_ids for r in records]),
        "response_ids": flat([r.response_ids for r in records]),
        "response_offsets": offs([r.response_ids for r in records]),
        "example_ids": np.arange(len(records), dtype=np.int64), "sample_ids": np.zeros(len(records), np.int32),
        "has_topk": np.ones(len(records), np.uint8), "topk_values": vals.astype(np.float16),
        "topk_indices": pack_indices(idx, index_bits(vocab)), "tail_mass": tail.astype(np.float16),
        "text_json": np.frombuffer(json.dumps(text).encode(), np.uint8).copy()}
    data = safetensors_bytes(tensors, {"format": "smolforge-teacher-shard", "version": "1"})
    kl = bucket_kl(vals.astype(np.float16).astype(np.float32), tail.astype(np.float16).astype(np.float32), vals, tail)
    return len(data), float(kl.mean()), float(kl.max())


def fp16_full_kl(logits: np.ndarray) -> tuple[float, float]:
    import torch

    lp = torch.log_softmax(torch.from_numpy(logits).double(), -1)
    q = torch.log_softmax(lp.half().double(), -1)
    kl = (q.exp() * (q - lp)).sum(-1)
    return float(kl.mean()), float(kl.max())


def report(name: str, logits: np.ndarray, ks: list[int], seed: int, records_for_k=None) -> None:
    from smolforge.distill.store import encode_shard

    vocab = logits.shape[1]
    fk_mean, fk_max = fp16_full_kl(logits)
    for k in ks:
        rng = np.random.default_rng(seed)
        recs = records_for_k(k) if records_for_k else records_from_logits(logits, k, rng)
        _, m = encode_shard(0, recs, vocab_size=vocab, k=k, tok_hash="bench", compress=True)
        rec = m["reconstruction"]
        v1, v1_mean, v1_max = v1_bytes_and_kl(recs, vocab, k)
        tokens = m["num_response_tokens"]
        trunc = f"{rec['truncation_kl_mean']:.2e}" if "truncation_kl_mean" in rec else "-"
        print(f"| {name} | {vocab:,} | {k} | **{m['bytes_per_token']:.1f}** (top-k {m['topk_bytes_per_token']:.1f}) | "
              f"{rec['kl_mean']:.1e} ({rec['kl_max']:.1e}) | {v1 / tokens:.1f} | {v1_mean:.1e} ({v1_max:.1e}) | "
              f"{2 * vocab:,} | {fk_mean:.1e} ({fk_max:.1e}) | {trunc} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096, help="synthetic response tokens")
    ap.add_argument("--prompts", type=int, default=64, help="demo-teacher prompts (0: skip the demo teacher)")
    ap.add_argument("--ks", default="8,32,64")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]

    print("| teacher | V | k | v2 bytes/token | v2 KL codec mean (max) | v1 bytes/token | v1 KL codec mean (max) "
          "| fp16 full bytes/token | fp16 full KL mean (max) | KL top-k (truncation) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    report("synthetic Zipf", zipf_logits(args.rows, 32000, np.random.default_rng(args.seed)), ks, args.seed)
    if not args.prompts:
        return

    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    from smolforge.distill.demo import DemoSettings, train_teacher
    from smolforge.distill.teacher import GenSettings, HFTeacher, prompts_from_dataset

    teacher_dir, _ = train_teacher(DemoSettings())
    t = HFTeacher(str(teacher_dir), device="cpu")
    items = prompts_from_dataset("bundled", max_samples=args.prompts)
    recs0 = t.generate(items, GenSettings(max_new_tokens=16, top_k=8, batch_size=16))
    with torch.no_grad():
        logits = torch.cat([t.model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0, -len(r.response_ids) - 1:-1]
                            for r in recs0]).numpy()
    report("demo teacher", logits, ks, args.seed,
           records_for_k=lambda k: t.generate(items, GenSettings(max_new_tokens=16, top_k=k, batch_size=16)))


if __name__ == "__main__":
    main()
