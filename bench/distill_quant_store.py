"""What a quantized teacher costs the student: KD from a llama.cpp q8_0 store against the fp32 store (issue 32).

The demo's teacher (tiny-llama pretrained on the generic corpus, then fully fine-tuned on the bundled task;
`distill_kd_vs_sft.py`, cached under $SMOLFORGE_HOME/demo) answers the demo's 4,000-prompt pool twice: in
transformers fp32 (`--teacher-backend hf`) and as its GGUF export in llama.cpp (`--teacher-backend llamacpp
--teacher-quant q8_0`: exported once and cached). Students train from each store, same arm, steps and seeds
(`distill_kd_vs_sft.run`, arms `kd-full` and `kd-full:teacher=q8_0`), scored on the 200 held-out examples.

Against the fp32 teacher, for every response token of a sample of the quantized store's records (the
fp32 teacher re-run over that store's prompt + response, teacher forcing):
    KL vs fp32   KL(stored k+1 buckets || the fp32 teacher's mass on the same k ids and the rest), nats/token:
                 the manifest's codec KL with the fp32 teacher as the reference, so it adds the quantization;
                 for the fp32 store it is the codec's error alone (the baseline in the same run)
    top-1        the stored row's most likely id is the fp32 teacher's argmax at that position
    same text    responses token-for-token equal to the fp32 store's for the same prompt (greedy both)

    TEACHER_THREADS=2 .venv/bin/python bench/distill_quant_store.py --quant q8_0 --seeds 0,1,2 --steps 600
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import distill_kd_vs_sft as kvs  # noqa: E402  (bench/ is the script's directory, so on sys.path)


def records(store_dir: Path) -> dict[int, object]:
    """Every record of a store by prompt (example id)."""
    from smolforge.distill.store import read_shard, ready_shards

    return {r.example_id: r for sid in ready_shards(store_dir) for r in read_shard(store_dir, sid).records}


def fidelity(teacher_dir: Path, store_dir: Path, sample: int) -> dict:
    """KL against the fp32 teacher and top-1 agreement over the first `sample` records of a store."""
    import numpy as np
    import torch

    from smolforge.distill.topk_codec import bucket_kl
    from smolforge.models.loading import load_model

    model = load_model(str(teacher_dir)).float().eval()
    recs = [r for _, r in sorted(records(store_dir).items()) if r.has_topk and r.response_ids][:sample]
    kls, top1 = [], []
    with torch.no_grad():
        for r in recs:
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            n, p = len(r.response_ids), len(r.prompt_ids)
            logp = torch.log_softmax(model(ids).logits[0, p - 1:p - 1 + n].float(), dim=-1).numpy()
            idx = np.asarray(r.topk_indices, np.int64)
            exact = np.take_along_axis(logp, idx, axis=1)
            tail = np.clip(1.0 - np.exp(exact.astype(np.float64)).sum(axis=1), 0.0, 1.0)
            kls.append(bucket_kl(r.topk_logprobs, r.tail_mass, exact, tail))
            stored_top = idx[np.arange(n), np.argmax(r.topk_logprobs, axis=1)]
            top1.append(stored_top == logp.argmax(axis=1))
    kl, agree = np.concatenate(kls), np.concatenate(top1)
    return {"records": len(recs), "tokens": int(kl.size), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": float(agree.mean())}


def teacher_rate(store_dir: Path) -> tuple[int, float, float]:
    """(response tokens, teacher seconds, tokens/s) summed over the shards' manifests (generation + top-k, no loading)."""
    from smolforge.distill.store import read_manifest, ready_shards

    ms = [read_manifest(store_dir, sid) or {} for sid in ready_shards(store_dir)]
    tokens, secs = sum(m.get("num_response_tokens", 0) for m in ms), sum(m.get("seconds", 0.0) for m in ms)
    return tokens, secs, tokens / max(secs, 1e-9)


def same_text(a: Path, b: Path) -> tuple[float, float]:
    """(share of prompts with identical responses, share of token positions equal) between two stores."""
    ra, rb = records(a), records(b)
    common = sorted(set(ra) & set(rb))
    same = sum(ra[i].response_ids == rb[i].response_ids for i in common)
    pos = eq = 0
    for i in common:
        x, y = ra[i].response_ids, rb[i].response_ids
        pos += max(len(x), len(y))
        eq += sum(u == v for u, v in zip(x, y))
    return same / max(1, len(common)), eq / max(1, pos)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="q8_0", choices=kvs.LLAMACPP_QUANTS)
    ap.add_argument("--arm", default="kd-full", help="the distill_kd_vs_sft arm both stores train (default kd-full)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=None, help="student steps (default: the demo's 600)")
    ap.add_argument("--sample", type=int, default=500, help="records scored against the fp32 teacher per store")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from smolforge.distill.store import read_manifest, store_summary

    seeds = [int(x) for x in args.seeds.split(",")]
    quant_arm = f"{args.arm}{';' if ':' in args.arm else ':'}teacher={args.quant}"
    r = kvs.run([args.arm, quant_arm], seeds, steps=args.steps, out=args.out)
    kind = r["parsed"][args.arm][0]
    fp32_dir, quant_dir = r["stores"][(kind, "hf")], r["stores"][(kind, args.quant)]
    print(f"\n{args.arm}, {args.steps or r['settings'].student_steps} steps, seeds {seeds}; teacher (fp32) accuracy "
          f"{r['teacher_acc']:.3f}")
    print("| store | teacher s (tokens/s) | student accuracy mean ± sd | per seed | eval loss mean | manifest codec KL | "
          "KL vs fp32 teacher mean (max) | top-1 = fp32 |\n|---|---:|---:|---|---:|---:|---:|---:|")
    accs = {}
    for label, arm, d in (("hf fp32", args.arm, fp32_dir), (f"llamacpp {args.quant}", quant_arm, quant_dir)):
        acc = [v[0] for v in r["results"][arm]]
        loss = [v[1] for v in r["results"][arm]]
        accs[label] = statistics.mean(acc)
        f = fidelity(r["teacher_dir"], d, args.sample)
        summ = store_summary(d)
        _, secs, rate = teacher_rate(d)
        print(f"| {label} | {secs:.0f} ({rate:,.0f}) | "
              f"{statistics.mean(acc):.3f} ± {statistics.pstdev(acc):.3f} | {', '.join(f'{a:.3f}' for a in acc)} | "
              f"{statistics.mean(loss):.3f} | {summ['reconstruction_kl_mean']:.1e} | "
              f"{f['kl_mean']:.1e} ({f['kl_max']:.1e}) | {f['top1']:.2%} ({f['tokens']} tokens) |", flush=True)
    diff = accs[f"llamacpp {args.quant}"] - accs["hf fp32"]
    prompts, tokens = same_text(fp32_dir, quant_dir)
    gguf = (read_manifest(quant_dir, 0) or {}).get("gguf")
    print(f"\naccuracy difference ({args.quant} - fp32, of the means): {diff * 100:+.1f} points (goal |d| <= 1)")
    print(f"responses identical to the fp32 store's: {prompts:.1%} of prompts, {tokens:.1%} of token positions")
    print(f"the {args.quant} shards' manifest gguf entry: {gguf}")
    print(f"({r['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
