"""Does KD pay? Teacher, student base, SFT and KD students (off- and on-policy, LoRA and full), over seeds.

The demo's models (trained once and cached under $SMOLFORGE_HOME/demo): the student base is
tiny-llama pretrained on the generic corpus (`smolforge.data.synthetic.generic_corpus`), the teacher
is that base fully fine-tuned on all bundled training examples. The SFT students learn from the
first N labelled examples of the bundled train split (DemoSettings.distill_samples, 512); the KD
students from the teacher's answers to the demo's prompt pool (DemoSettings.kd_data,
`bundled-prompts`: those N prompts and 3,488 more without answers). Every arm trains a student from
the base for the same steps and is scored on the 200 held-out bundled examples:

    sft        the labelled examples' reference answers, CE only (the `reference` backend: what `train` uses)
    kd         the teacher's own answers + its top-k over the prompt pool, the demo's KD settings (DemoSettings)
    seqkd      sequence-level KD: the same store, CE on the teacher's answers only (kd_ratio 0: its text,
               not its distribution), so kd - seqkd is what the logits add over the teacher's text
    kdsame     kd on the labelled prompts only (the same prompts as sft: what the teacher adds per prompt)
    onpolicy   kd, plus GKD: a fraction of the steps on the student's own samples scored by the teacher, JSD(β)
    ref        the labelled prompts' reference answers with the teacher's top-k over them (--teacher-responses reference)
    *-full     the same arm, every weight trained (peft none) at DemoSettings.full_lr; others are LoRA at lora_lr

The gap closed is (arm - sft) / (teacher - sft) in accuracy, on the means, against the SFT arm of the same kind.

    python bench/distill_kd_vs_sft.py --seeds 0,1,2
    python bench/distill_kd_vs_sft.py --arms 'sft,kd,kd:ratio=0.5,kd:T=2,kd:loss=jsd' --seeds 0   # a sweep
    python bench/distill_kd_vs_sft.py --arms sft-full,kd-full,kdsame-full --seeds 0,1,2

An arm may override settings after a colon, ';'-separated: `kd:ratio=0.5;T=2;loss=reverse_kl;lr=1e-3;onp=0.5;beta=0.9;start=0.5` (start: the fraction of
the steps before the first on-policy one; teacher: the backend that writes the arm's store, `hf` (fp32, the default)
or a llama.cpp quantization of the same teacher, `f16`/`q8_0`/`q4_k_m`, exported once and cached: arms with
different teachers get stores from the same prompts; `bench/distill_quant_store.py` compares them).
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

BASE_ARMS = {  # name: (store, overrides)
    "sft": ("sft", {}),
    "kd": ("gen", {}),
    "seqkd": ("gen", {"ratio": 0.0}),
    "kdsame": ("gen-labelled", {}),
    "onpolicy": ("gen", {"onp": 0.5, "loss": "jsd"}),
    "ref": ("ref", {}),
}
KEYS = {"ratio": float, "T": float, "loss": str, "lr": float, "onp": float, "beta": float, "start": float,
        "teacher": str}

from smolforge.models.export.cache import TEACHER_QUANTS as LLAMACPP_QUANTS  # noqa: E402  (`teacher=` values but hf)


def teacher_backend(teacher: str) -> dict:
    """An arm's `teacher=` value -> run_teacher_local's backend keywords."""
    if teacher == "hf":
        return {"backend": "hf"}
    if teacher not in LLAMACPP_QUANTS:
        raise SystemExit(f"unknown teacher {teacher!r}: use hf or a llama.cpp quantization ({', '.join(LLAMACPP_QUANTS)})")
    return {"backend": "llamacpp", "quant": teacher, "n_threads": int(os.environ.get("TEACHER_THREADS", "2"))}


def parse_arm(arm: str) -> tuple[str, str, dict]:
    """'kd-full:ratio=0.5' -> (store kind, peft, overrides)."""
    name, _, rest = arm.partition(":")
    peft = "none" if name.endswith("-full") else "lora"
    base = name.removesuffix("-full")
    if base not in BASE_ARMS:
        raise SystemExit(f"unknown arm {arm!r}: pick from {', '.join(BASE_ARMS)} (+ '-full', ':key=value,...')")
    kind, over = BASE_ARMS[base]
    over = dict(over)
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        if key not in KEYS:
            raise SystemExit(f"unknown arm setting {key!r} in {arm!r}: use {', '.join(KEYS)}")
        over[key] = KEYS[key](value)
    teacher_backend(over.get("teacher", "hf"))  # a bad teacher= fails before anything trains
    return kind, peft, over


def complete_store(d: Path) -> bool:
    """Whether `d` holds a whole store already (its plan and every planned shard)."""
    import json

    from smolforge.distill.store import PLAN_FILE, ready_shards

    plan = d / PLAN_FILE
    return plan.is_file() and len(ready_shards(d)) == int(json.loads(plan.read_text())["num_shards"])


def run(arms: list[str], seeds: list[int], *, steps: int | None = None, prompts: int | None = None,
        kd_data: str | None = None, out: str | Path | None = None) -> dict:
    """Train every arm for every seed; returns the accuracies and what they came from (stores by
    (kind, teacher), the teacher's directory and accuracy, the base's), for main's table and other benches."""
    import torch

    torch.set_num_threads(1)
    from smolforge.distill.demo import (DemoSettings, StudentArm, evaluate_adapter, local_student, student_base,
                                        train_teacher)
    from smolforge.distill.shard_source import DirShardSource
    from smolforge.distill.student import train_student
    from smolforge.distill.teacher import GenSettings, run_teacher_local

    s = DemoSettings()
    if prompts is not None:
        s.distill_samples = prompts or None
    parsed = {a: parse_arm(a) for a in arms}
    out = Path(out or tempfile.mkdtemp(prefix="kd-vs-sft-"))
    t0 = time.time()
    base_dir, _ = student_base(s)
    teacher_dir, info = train_teacher(s)
    base_eval = evaluate_adapter(None, s, base_dir)
    teacher_acc = info["eval"]["accuracy"]
    print(f"teacher: accuracy {teacher_acc:.3f}, eval loss {info['eval']['eval_loss']:.3f}; student base: accuracy "
          f"{base_eval['accuracy']:.3f}, eval loss {base_eval['eval_loss']:.3f} ({time.time() - t0:.0f} s)", flush=True)
    stores: dict[tuple[str, str], Path] = {}
    teacher_seconds: dict[tuple[str, str], float] = {}

    def store(kind: str, teacher: str) -> Path:
        if (kind, teacher) not in stores:
            d = out / (kind if teacher == "hf" else f"{kind}-{teacher}") / "teacher_outputs"
            gen = GenSettings(max_new_tokens=s.max_new_tokens, top_k=s.top_k, batch_size=64,
                              responses="reference" if kind == "ref" else "generate")
            common = dict(num_shards=s.num_shards, max_samples=s.distill_samples, settings=gen, device="cpu",
                          **teacher_backend(teacher))
            started = time.time()
            if complete_store(d):  # a greedy teacher writes the same store again: --out's is reused
                stores[(kind, teacher)], teacher_seconds[(kind, teacher)] = d, time.time() - started
                print(f"store {kind} ({teacher}): reused {d}", flush=True)
                return d
            if kind == "sft":
                run_teacher_local(str(base_dir), "bundled", d, **{**common, "backend": "reference"})
            elif kind == "gen":
                run_teacher_local(str(teacher_dir), kd_data or s.kd_data, d,
                                  **{**common, "max_samples": None if kd_data else s.kd_samples})
            else:
                run_teacher_local(str(teacher_dir), "bundled", d, **common)
            stores[(kind, teacher)], teacher_seconds[(kind, teacher)] = d, time.time() - started
            print(f"store {kind} ({teacher}): {teacher_seconds[(kind, teacher)]:.0f} s", flush=True)
        return stores[(kind, teacher)]

    def prepare(arm: str, seed: int):
        kind, peft, o = parsed[arm]
        name = arm.replace(":", "_").replace(";", "_").replace("=", "-")
        arm_settings = StudentArm(steps=steps, peft=peft, kd_ratio=o.get("ratio"), temperature=o.get("T"),
                                  kd_loss=o.get("loss"), lr=o.get("lr"), on_policy_ratio=o.get("onp", 0.0),
                                  beta=o.get("beta"), on_policy_start=o.get("start", 0.0))
        cfg, model = local_student(s, seed, out / f"{name}-{seed}", arm_settings, teacher=teacher_dir)
        return cfg, model, store(kind, o.get("teacher", "hf"))

    results: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
    # Every student is built before any trains: torch's RNG is process-wide (see local_student).
    jobs = [(arm, seed, *prepare(arm, seed)) for seed in seeds for arm in arms]
    with ThreadPoolExecutor(2) as pool:
        futures = [(arm, seed, pool.submit(lambda c, m, d: train_student(c, DirShardSource(d), model=m).eval,
                                           cfg, model, d)) for arm, seed, cfg, model, d in jobs]
        for arm, seed, fut in futures:
            ev = fut.result()
            results[arm].append((ev["accuracy"], ev["eval_loss"]))
            print(f"{arm:>12} seed {seed}: accuracy {ev['accuracy']:.3f}, eval loss {ev['eval_loss']:.4f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    return {"results": results, "parsed": parsed, "stores": stores, "teacher_seconds": teacher_seconds,
            "teacher_dir": teacher_dir, "teacher_acc": teacher_acc, "base_acc": base_eval["accuracy"],
            "settings": s, "seconds": time.time() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="sft-full,kd-full,kdsame-full,sft,kd,onpolicy",
                    help="comma-separated; settings after ':' separated by ';' (kd:ratio=0.5;T=2;teacher=q8_0)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--prompts", type=int, default=None, help="labelled examples (default: the demo's 512; 0: all)")
    ap.add_argument("--steps", type=int, default=None, help="student steps (default: the demo's)")
    ap.add_argument("--kd-data", default=None,
                    help="prompts the teacher answers for the kd arms (JSONL or a built-in; default: the demo's pool)")
    ap.add_argument("--out", default=None, help="work dir (default: a temp dir)")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    r = run(args.arms.split(","), seeds, steps=args.steps, prompts=args.prompts, kd_data=args.kd_data, out=args.out)
    results, parsed, s, teacher_acc = r["results"], r["parsed"], r["settings"], r["teacher_acc"]

    def sft_of(arm: str) -> str | None:
        ref = "sft-full" if parsed[arm][1] == "none" else "sft"
        return ref if ref in results and ref != arm else None

    print(f"\nlabelled {s.distill_samples or 'all'}, kd prompts {args.kd_data or s.kd_data}, "
          f"{args.steps or s.student_steps} steps, seeds {seeds}; teacher "
          f"{teacher_acc:.3f}, student base {r['base_acc']:.3f}")
    print("| arm | accuracy mean ± sd | per seed | eval loss mean ± sd | gap closed (of the means) | beats SFT |\n"
          "|---|---:|---|---:|---:|---:|")
    for arm, vals in results.items():
        acc, loss = [v[0] for v in vals], [v[1] for v in vals]
        ref = sft_of(arm)
        gap = wins = "-"
        if ref:
            sft_acc = statistics.mean(v[0] for v in results[ref])
            if teacher_acc > sft_acc:
                gap = f"{(statistics.mean(acc) - sft_acc) / (teacher_acc - sft_acc):.0%}"
            wins = f"{sum(a > r[0] for a, r in zip(acc, results[ref]))}/{len(acc)}"
        print(f"| {arm} | {statistics.mean(acc):.3f} ± {statistics.pstdev(acc):.3f} | {', '.join(f'{a:.3f}' for a in acc)} "
              f"| {statistics.mean(loss):.3f} ± {statistics.pstdev(loss):.3f} | {gap} | {wins} |")
    print(f"({r['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
