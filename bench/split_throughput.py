"""Split learning over loopback gRPC vs one-process training of the same model, per codec.

Measures, in one run:
- steps/s (wall clock) and CPU time per step (client + server processes) of split training
  (client here, trunk server in its own process on 127.0.0.1) against local training of the
  same model with the same LoRA, data and settings, as ratios;
- bytes on the wire per optimizer step (Forward + Backward + Step messages, protobuf-encoded);
- the loss after N steps (train loss averaged over the last 5 steps, and eval loss) for each
  codec, next to fp32's and local training's.

Both sides get the same number of torch threads; the split run is sequential (the client waits
for the trunk), so at any moment it uses about as many cores as the local run. On a machine
shared with other work, wall-clock numbers drift (two processes also get a bigger share of a
contended CPU than one), so the CPU-time ratio is the steadier measure of the split's overhead.

Example: python bench/split_throughput.py --model tiny-llama --steps 30
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, token: str, ck: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "smolforge.cli.split", "serve", "--model", args.model,
           "--split-point-1", str(args.sp1), "--split-point-2", str(args.sp2), "--lora-rank", str(args.rank),
           "--lora-dropout", "0", "--port", str(port), "--token", token, "--checkpoint-dir", ck,
           "--num-threads", str(args.threads), "--device", args.device]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = [""]
    t = threading.Thread(target=lambda: line.__setitem__(0, proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout=300)
    if "listening" not in line[0]:
        proc.kill()
        raise SystemExit(f"trunk server did not start: {line[0]!r}")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--sp1", type=int, default=1)
    ap.add_argument("--sp2", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--codecs", default="fp32,fp16,bf16,int8")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import psutil
    import torch

    torch.set_num_threads(args.threads)
    from smolforge.config import DataSpec, PeftSpec
    from smolforge.data import load_splits
    from smolforge.models.loading import load_tokenizer
    from smolforge.split.local import build, train_local
    from smolforge.split.trainer import SplitTrainConfig, SplitTrainer
    from smolforge.train.engine import TrainHooks

    tok = load_tokenizer(args.model)
    data = load_splits(DataSpec(path="bundled", max_samples=args.steps * args.batch_size,
                                max_length=args.max_seq_length, max_eval_samples=64), tok)
    token = secrets.token_urlsafe(16)
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="split-bench-"))
    server = start_server(args, port, token, str(work / "server"))
    spec = PeftSpec(r=args.rank, alpha=16, dropout=0.0)
    server_proc = psutil.Process(server.pid)

    def cpu_now() -> float:
        t = server_proc.cpu_times()
        return time.process_time() + t.user + t.system

    marks: dict[int, tuple[float, float]] = {}

    def mark(step: int) -> None:
        """(CPU, wall) time at the end of steps 1 and N: both runs are timed over steps 2..N alone."""
        if step in (1, args.steps):
            marks[step] = (cpu_now(), time.perf_counter())

    def run_local(steps):
        model = build(args.model, spec, seed=0, device=args.device)
        return train_local(model, data.train, tok.pad_token_id, steps=steps, batch_size=args.batch_size,
                           lr=args.lr, seed=0, device=args.device, total_steps=args.steps, on_step=mark)

    def run_split(codec, rep):
        cfg = SplitTrainConfig(model=args.model, split_point_1=args.sp1, split_point_2=args.sp2, server_port=port,
                               token=token, lora_rank=args.rank, lora_dropout=0.0, batch_size=args.batch_size,
                               learning_rate=args.lr, max_steps=args.steps, codec=codec, quiet=True,
                               num_threads=args.threads, device=args.device, max_seq_length=args.max_seq_length,
                               output_dir=str(work / f"{codec}-{rep}"), session_name=f"bench-{codec}-{rep}")
        trainer = SplitTrainer(cfg, TrainHooks(on_step=lambda info: mark(info.step)), splits=data, tokenizer=tok)
        try:
            return trainer.train()
        finally:
            trainer.close()

    codecs = args.codecs.split(",")
    configs = ["local", *codecs]
    speed: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}  # CPU seconds per step, both processes
    results = {}

    try:
        run_local(2)  # warm-up
        # Round-robin repeats, each starting one config later: the load on shared cores drifts, and
        # every config then sees the same drift at every position.
        for rep in range(args.repeats):
            for name in configs[rep % len(configs):] + configs[:rep % len(configs)]:
                marks.clear()
                if name == "local":
                    local = run_local(args.steps)
                else:
                    results[name] = run_split(name, rep)
                (c1, w1), (cn, wn) = marks[1], marks[args.steps]
                cpu[name].append((cn - c1) / (args.steps - 1))
                speed[name].append((args.steps - 1) / (wn - w1))
    finally:
        server.terminate()
        server.wait(timeout=30)

    local_sps = statistics.median(speed["local"])
    local_loss = sum(local.losses[-5:]) / 5
    print(f"\nsplit learning over loopback gRPC: {args.model}, trunk layers [{args.sp1}, {args.sp2}), "
          f"batch {args.batch_size}, {args.steps} steps, LoRA r={args.rank}, {args.threads} thread(s) per side, "
          f"device {args.device}; steps/s = median of {args.repeats} round-robin repeats (min-max); "
          f"CPU-ms/step = client + server process CPU time (robust to other load on the machine)")
    local_cpu = statistics.median(cpu["local"])
    print(f"local (one process): {local_sps:.2f} steps/s ({min(speed['local']):.2f}-{max(speed['local']):.2f}), "
          f"{1000 * local_cpu:.0f} CPU-ms/step, loss(last 5) {local_loss:.4f}\n")
    print(f"{'codec':6} {'split steps/s':>20} {'ratio vs local':>15} {'CPU-ms/step':>12} {'CPU ratio':>10} "
          f"{'KiB/step':>10} {'vs fp32 bytes':>14} {'loss(last 5)':>13} {'Δ vs local':>11} {'eval loss':>10} "
          f"{'Δ eval vs fp32':>15}")
    ref = results.get("fp32", results[codecs[0]])
    fp32_eval = ref.eval.get("eval_loss", float("nan"))
    for codec in codecs:
        res = results[codec]
        sps = statistics.median(speed[codec])
        loss = sum(res.losses[-5:]) / 5
        ev = res.eval.get("eval_loss", float("nan"))
        span = f"{sps:.2f} ({min(speed[codec]):.2f}-{max(speed[codec]):.2f})"
        c = statistics.median(cpu[codec])
        print(f"{codec:6} {span:>20} {sps / local_sps:15.3f} {1000 * c:12.0f} {c / local_cpu:10.3f} "
              f"{res.bytes_per_step / 1024:10.1f} "
              f"{res.bytes_per_step / ref.bytes_per_step:14.3f} {loss:13.4f} {loss - local_loss:+11.2e} {ev:10.4f} "
              f"{ev - fp32_eval:+15.2e}")

if __name__ == "__main__":
    main()
