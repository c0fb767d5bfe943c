"""Teacher generation throughput: smolforge's HF teacher against a plain HF `generate` loop.

Both run greedy decoding on the same model and prompts with the same max_new_tokens, in this
process, one after the other. The plain loop is what a script usually does: one prompt at a time,
`model.generate`, decode. smolforge's teacher batches with left padding and the KV cache, and
*also* takes the top-k logits of every response token (one extra forward pass per batch), so the
ratio counts that extra work against it.

    python bench/distill_teacher.py --model tiny-llama --prompts 64
    python bench/distill_teacher.py --model llama-100m --prompts 32 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    from smolforge.data.encode import render
    from smolforge.distill.teacher import GenSettings, HFTeacher, prompts_from_dataset

    items = prompts_from_dataset("bundled", max_samples=args.prompts)
    teacher = HFTeacher(args.model, device="cpu")
    model, tok = teacher.model, teacher.tokenizer
    settings = GenSettings(max_new_tokens=args.max_new_tokens, top_k=args.top_k, batch_size=args.batch_size)
    teacher.generate(items[:2], settings)  # warm-up both paths
    ids0 = tok(render(tok, items[0].prompt_messages, True), return_tensors="pt", add_special_tokens=False)
    model.generate(**ids0, max_new_tokens=2, do_sample=False, pad_token_id=teacher.pad_id)

    t0 = time.perf_counter()
    plain_tokens = 0
    with torch.no_grad():
        for it in items:
            enc = tok(render(tok, it.prompt_messages, True), return_tensors="pt", add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=teacher.pad_id, eos_token_id=teacher.eos_id)
            new = out[0, enc["input_ids"].shape[1]:].tolist()
            if teacher.eos_id in new:
                new = new[: new.index(teacher.eos_id) + 1]
            plain_tokens += len(new)
            tok.decode(new, skip_special_tokens=True)
    plain_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    recs = teacher.generate(items, settings)
    ours_s = time.perf_counter() - t0
    ours_tokens = sum(len(r.response_ids) for r in recs)

    plain_tps, ours_tps = plain_tokens / plain_s, ours_tokens / ours_s
    print(f"model {args.model}, {len(items)} prompts, max_new_tokens {args.max_new_tokens}, "
          f"threads {torch.get_num_threads()}")
    print(f"plain HF generate loop : {plain_tokens} tokens in {plain_s:.2f}s = {plain_tps:,.0f} tokens/s")
    print(f"smolforge teacher      : {ours_tokens} tokens in {ours_s:.2f}s = {ours_tps:,.0f} tokens/s "
          f"(batch {args.batch_size}, + top-{args.top_k} logits)")
    print(f"ratio (smolforge / plain): {ours_tps / plain_tps:.2f}")


if __name__ == "__main__":
    main()
