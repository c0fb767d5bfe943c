"""Does KD beat plain fine-tuning? KD variants against SFT, same student, steps and prompts, over seeds.

The demo teacher (tiny-llama fully fine-tuned on the bundled task; trained and cached under
$SMOLFORGE_HOME/demo on first use) labels the first N prompts of the bundled train split. Every
arm trains the same student (tiny-llama + LoRA, the demo's settings) for the same steps on the
same prompts and is scored on the 200 held-out bundled examples:

    sft     the dataset's reference answers, CE only (the `reference` backend: what `train` uses)
    kd      the teacher's own answers + its top-k, forward KL (the demo's KD)
    ref     the reference answers with the teacher's top-k over them (--teacher-responses reference)
    ref05   the same, kd_ratio 0.5 (half CE)

    python bench/distill_kd_vs_sft.py --prompts 512 --seeds 0,1,2
    python bench/distill_kd_vs_sft.py --prompts 0 --arms sft,kd      # all 4,000 prompts

Students train two at a time, one thread each, so a pair of arms shares the machine evenly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARMS = {  # name: (store, kd_ratio)
    "sft": ("sft", 1.0),
    "kd": ("gen", 1.0),
    "ref": ("ref", 1.0),
    "ref05": ("ref", 0.5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=512, help="distillation prompts (0: all 4,000)")
    ap.add_argument("--arms", default="sft,kd,ref,ref05")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None, help="work dir (default: a temp dir)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from smolforge.distill.demo import DEMO_STUDENT, DemoSettings, local_student, train_teacher
    from smolforge.distill.shard_source import DirShardSource
    from smolforge.distill.student import train_student
    from smolforge.distill.teacher import GenSettings, run_teacher_local

    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}: pick from {', '.join(ARMS)}")
    seeds = [int(x) for x in args.seeds.split(",")]
    out = Path(args.out or tempfile.mkdtemp(prefix="kd-vs-sft-"))
    s = DemoSettings()
    teacher_dir, info = train_teacher(s)
    print(f"teacher: accuracy {info['eval']['accuracy']:.3f}, eval loss {info['eval']['eval_loss']:.3f}", flush=True)
    stores: dict[str, Path] = {}

    def store(kind: str) -> Path:
        if kind not in stores:
            d = out / kind / "teacher_outputs"
            gen = GenSettings(max_new_tokens=s.max_new_tokens, top_k=s.top_k, batch_size=64,
                              responses="reference" if kind == "ref" else "generate")
            common = dict(num_shards=s.num_shards, max_samples=args.prompts or None, settings=gen)
            if kind == "sft":
                run_teacher_local(DEMO_STUDENT, "bundled", d, backend="reference", **common)
            else:
                run_teacher_local(str(teacher_dir), "bundled", d, device="cpu", **common)
            stores[kind] = d
        return stores[kind]

    def prepare(arm: str, seed: int):
        kind, ratio = ARMS[arm]
        return (*local_student(s, seed, out / f"{arm}-{seed}", steps=args.steps, kd_ratio=ratio), store(kind))

    results: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
    t0 = time.time()
    # Every student is built before any trains: torch's RNG is process-wide (see local_student).
    jobs = [(arm, seed, *prepare(arm, seed)) for seed in seeds for arm in arms]
    with ThreadPoolExecutor(2) as pool:
        futures = [(arm, seed, pool.submit(lambda c, m, d: train_student(c, DirShardSource(d), model=m).eval,
                                           cfg, model, d)) for arm, seed, cfg, model, d in jobs]
        for arm, seed, fut in futures:
            ev = fut.result()
            results[arm].append((ev["accuracy"], ev["eval_loss"]))
            print(f"{arm:>6} seed {seed}: accuracy {ev['accuracy']:.3f}, eval loss {ev['eval_loss']:.4f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    print(f"\nprompts {args.prompts or 'all'}, {args.steps} steps, seeds {seeds}")
    print("| arm | accuracy mean ± sd | per seed | eval loss mean ± sd | per seed |\n|---|---:|---|---:|---|")
    for arm, vals in results.items():
        acc, loss = [v[0] for v in vals], [v[1] for v in vals]
        print(f"| {arm} | {statistics.mean(acc):.3f} ± {statistics.pstdev(acc):.3f} | {', '.join(f'{a:.3f}' for a in acc)} "
              f"| {statistics.mean(loss):.3f} ± {statistics.pstdev(loss):.3f} | {', '.join(f'{x:.3f}' for x in loss)} |")


if __name__ == "__main__":
    main()
