"""Small utilities shared by tests: run the CLI as a real subprocess, write JSONL files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def smolforge(*args: str, timeout: float = 300, env: dict | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """Run `python -m smolforge.cli.main ARGS` the way a user runs `smolforge ARGS`."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "smolforge.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"smolforge {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def ddp_student_worker(rank: int, world: int, port: int, store: str, cfg_kw: dict) -> None:
    """One rank of a data-parallel distillation student (gloo on loopback): spawned by a test."""
    import torch

    from smolforge.config import PeftSpec
    from smolforge.distill.losses import KDConfig
    from smolforge.distill.shard_source import DirShardSource
    from smolforge.distill.student import StudentConfig, train_student
    from smolforge.parallel.rendezvous import init_group, leave_group
    from smolforge.parallel.strategies import make_strategy

    torch.set_num_threads(1)
    init_group("gloo", "127.0.0.1", port, rank, world, 120, secret="test")
    try:
        cfg = StudentConfig(**{**cfg_kw, "peft": PeftSpec(**cfg_kw["peft"]), "kd": KDConfig(**cfg_kw["kd"])})
        train_student(cfg, DirShardSource(Path(store), poll_s=0.05), strategy=make_strategy("ddp"))
    finally:
        leave_group()


MB = 2**20


def post_raw(port: int, path: str, body_bytes: int, token: str | None = None, chunked: bool = False,
             payload: bytes | None = None) -> tuple[int, int]:
    """POST up to `body_bytes` on a raw socket (so the test controls exactly what is sent) and return
    (status, bytes the server let us send). A server that refuses before reading the body answers
    and closes; the rest of the body is then not sent."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {body_bytes}")
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    chunk = payload if payload is not None else b"[" + b"1," * (MB // 2 - 1) + b"1]"
    sent = 0
    try:
        while sent < body_bytes:
            piece = chunk[: body_bytes - sent]
            s.sendall((f"{len(piece):x}\r\n".encode() + piece + b"\r\n") if chunked else piece)
            sent += len(piece)
        if chunked:
            s.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed without reading the rest: what we want
    try:
        data = s.recv(4096)
    except ConnectionResetError:
        data = b""
    finally:
        s.close()
    assert data.startswith(b"HTTP/1.1 "), (path, data[:200])
    return int(data.split()[1]), sent


def rss_mb(pid: int) -> float:
    """A process's resident memory in MiB, from /proc (Linux)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def tiny_train_cfg(root: Path, out: str, steps: int, **kw) -> dict:
    """A TrainConfig dict for tiny-llama on `root/data.jsonl`, fp32, one thread, LoRA without dropout:
    what the strategy tests train with one process and with spawned ranks, to compare the two."""
    from smolforge.models.tiny import preset_dir

    cfg = {"model": str(preset_dir("tiny-llama")), "output_dir": str(root / out),
           "data": {"path": str(root / "data.jsonl"), "max_eval_samples": 5, "max_length": 48},
           "max_steps": steps, "batch_size": 1, "grad_accum": 2, "lr": 1e-3, "seed": 3, "eval_every": 3,
           "max_new_tokens": 3, "device": "cpu", "precision": "fp32", "num_threads": 1, "quiet": True,
           "tensorboard": False, "peft": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0}}
    cfg.update(kw)
    return cfg
