"""Small utilities shared by tests: run the CLI as a real subprocess, write JSONL files."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"  # the browser tests drive Debian's package, by this path


def in_ci() -> bool:
    """CI sets CI=true (GitHub Actions, GitLab and most others do)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require(present: bool, what: str, install: str) -> None:
    """A test that needs something installed: skipped without it on a developer's machine, but FAILED
    under CI (CI=true). Why: a skip is green, so a failed install (a `smolforge[export]` build that
    broke, a missing apt package) would otherwise pass CI with the feature's only proof never run."""
    __tracebackhide__ = True  # the report points at the test's line, not this one
    if present:
        return
    msg = f"{what} is missing; fix: {install}"
    if in_ci():
        pytest.fail(f"{msg} (CI=true: a missing dependency fails the test instead of skipping it)", pytrace=False)
    pytest.skip(msg)


def require_module(name: str, what: str, install: str):
    """The module `name`, imported, or `require`'s skip/fail when it cannot be imported."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(name)
    except ImportError as err:
        error = err  # failed outside the except block: one message, not a chained ImportError
    require(False, f"{what} [import {name}: {error}]", install)


def require_chromium() -> str:
    """The path of the headless browser the page tests drive, or `require`'s skip/fail."""
    __tracebackhide__ = True
    require(os.path.exists(CHROMIUM), CHROMIUM, "apt-get install chromium (Debian's package; .ci/run does it as root)")
    return CHROMIUM


def smolforge(*args: str, timeout: float = 300, env: dict | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """Run `python -m smolforge.cli.main ARGS` the way a user runs `smolforge ARGS`."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "smolforge.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"smolforge {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def smolforge_here(*args: str):
    """`smolforge ARGS` in this process (typer's runner: no interpreter to start, no torch to import again,
    seconds each on the 2-core machine): a click `Result` with exit_code, stdout and stderr apart. For a
    claim about what a command decides; a claim about a real process (a kill, a signal) needs `smolforge`.
    torch's thread count is put back after it (a run without --num-threads takes every CPU), so the tests
    after it in this process compute as before."""
    import torch
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(app, list(args), env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None})
    finally:
        torch.set_num_threads(threads)


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


def tree_rss_mb(pid: int) -> float:
    """A process's resident memory and its children's, in MiB: `smolforge serve` is two processes (the
    engine's and, by default, the HTTP front that reads the bodies)."""
    kids = [int(k) for t in os.listdir(f"/proc/{pid}/task") for k in open(f"/proc/{pid}/task/{t}/children").read().split()]
    return rss_mb(pid) + sum(tree_rss_mb(k) for k in kids)


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


def train_dict(cfg: dict, strategy=None, pause_after: int = 0):
    """engine.train on a TrainConfig dict (as `tiny_train_cfg` makes); with `pause_after`, a pause is asked
    for once that many steps are done (rank 0's request is the one the ranks agree on). Returns (the
    TrainResult, what the hooks saw: {"steps": [StepInfo, ...], "evals": [{"step", "eval_loss", ...}, ...]})."""
    from smolforge.config import TrainConfig
    from smolforge.train.engine import TrainHooks, train

    seen: dict[str, list] = {"steps": [], "evals": []}

    def should_stop():
        return "pause" if pause_after and len(seen["steps"]) >= pause_after else None

    hooks = TrainHooks(on_step=seen["steps"].append, on_eval=seen["evals"].append, should_stop=should_stop)
    return train(TrainConfig.model_validate(cfg), hooks, strategy=strategy), seen


def adapter_weights(result, name: str = "adapter_model.safetensors") -> dict:
    """The tensors a finished run saved (a TrainResult or its to_dict())."""
    from safetensors.torch import load_file

    adapter_dir = result["adapter_dir"] if isinstance(result, dict) else result.adapter_dir
    return load_file(str(Path(adapter_dir) / name))


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5, rtol: float = 0.0) -> None:
    """Same names, and every tensor close; the message names the tensor that is not."""
    import torch

    assert a.keys() == b.keys() and a, (sorted(a)[:3], sorted(b)[:3])
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")


def _gloo_rank(work, rank: int, world: int, port: int, args: tuple, out) -> None:
    """One spawned rank: a gloo group on loopback, then `work(rank, *args)`; its result, or its traceback, goes
    to the test through `out` (a rank that fails says why, instead of leaving only an exit code)."""
    import traceback

    import torch

    from smolforge.parallel.rendezvous import init_group, leave_group

    torch.set_num_threads(1)
    init_group("gloo", "127.0.0.1", port, rank, world, 120, secret="test")
    try:
        out.put((rank, True, work(rank, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
        raise
    finally:
        leave_group()


def run_gloo_ranks(work, world: int, *args, meanwhile=None, timeout: float = 600) -> tuple[dict, object]:
    """`work(rank, *args)` in `world` spawned processes joined in one gloo group (a module-level function: spawn
    pickles it by name), while this process computes `meanwhile()`. Returns ({rank: work's result},
    meanwhile's result). A rank that fails or dies fails the test with its traceback or exit code; ranks still
    running when the test gives up are terminated (they may wait in a collective for a peer that died)."""
    import multiprocessing as mp
    import queue as queues
    import time

    from smolforge.cluster.nodes.statedir import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(work, r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        extra = meanwhile() if meanwhile else None
        deadline = time.monotonic() + timeout
        while len(got) < world:
            assert time.monotonic() < deadline, f"ranks {sorted(set(range(world)) - set(got))} gave nothing in {timeout} s"
            try:
                rank, ok, res = out.get(timeout=2)
            except queues.Empty:  # a rank that died has nothing to send
                assert all(p.is_alive() or p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
                continue
            assert ok, f"rank {rank} failed:\n{res}"
            got[rank] = res
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()
                p.join(10)
    assert [p.exitcode for p in procs] == [0] * world
    return got, extra


def llama_ubatch_counter():
    """(callback, counts) for a llama.cpp context's `cb_eval`: counts[0] grows by one per ubatch the
    context computes (llama.cpp asks about the graph's output node once per ubatch); no node's data is
    wanted. Keep the callback alive as long as the context."""
    import ctypes

    import llama_cpp

    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_get_name.restype, ggml.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    counts = [0]

    @llama_cpp.ggml_backend_sched_eval_callback
    def seen(tensor, ask, _data):
        if ask and ggml.ggml_get_name(tensor) == b"result_output":
            counts[0] += 1
        return False

    return seen, counts


def byte_fallback_tokenizer(pieces: list[str]):
    """A Llama-style tokenizer built from a vocabulary, no download: `<unk> <s> </s>`, the 256 `<0xNN>` byte
    tokens, then `pieces` (Metaspace "▁" for a space, no merges), byte fallback, the first space stripped on
    decode. Returns (the tokenizer, piece -> id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
    return fast, {p: i for i, p in enumerate(pieces)}
