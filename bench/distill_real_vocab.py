"""Distillation at a real vocabulary: `smolforge distill` with the full-size Qwen2.5-0.5B-Instruct twin as the
teacher (V = 151,936) and the reduced Qwen2.5 twin (2 layers, hidden 112, the same tokenizer) as the student.

`twin_store.py` measures the teacher's store alone; this runs the whole pipeline the user runs (the CLI,
on the embedded cluster: teacher task -> store -> streaming student -> eval), and records what V = 151,936
costs or breaks: store bytes per response token against an fp16 full-vocabulary store (2·V), the shards'
reconstruction KL (codec) and truncation KL (what top-k drops), teacher response tokens/s (from the shards'
manifests: generation and top-k, not the model's load), whether the student trained on logits (equal
tokenizer hashes) or fell back to the teacher's text, and the student's steps and held-out eval loss before
(the student base, same eval code and examples) and after.

The twins have random weights: the teacher's next-token rows are nearly flat over 151,936 ids, so its KL
numbers are the flat case (tiny codec KL, large truncation KL), not a trained teacher's, and its text is
random tokens: the student's eval loss on the bundled answers measures the pipeline, not what KD teaches.

    OMP_NUM_THREADS=1 .venv/bin/python bench/distill_real_vocab.py --prompts 32 --tokens 16 --steps 20
    OMP_NUM_THREADS=1 .venv/bin/python bench/distill_real_vocab.py --prompts 32 --tokens 16 --steps 20 --teacher-backend llamacpp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from distill_quant_store import teacher_rate  # noqa: E402  (bench/ is on sys.path)

TEACHER = "twin:qwen2.5-0.5b-instruct@full"
STUDENT = "twin:qwen2.5-0.5b-instruct"


def base_eval(student: str, max_length: int) -> dict:
    """The student base's held-out eval loss, by the code and examples the distill students use after training."""
    import torch

    from smolforge.distill.student import StudentConfig, evaluate_student
    from smolforge.models.loading import load_model, load_tokenizer

    torch.set_num_threads(1)
    cfg = StudentConfig(base_model=student, output_dir=tempfile.mkdtemp(), max_length=max_length, eval_accuracy=False)
    model = load_model(student).float().eval()
    return evaluate_student(model, load_tokenizer(student), "bundled", cfg, torch.device("cpu"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default=TEACHER)
    ap.add_argument("--student", default=STUDENT)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="teacher max_new_tokens")
    ap.add_argument("--steps", type=int, default=40, help="student steps")
    ap.add_argument("--peft", default="none", help="the student's PEFT (none: every weight, the whole V-row embedding)")
    ap.add_argument("--teacher-backend", default="hf", help="hf (fp32) or llamacpp (the teacher's cached GGUF export)")
    ap.add_argument("--teacher-quant", default="q8_0", help="llamacpp: f16|q8_0|q4_k_m")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="distill-real-vocab-")) / "run"
    max_length = 128
    before = base_eval(args.student, max_length)
    print(f"student base eval loss {before['eval_loss']:.3f}", flush=True)
    cmd = [str(Path(sys.executable).with_name("smolforge")), "distill", "--teacher", args.teacher,
           "--student", args.student, "--data", "bundled", "--max-samples", str(args.prompts),
           "--max-new-tokens", str(args.tokens), "--num-teachers", "1", "--num-students", "1", "--num-shards", "2",
           "--max-steps", str(args.steps), "--batch-size", "8", "--max-length", str(max_length), "--peft", args.peft,
           "--aggregate", "none", "--teacher-backend", args.teacher_backend, "--teacher-quant", args.teacher_quant,
           "--device", "cpu", "--output-dir", str(out), "--json", "--quiet"]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.time() - t0
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
        raise SystemExit(f"smolforge distill exited {proc.returncode}")
    summary = json.loads((out / "distill_summary.json").read_text())
    store = summary["store"]
    tokens, secs, rate = teacher_rate(out / "teacher_outputs")
    student = summary["per_student"][0]
    ev = student.get("eval") or {}
    print(f"\n{args.teacher} ({args.teacher_backend}{'' if args.teacher_backend == 'hf' else ' ' + args.teacher_quant}) -> {args.student}, {args.prompts} prompts x {args.tokens} tokens, k {store['k']}, "
          f"student peft {args.peft}, {wall:.0f} s wall (stages {summary['stage_seconds']})")
    print("| V | response tokens | bytes/token (top-k part) | fp16 full vocab | ratio | codec KL mean (max) | "
          "top-k truncation KL mean | teacher tokens/s | student mode | steps | eval loss first → last |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---|")
    print(f"| {store['vocab_size']:,} | {tokens:,} | {store['bytes_per_token']:.1f} ({store['topk_bytes_per_token']:.1f}) "
          f"| {store['fp16_full_vocab_bytes_per_token']:,} | {store['ratio_vs_fp16_full']:.5f} | "
          f"{store['reconstruction_kl_mean']:.1e} ({store['reconstruction_kl_max']:.1e}) | "
          f"{store['truncation_kl_mean']:.2f} | {rate:.1f} ({secs:.0f} s) | {student.get('kd')} | {student.get('steps')} | "
          f"{before['eval_loss']:.3f} → {ev.get('eval_loss', float('nan')):.3f} |")
    print(f"student: final train loss {student.get('loss')}, eval {ev}")


if __name__ == "__main__":
    main()
