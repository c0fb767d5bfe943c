"""What one GPU can prove (issue 31, item 4): run it on a machine with CUDA and paste the table into
BENCHMARKS.md. CI never has a GPU; `--device cpu --tiny` runs every row on the CPU at a tiny size
(small-llama, a few steps and tokens) so the script itself is checked (`tests/test_gpu_proof.py`).

Rows, each measured in this run, its baseline beside it:

1. training, one rank (`smolforge.train.engine.train`, LoRA, packed bundled tasks): tokens/s in bf16
   autocast against fp32 on the same device (`bench/train_throughput.py`'s config and token count);
2. a teacher (`--teacher-backend hf`) on the device writing a store: generate, top-k, encode and write
   the shards (`bench/teacher_backends.py`'s `timed_store`), tokens/s;
3. `smolforge serve` on the device against HF `generate` on the device, one stream, tokens/s
   (`bench/serve.py`'s `hf_side` and `serve_side`);
4. `smolforge serve --stages 2 --device D` on an embedded cluster of this machine (a GPU node) against
   one-process serve. What it cannot express: pinning one stage to the GPU and the other to a CPU.
   A staged serve job's `device` is every stage's (`cluster/workloads/serve/stages.py`: the actors
   reserve CPUs, no `num_gpus`; Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for an actor that reserves
   no GPU, so they see it), and an embedded cluster is one node, so both stages run on that node's
   device; the row says so. If the staged job does not start, the row says skipped, and why.

    .venv/bin/python bench/gpu_proof.py                      # CUDA: llama-100m, the defaults
    .venv/bin/python bench/gpu_proof.py --model twin:qwen2.5-0.5b-instruct@full --steps 20
    .venv/bin/python bench/gpu_proof.py --device cpu --tiny  # the check, on any machine

Without CUDA and without `--device cpu` it exits 2 with one line saying so.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = ("train", "teacher", "serve", "staged")
NO_CUDA = "gpu_proof: no CUDA device here; run it on a GPU machine, or pass --device cpu to check it on the CPU"


@dataclass
class Row:
    what: str
    measured: str
    baseline: str
    ratio: float | None
    note: str = ""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a check of the script)")
    ap.add_argument("--model", default=None, help="default: llama-100m on CUDA, small-llama with --tiny")
    ap.add_argument("--tiny", action="store_true", help="a few steps, prompts and tokens: seconds, not minutes")
    ap.add_argument("--steps", type=int, default=None, help="timed training steps (default 20; --tiny 2)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"which rows, comma-separated: {','.join(ROWS)}")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per process (the serve rows)")
    args = ap.parse_args(argv)
    args.model = args.model or ("small-llama" if args.tiny else "llama-100m")
    args.steps = args.steps or (2 if args.tiny else 20)
    args.warmup, args.batch_size, args.seq = (1, 2, 64) if args.tiny else (3, 8, 256)
    args.prompts, args.max_tokens = (2, 4) if args.tiny else (32, 64)
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        ap.error(f"--rows {','.join(unknown)}: choose from {','.join(ROWS)}")
    return args


def train_row(args) -> Row:
    """Tokens/s of the engine's timed steps, bf16 autocast against fp32, on the device."""
    from train_throughput import _tps, make_cfg

    from smolforge.config import DataSpec
    from smolforge.data.splits import load_splits
    from smolforge.models.loading import load_tokenizer
    from smolforge.train.engine import TrainHooks, train

    tok = load_tokenizer(args.model)
    splits = load_splits(DataSpec(path="bundled", max_length=args.seq, packing=True, max_eval_samples=1), tok)
    rates = {}
    for precision in ("fp32", "bf16"):
        with tempfile.TemporaryDirectory() as out:
            cfg = make_cfg(args, out, precision).model_copy(update={"device": args.device})
            times: list[float] = []
            train(cfg, TrainHooks(on_step=lambda info: times.append(time.perf_counter())), splits=splits, tokenizer=tok)
        rates[precision] = _tps(args, splits, times)
    return Row(f"train 1 rank, LoRA, {args.batch_size} x {args.seq} tokens: bf16 vs fp32",
               f"{rates['bf16']:,.0f} tok/s", f"{rates['fp32']:,.0f} tok/s", rates["bf16"] / rates["fp32"])


def teacher_row(args) -> Row:
    """The hf teacher writing a store on the device: tokens/s, against one prompt at a time through HF
    `generate` on the same device (the loop a script would write; no top-k, no store)."""
    import torch
    from teacher_backends import timed_store

    from smolforge.data.encode import render
    from smolforge.distill.prompts import GenSettings
    from smolforge.distill.teacher import HFTeacher, prompts_from_dataset

    items = prompts_from_dataset("bundled", max_samples=args.prompts)
    teacher = HFTeacher(args.model, device=args.device)
    settings = GenSettings(max_new_tokens=args.max_tokens, top_k=32, batch_size=min(16, len(items)))
    seconds, records = timed_store(teacher, items, settings, repeat=1)
    store_tps = sum(len(r.response_ids) for r in records) / seconds
    tok, model, plain, t0 = teacher.tokenizer, teacher.model, 0, time.perf_counter()
    with torch.no_grad():
        for it in items:
            enc = tok(render(tok, it.prompt_messages, True), return_tensors="pt", add_special_tokens=False)
            out = model.generate(**enc.to(teacher.device), max_new_tokens=args.max_tokens, do_sample=False,
                                 pad_token_id=teacher.pad_id, eos_token_id=teacher.eos_id)
            plain += out.shape[1] - enc["input_ids"].shape[1]
    plain_tps = plain / (time.perf_counter() - t0)
    return Row(f"teacher (hf) writing a store, {len(items)} prompts: vs HF generate one by one",
               f"{store_tps:,.0f} tok/s", f"{plain_tps:,.0f} tok/s", store_tps / plain_tps)


def serve_rows(args, tmp: Path, rows: list[str]) -> list[Row]:
    """`smolforge serve` against HF generate, one stream; then 2 stages against one-process serve."""
    from serve import hf_side, printable, serve_side, staged_side

    from smolforge.models.tiny import is_preset, preset_dir

    model_dir = printable(str(preset_dir(args.model)) if is_preset(args.model) else args.model, tmp)
    sv = serve_side(model_dir, args.max_tokens, args.threads, tmp / "serve", args.device)
    out = []
    if "serve" in rows:
        hf = hf_side(model_dir, args.max_tokens, args.threads, args.device)
        out.append(Row("serve, 1 stream: vs HF generate", f"{sv['one_stream_tok_s']:,.1f} tok/s",
                       f"{hf['one_stream_tok_s']:,.1f} tok/s", sv["one_stream_tok_s"] / hf["one_stream_tok_s"]))
    if "staged" in rows:
        try:
            st = staged_side(model_dir, args.max_tokens, args.threads, tmp, 2, device=args.device)
        except (SystemExit, Exception) as err:  # the row says why, the others stand
            print(f"gpu_proof: the staged row did not run: {str(err)[-2000:]}", file=sys.stderr)
            return out + [Row("serve --stages 2 on the embedded cluster", "-", "-", None,
                              f"skipped: did not start ({type(err).__name__}; its log is above)")]
        out.append(Row(f"serve --stages 2 on the embedded cluster's {args.device} node, 1 stream: vs serve",
                       f"{st['one_stream_tok_s']:,.1f} tok/s", f"{sv['one_stream_tok_s']:,.1f} tok/s",
                       st["one_stream_tok_s"] / sv["one_stream_tok_s"],
                       "both stages on this node's device: one stage alone on a GPU cannot be asked for"))
    return out


def table(rows: list[Row], args) -> str:
    lines = [f"model {args.model} on {args.device}{' (tiny check)' if args.tiny else ''}, "
             f"{args.max_tokens} new tokens per prompt, greedy",
             "", "| what | measured | baseline | ratio | note |", "|---|---:|---:|---:|---|"]
    for r in rows:
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else "-"
        lines.append(f"| {r.what} | {r.measured} | {r.baseline} | {ratio} | {r.note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    if args.device not in ("cuda", "cpu"):
        print(f"gpu_proof: --device {args.device}: choose cuda or cpu", file=sys.stderr)
        return 2
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    rows: list[Row] = []
    if "train" in args.rows:
        rows.append(train_row(args))
    if "teacher" in args.rows:
        rows.append(teacher_row(args))
    if {"serve", "staged"} & set(args.rows):
        rows += serve_rows(args, Path(tempfile.mkdtemp(prefix="sfgpu")), args.rows)
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
