"""Teacher-output store: bytes per token against fp16 full-vocabulary logits, and what top-k loses.

Two teachers, measured in this run:
- `llama-100m` (vocab 32,000): bytes/token of the compressed store (k=32) against 2·V bytes
  of fp16 full-vocabulary logits. Its weights are random, so its distributions are nearly
  uniform: we report bytes only for it.
- the demo teacher (tiny-llama fully fine-tuned on the bundled task, vocab 1,024; trained and cached
  under $SMOLFORGE_HOME/demo on first use): how much of the real distribution the top-k keeps,
  as KL(full ‖ top-k + tail spread evenly) and the tail mass, and how close the top-k KD loss
  is to the full-vocabulary KD loss for a half-trained student.

    python bench/distill_store.py --prompts 64 --k 32
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def topk_reconstruction_kl(logits, k: int) -> tuple[float, float]:
    """Mean KL(p ‖ p̂) with p̂ = exact top-k, tail mass spread evenly over the rest; mean tail mass."""
    import math

    import torch

    logp = torch.log_softmax(logits.float(), -1)
    vals, idx = logp.topk(k, -1)
    tail = (1 - vals.exp().sum(-1)).clamp_min(1e-12)
    rest = logp.shape[-1] - k
    approx = torch.full_like(logp, 0.0) + (tail.log() - math.log(rest))[:, None]
    approx.scatter_(-1, idx, vals)
    kl = (logp.exp() * (logp - approx)).sum(-1)
    return float(kl.mean()), float(tail.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()

    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    from smolforge.distill.losses import KDConfig, full_kd_loss_sum, topk_kd_loss_sum
    from smolforge.distill.store import encode_shard
    from smolforge.distill.teacher import GenSettings, HFTeacher, prompts_from_dataset, topk_from_logits

    items = prompts_from_dataset("bundled", max_samples=args.prompts)
    settings = GenSettings(max_new_tokens=args.max_new_tokens, top_k=args.k, batch_size=16)

    big = HFTeacher("llama-100m", device="cpu")
    recs = big.generate(items, settings)
    for compress in (True, False):
        data, m = encode_shard(0, recs, vocab_size=big.vocab_size, k=args.k, tok_hash=big.tok_hash, compress=compress)
        full = 2 * big.vocab_size
        print(f"llama-100m V={big.vocab_size} k={args.k} compress={compress}: {m['bytes_per_token']:.1f} bytes/token "
              f"(top-k part {m['topk_bytes_per_token']:.1f}); fp16 full vocab {full:,} bytes/token; "
              f"ratio {m['bytes_per_token'] / full:.4f} (1/{full / m['bytes_per_token']:.0f})")
    del big

    from smolforge.distill.demo import DemoSettings, train_teacher

    t0 = time.time()
    teacher_dir, _ = train_teacher(DemoSettings())
    print(f"demo teacher ready in {time.time() - t0:.0f}s: {teacher_dir}")
    t = HFTeacher(str(teacher_dir), device="cpu")
    recs = t.generate(items, settings)
    student = HFTeacher("tiny-llama", device="cpu")  # the untrained student, for the KD-loss comparison
    rows_t, rows_s = [], []
    with torch.no_grad():
        for r in recs:
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            n = len(r.response_ids)
            rows_t.append(t.model(ids).logits[0, -n - 1:-1])
            rows_s.append(student.model(ids).logits[0, -n - 1:-1])
    lt, ls = torch.cat(rows_t), torch.cat(rows_s)
    mix = 0.5 * lt + 0.5 * ls  # a half-way student: closer to the teacher than the untrained one
    for k in sorted({4, 8, args.k}):
        kl, tail = topk_reconstruction_kl(lt, k)
        lp, idx, tl = topk_from_logits(lt, k)
        for name, s in (("untrained", ls), ("half-way", mix)):
            fk = full_kd_loss_sum(s, lt, KDConfig()).item()
            tk = topk_kd_loss_sum(s, lp, idx, tl, KDConfig()).item()
            print(f"demo teacher V={t.vocab_size} k={k}: KL(full‖top-k+tail)={kl:.2e} nats/token, mean tail mass "
                  f"{tail:.2e}; forward-KL loss vs {name} student: top-k {tk / len(lt):.4f} vs full {fk / len(lt):.4f} "
                  f"nats/token (ratio {tk / fk:.4f})")
    data, m = encode_shard(0, recs, vocab_size=t.vocab_size, k=args.k, tok_hash=t.tok_hash)
    print(f"demo teacher store: {m['bytes_per_token']:.1f} bytes/token vs fp16 full {2 * t.vocab_size} "
          f"(ratio {m['bytes_per_token'] / (2 * t.vocab_size):.3f}; small vocab, so ids and text dominate)")


if __name__ == "__main__":
    main()
