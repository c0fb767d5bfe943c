"""Checkpoints on both sides: resume equals an uninterrupted run, a killed server is survived, merge works.

All runs here use LoRA dropout 0.1, so they also prove that the seeded dropout makes a resumed or
replayed step draw the same masks as the uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from smolforge.config import DataSpec
from smolforge.data import load_splits
from smolforge.errors import SmolforgeError
from smolforge.models.loading import load_tokenizer
from smolforge.split import checkpoint as ckpt
from smolforge.split.server import ServeConfig, serve
from smolforge.split.trainer import SplitTrainConfig, train_split
from smolforge.train.engine import TrainHooks

TOKEN = "resume-test-token"
STEPS = 6


@pytest.fixture(scope="module")
def data():
    tok = load_tokenizer("tiny-llama")
    return tok, load_splits(DataSpec(path="bundled", max_samples=40, max_length=48, max_eval_samples=6), tok)


def cfg(port: int, out: Path, **kw) -> SplitTrainConfig:
    base = dict(model="tiny-llama", split_point_1=1, split_point_2=3, server_port=port, token=TOKEN, lora_rank=4,
                lora_alpha=8, lora_dropout=0.1, batch_size=4, gradient_accumulation_steps=2, learning_rate=5e-3,
                warmup_steps=1, max_steps=STEPS, save_interval=2, output_dir=str(out), quiet=True, num_threads=1,
                seed=7, session_name=out.name, reconnect_timeout=120)
    base.update(kw)
    return SplitTrainConfig(**base)


def final_weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    path, _ = ckpt.read(out / "checkpoints", step)
    return {**ckpt.load_tensors(path, "client_lora"), **ckpt.load_tensors(path, "trunk_lora")}


def assert_same_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b) and a
    for k in a:
        assert float((a[k] - b[k]).abs().max()) <= 1e-5 * max(1e-3, float(b[k].abs().max())), k


def in_process_server(ck: Path):
    return serve(ServeConfig(model="tiny-llama", split_point_1=1, split_point_2=3, lora_rank=4, lora_alpha=8,
                             lora_dropout=0.1, port=0, token=TOKEN, num_threads=1, checkpoint_dir=str(ck)))


def test_resume_both_sides_equals_uninterrupted_run(data, tmp_path):
    tok, splits = data
    srv = in_process_server(tmp_path / "ck")
    try:
        full = train_split(cfg(srv.port, tmp_path / "full"), splits=splits, tokenizer=tok)
        stop_at = 3
        done: list[int] = [0]
        hooks = TrainHooks(on_step=lambda info: done.append(info.step),
                           should_stop=lambda: "pause" if done[-1] >= stop_at else None)
        paused = train_split(cfg(srv.port, tmp_path / "cut"), hooks, splits=splits, tokenizer=tok)
        assert paused.stopped == "pause" and paused.steps == stop_at
        assert paused.losses == full.losses[:stop_at]
    finally:
        srv.stop(0)
    assert ckpt.valid_steps(tmp_path / "cut" / "checkpoints")[-1] == stop_at
    assert stop_at in ckpt.valid_steps(tmp_path / "ck" / "cut")

    # a new server process state (same checkpoint directory), and the client resumes
    srv = in_process_server(tmp_path / "ck")
    try:  # under another batch its step 3 would be other rows (issue 43): refused, naming the flag
        with pytest.raises(SmolforgeError) as err:
            train_split(cfg(srv.port, tmp_path / "cut", resume=True, batch_size=8), splits=splits, tokenizer=tok)
        assert "batch_size 4 -> 8" in err.value.what and "--batch-size 4" in err.value.fix
        resumed = train_split(cfg(srv.port, tmp_path / "cut", resume=True), splits=splits, tokenizer=tok)
    finally:
        srv.stop(0)
    assert resumed.resumed_from == stop_at and resumed.first_step == stop_at
    assert resumed.losses == full.losses[stop_at:]
    assert_same_weights(final_weights(tmp_path / "cut", STEPS), final_weights(tmp_path / "full", STEPS))


def test_resume_picks_the_newest_step_both_sides_hold(data, tmp_path):
    """The client has a newer checkpoint than the server (it crashed in between): both go back."""
    tok, splits = data
    srv = in_process_server(tmp_path / "ck")
    try:
        full = train_split(cfg(srv.port, tmp_path / "run", max_steps=4, save_interval=1, keep_last=5), splits=splits,
                           tokenizer=tok)
        import shutil

        assert ckpt.valid_steps(tmp_path / "ck" / "run") == [2, 3, 4]  # the server keeps its last 3
        shutil.rmtree(tmp_path / "ck" / "run" / "step-4")  # the server lost its newest
        (tmp_path / "run" / "checkpoints" / "step-3" / "client_lora.safetensors").write_bytes(b"corrupt")
        # client {1, 2, 4} (3 fails its checksum), server {2, 3}: both go back to step 2
        again = train_split(cfg(srv.port, tmp_path / "run", max_steps=4, save_interval=1, keep_last=5, resume=True),
                            splits=splits, tokenizer=tok)
    finally:
        srv.stop(0)
    assert again.resumed_from == 2 and again.losses == full.losses[2:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(port: int, ck: Path, log: Path) -> subprocess.Popen:
    """`python -m smolforge.cli.split serve`, a real process; returns once it listens."""
    cmd = [sys.executable, "-m", "smolforge.cli.split", "serve", "--model", "tiny-llama", "--split-point-1", "1",
           "--split-point-2", "3", "--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1",
           "--port", str(port), "--token", TOKEN, "--checkpoint-dir", str(ck), "--num-threads", "1"]
    err = open(log, "ab")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=dict(os.environ), text=True)
    line = [""]

    def read():
        line[0] = proc.stdout.readline()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=120)
    if "listening" not in line[0]:
        proc.kill()
        raise AssertionError(f"server did not start: {line[0]!r}\n{log.read_text()[-2000:]}")
    return proc


def test_killed_server_restarts_and_client_resumes_from_shared_checkpoint(data, tmp_path):
    tok, splits = data
    port = free_port()
    ck = tmp_path / "server-ck"
    log = tmp_path / "server.log"
    procs = [start_server_process(port, ck, log)]
    try:
        steps = 8
        base = train_split(cfg(port, tmp_path / "base", max_steps=steps), splits=splits, tokenizer=tok)

        restarter: list[threading.Thread] = []

        def kill_after_step_5(info):
            if info.step == 5 and not restarter:
                procs[0].send_signal(signal.SIGKILL)  # a crash: no goodbye, no checkpoint
                procs[0].wait(timeout=30)
                # bring it back a moment later, while the client is retrying
                t = threading.Thread(target=lambda: (time.sleep(1.0),
                                                     procs.append(start_server_process(port, ck, log))))
                t.start()
                restarter.append(t)

        hooks = TrainHooks(on_step=kill_after_step_5)
        result = train_split(cfg(port, tmp_path / "crash", max_steps=steps), hooks, splits=splits, tokenizer=tok)
        restarter[0].join(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
    assert len(procs) == 2
    assert result.rollbacks == 1 and result.steps == steps
    assert result.retries > 0  # it waited for the server to come back (UNAVAILABLE, retried with backoff)
    # the replayed steps 5.. equal the uninterrupted run, and so do the final weights
    assert result.losses == base.losses
    assert_same_weights(final_weights(tmp_path / "crash", steps), final_weights(tmp_path / "base", steps))
    text = log.read_text()
    assert "session crash opened" in text and "step 4" in text


def test_cli_train_then_merge_gives_a_loadable_model(data, tmp_path):
    """`smolforge split train` and `split merge` through the real root CLI, against a live server."""
    from typer.testing import CliRunner

    from smolforge.cli.main import app
    from smolforge.models.loading import load_model
    from smolforge.split.lora import apply_lora, load_lora_state
    from smolforge.split.partition import partition, positions_for

    srv = in_process_server(tmp_path / "ck")
    out = tmp_path / "cli-run"
    runner = CliRunner()
    try:
        res = runner.invoke(app, [
            "split", "train", "--model", "tiny-llama", "--split-point-1", "1", "--split-point-2", "3",
            "--server-port", str(srv.port), "--lora-rank", "4", "--lora-alpha", "8", "--batch-size", "4",
            "--learning-rate", "5e-3", "--dataset", "bundled", "--max-train-samples", "24", "--max-eval-samples", "6",
            "--max-seq-length", "48", "--max-steps", "4", "--log-interval", "2", "--eval-interval", "2",
            "--save-interval", "2", "--codec", "fp16", "--output-dir", str(out), "--num-threads", "1"],
            env={"SMOLFORGE_SPLIT_TOKEN": TOKEN})
        assert res.exit_code == 0, res.output
        text = res.output
        assert "Step 2 | Loss " in text and "| LR " in text and "| Grad Norm " in text and "| Steps/s " in text
        assert "Val Loss " in text and "| Best " in text
        info = runner.invoke(app, ["split", "info", "--server-port", str(srv.port), "--token", TOKEN,
                                   "--session-name", "x"])
        assert info.exit_code == 0 and '"split_point_2": 3' in info.output
        bad = runner.invoke(app, ["split", "train", "--model", "tiny-llama", "--split-point-1", "1",
                                  "--split-point-2", "3", "--server-port", str(srv.port), "--token", "wrong",
                                  "--max-steps", "1", "--output-dir", str(tmp_path / "bad"), "--quiet"])
        assert bad.exit_code == 2 and "error:" in bad.output and "UNAUTHENTICATED" in bad.output
    finally:
        srv.stop(0)

    merged = tmp_path / "merged"
    res = runner.invoke(app, ["split", "merge", "--output-dir", str(out), "--merged-dir", str(merged)])
    assert res.exit_code == 0, res.output
    model = load_model(str(merged)).eval()
    assert not any("lora" in n for n, _ in model.named_parameters())

    # the merged model computes what the trained split parts compute
    parts = partition(load_model("tiny-llama"), 1, 3)
    weights = final_weights(out, 4)
    for part in (parts.bottom, parts.trunk, parts.top):
        from smolforge.config import PeftSpec

        apply_lora(part, PeftSpec(r=4, alpha=8, dropout=0.0), 0, parts.arch.canonical)
        load_lora_state(part, weights, parts.arch.canonical)
        part.eval()
    ids = torch.randint(4, 1000, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    pos = positions_for(mask)
    with torch.no_grad():
        want = parts.top(parts.trunk(parts.bottom(ids, mask, pos), mask, pos), mask, pos)
        got = model(input_ids=ids, attention_mask=mask).logits
    assert float((got - want).abs().max()) < 1e-4
    assert float((want - load_model("tiny-llama")(input_ids=ids).logits).abs().max()) > 1e-4  # training did something

    gen = runner.invoke(app, ["generate", "--model", str(merged), "--prompt", "What is 2 + 3?", "--max-new-tokens", "4",
                              "--device", "cpu"])
    assert gen.exit_code == 0, gen.output
