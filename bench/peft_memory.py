"""Peak training memory of each PEFT method, against full fine-tuning measured in the same run.

Each method runs in its own fresh Python process (so one method's allocations cannot hide
another's): load the model, apply the method, then train N AdamW steps on a fixed random batch
(batch 8 x seq 128 by default). What we report is the training overhead: peak RSS during
training minus RSS right after the model was loaded and the method applied. It includes
gradients, optimizer state and activations, which are what PEFT saves.

transformers maps the safetensors file lazily, so the worker reads every weight once before
taking the baseline (otherwise the first forward would page the weights in and count them).
On Linux the kernel's peak-RSS counter (VmHWM) is reset after loading (`/proc/self/clear_refs`),
so load-time spikes do not count; elsewhere a 2 ms RSS sampler is used instead. On `--device
cuda` the CUDA allocator's peak is reported in the same way (peak allocated minus allocated
after load).

Example:
    .venv/bin/python bench/peft_memory.py --model small-llama --steps 3
    .venv/bin/python bench/peft_memory.py --model llama-100m --steps 2 --methods none lora adapter
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

METHODS = ("none", "lora", "prefix", "prompt", "ia3", "adapter")
MiB = 1024 * 1024


# --------------------------------------------------------------------------- worker (one method)


def _proc_status_kib(key: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else None


class PeakRss:
    """Peak RSS from now on: the kernel's VmHWM after a reset, else a sampling thread."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.kernel = False
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.kernel = _proc_status_kib("VmHWM") is not None
        except OSError:
            pass
        self._peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        if not self.kernel:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def peak(self) -> int:
        if self.kernel:
            return _proc_status_kib("VmHWM") * 1024
        self._stop.set()
        self._thread.join()
        return max(self._peak, self._proc.memory_info().rss)


def worker(args: argparse.Namespace) -> dict:
    import gc

    import psutil
    import torch

    from smolforge.models.loading import load_model, pick_device
    from smolforge.models.peft_methods import apply_peft, enable_gradient_checkpointing, trainable_summary
    from smolforge.models.peft_spec import peft_spec_from_cli

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = pick_device(args.device)
    model = apply_peft(load_model(args.model, device=device), peft_spec_from_cli(args.method, args.peft_config))
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    trainable, total = trainable_summary(model)
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    # transformers maps safetensors files lazily: weights only become resident when first read.
    # Read them all now, so the baseline is a loaded model and not half a model.
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.float().sum().item()

    gc.collect()
    rss_loaded = psutil.Process().memory_info().rss
    if device.type == "cuda":
        torch.cuda.synchronize()
        cuda_loaded = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    meter = PeakRss()
    losses, step_times = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
    result = {
        "method": args.method,
        "model": args.model,
        "device": str(device),
        "trainable": trainable,
        "total": total,
        "rss_loaded_mib": rss_loaded / MiB,
        "peak_rss_mib": meter.peak() / MiB,
        "peak_source": "VmHWM" if meter.kernel else "sampler",
        "first_loss": losses[0],
        "last_loss": losses[-1],
        # the first step allocates optimizer state; later steps show the steady rate
        "s_per_step": sum(step_times[1:]) / max(1, len(step_times) - 1) if len(step_times) > 1 else step_times[0],
    }
    result["train_overhead_mib"] = result["peak_rss_mib"] - result["rss_loaded_mib"]
    if device.type == "cuda":
        result["cuda_overhead_mib"] = (torch.cuda.max_memory_allocated() - cuda_loaded) / MiB
    return result


# --------------------------------------------------------------------------- driver


def run_method(method: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--method", method, "--model", args.model,
           "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
           "--threads", str(args.threads), "--device", args.device]
    if args.gradient_checkpointing:
        cmd.append("--gradient-checkpointing")
    if args.peft_config:
        cmd += ["--peft-config", args.peft_config]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.malloc_mmap_threshold:
        # A fixed threshold turns off glibc's sliding one, so big tensors are mmapped and given
        # back on free: RSS then follows live memory instead of heap fragmentation.
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{method} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def render(rows: list[dict], args: argparse.Namespace) -> str:
    base = next(r for r in rows if r["method"] == "none")
    key = "cuda_overhead_mib" if "cuda_overhead_mib" in base else "train_overhead_mib"
    what = "CUDA peak alloc" if key == "cuda_overhead_mib" else "peak RSS"
    out = [
        f"model {args.model} ({base['total']:,} params), batch {args.batch} x seq {args.seq}, {args.steps} AdamW steps, "
        f"{args.threads} threads, device {base['device']}"
        + (", gradient checkpointing" if args.gradient_checkpointing else "")
        + (f", --peft-config {args.peft_config}" if args.peft_config else "")
        + (f", MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}" if args.malloc_mmap_threshold else ""),
        f"training overhead = {what} during training - after load (each method in a fresh process; "
        f"peak from {base['peak_source']})",
        "",
        f"| method | trainable params | trainable % | loaded RSS MiB | overhead MiB | vs none | s/step |",
        f"|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r[key] / base[key] if base[key] > 0 else float("nan")
        out.append(
            f"| {r['method']} | {r['trainable']:,} | {100 * r['trainable'] / r['total']:.2f} | "
            f"{r['rss_loaded_mib']:.0f} | {r[key]:.1f} | {ratio:.2f} | {r['s_per_step']:.3f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small-llama", help="preset, local dir or HF id (default small-llama)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per worker")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--peft-config", default=None, help='JSON for every method, e.g. \'{"dropout": 0}\'')
    p.add_argument("--malloc-mmap-threshold", type=int, default=0, metavar="BYTES",
                   help="set MALLOC_MMAP_THRESHOLD_ for the workers (e.g. 131072); default: glibc's own")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per method")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON object at the end")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default="none", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return

    # Build the preset once up front, so that no worker pays for (or races on) building it.
    from smolforge.models.loading import resolve_model

    resolve_model(args.model)
    methods = ["none"] + [m for m in args.methods if m != "none"]  # the baseline always runs
    rows = []
    for method in methods:
        t0 = time.perf_counter()
        rows.append(run_method(method, args))
        print(f"  {method}: {rows[-1]['train_overhead_mib']:.1f} MiB over load ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr, flush=True)
    print(render(rows, args))
    if args.json:
        print(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("worker", "method")}, "rows": rows}))


if __name__ == "__main__":
    main()
