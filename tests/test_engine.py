"""The engine: learning happens, accumulation is exact, resume is exact, checkpoints are safe."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from smolforge.config import DataSpec, PeftSpec, TrainConfig
from smolforge.train import checkpoint as ckpt
from smolforge.train.engine import SampleOrder, TrainHooks, train
from smolforge.train.schedule import lr_lambda
from tests.helpers import ROOT, smolforge_here


def cfg(tmp: Path, **kw) -> TrainConfig:
    base = dict(model="tiny-llama", data=DataSpec(path="bundled", max_length=48, max_eval_samples=16, max_samples=400),
                peft=PeftSpec(method="lora", r=4, alpha=8, dropout=0.1), output_dir=str(tmp), max_steps=6,
                batch_size=4, lr=5e-3, warmup_steps=2, quiet=True, tensorboard=False, eval_accuracy=False,
                num_threads=1, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def adapter_weights(result) -> dict[str, torch.Tensor]:
    files = list(Path(result.adapter_dir).glob("*.safetensors"))
    assert files, f"no weights in {result.adapter_dir}"
    return load_file(str(files[0]))


def assert_same(a: dict, b: dict, atol: float = 0.0):
    assert a.keys() == b.keys()
    for k in a:
        if atol:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0)
        else:
            assert torch.equal(a[k], b[k]), k


def test_loss_goes_down_and_outputs_land(tmp_path):
    result = train(cfg(tmp_path, max_steps=30, lr=1e-2, eval_every=15, tensorboard=True))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_losses = [x["loss"] for x in lines if x["kind"] == "train"]
    assert train_losses[-1] < train_losses[0]
    assert any(x["kind"] == "eval" and x["step"] == 15 for x in lines)
    assert (tmp_path / "lora_adapter" / "adapter_config.json").exists()
    assert (tmp_path / "summary.json").exists() and list((tmp_path / "tensorboard").iterdir())
    assert result.eval["eval_loss"] > 0 and result.eval["perplexity"] > 1
    assert 0 < result.trainable_params < result.total_params


def test_each_evaluation_tells_its_own_seconds(tmp_path):
    """The eval hook (what a cluster job's eval event carries) has `eval_s`, the evaluation's wall seconds,
    beside its metrics, periodic and final: what bench/scale_out.py leaves out of a time to a target loss."""
    evals: list[dict] = []
    train(cfg(tmp_path, max_steps=4, eval_every=2, save_every=0), TrainHooks(on_eval=evals.append))
    assert [e["step"] for e in evals] == [2, 4], evals
    assert all(isinstance(e["eval_s"], float) and 0 < e["eval_s"] < 60 and e["eval_loss"] > 0 for e in evals), evals


def test_gradient_accumulation_equals_big_batch(tmp_path):
    a = train(cfg(tmp_path / "a", batch_size=8, grad_accum=1, peft=PeftSpec(method="lora", r=4, dropout=0.0)))
    b = train(cfg(tmp_path / "b", batch_size=4, grad_accum=2, peft=PeftSpec(method="lora", r=4, dropout=0.0)))
    assert_same(adapter_weights(a), adapter_weights(b), atol=1e-5)


def test_pause_then_resume_is_exact(tmp_path):
    full = train(cfg(tmp_path / "full"))
    calls = {"n": 0}

    def stop_at_3():
        calls["n"] += 1
        return "pause" if calls["n"] == 3 else None

    paused = train(cfg(tmp_path / "split"), TrainHooks(should_stop=stop_at_3))
    assert paused.stopped == "pause" and paused.steps == 3 and paused.adapter_dir is None
    assert ckpt.latest_checkpoint(tmp_path / "split").name == "step-3"
    resumed = train(cfg(tmp_path / "split", resume=True))
    assert resumed.steps == 6 and resumed.data["resumed_from"].endswith("step-3")
    assert_same(adapter_weights(full), adapter_weights(resumed))


def test_cancel_stops_without_saving(tmp_path):
    result = train(cfg(tmp_path), TrainHooks(should_stop=lambda: "cancel"))
    assert result.stopped == "cancel" and result.steps == 1 and result.adapter_dir is None


def test_corrupt_checkpoint_is_skipped_and_keep_last(tmp_path):
    train(cfg(tmp_path, max_steps=6, save_every=2, keep_last=2))
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-4", "step-6"]
    (tmp_path / "checkpoints" / "step-6" / "trainable.safetensors").write_bytes(b"garbage")
    assert not ckpt.verify(tmp_path / "checkpoints" / "step-6")
    assert ckpt.latest_checkpoint(tmp_path).name == "step-4"


def test_sample_order_is_a_pure_function_of_step():
    a, b = SampleOrder(100, 8, seed=1), SampleOrder(100, 8, seed=1)
    assert [a.step_rows(s) for s in range(30)] == [b.step_rows(s) for s in reversed(range(30))][::-1]
    epoch0 = sum((a.step_rows(s) for s in range(a.steps_per_epoch)), [])
    assert len(set(epoch0)) == len(epoch0) == 96


def test_schedule_warmup_then_decay():
    assert lr_lambda(0, 100, 10, "cosine", 0.0) == pytest.approx(0.1)
    assert lr_lambda(9, 100, 10, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_lambda(100, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_lambda(55, 100, 10, "linear", 0.0) == pytest.approx(0.5)


# `smolforge ARGS` that holds (asleep, until it is killed) when step 15's checkpoint is due, before writing it:
# steps 11-15 done and lost, step 10 the last checkpoint. The kill lands there on any machine's speed, so the run
# need not outlast the test's polling (it was 160 steps, 25 s of the CI tier, for a kill soon after step 10).
HELD_AT_STEP_15 = """
import pathlib, runpy, sys, time
import smolforge.train.checkpoint as ckpt
save = ckpt.save_checkpoint
def hold_at_15(output_dir, step, *args, **kw):
    if step == 15:
        pathlib.Path(str(output_dir) + ".held").write_text(str(step))
        time.sleep(600)
    return save(output_dir, step, *args, **kw)
ckpt.save_checkpoint = hold_at_15
sys.argv[0] = "smolforge"
runpy.run_module("smolforge.cli.main", run_name="__main__")
"""


def test_killed_run_resumes_to_identical_weights(tmp_path):
    """A real process killed with SIGKILL mid-run (20 steps, a checkpoint every 5: killed after step 15, before
    its checkpoint), then `--resume` from step 10: same weights as never interrupted. The uninterrupted run and
    the resume go through the same CLI in this process (`smolforge_here`): only the run that is killed needs a
    process of its own."""
    args = ["train", "--model", "tiny-llama", "--data", "bundled", "--max-steps", "20", "--batch-size", "2",
            "--max-length", "48", "--save-every", "5", "--seed", "7", "--num-threads", "1", "--quiet",
            "--set", "data.max_eval_samples=4", "--set", "eval_accuracy=false", "--set", "tensorboard=false"]
    ref = smolforge_here(*args, "--output-dir", str(tmp_path / "ref"))
    assert ref.exit_code == 0, ref.output[-3000:]
    out = tmp_path / "crash"
    proc = subprocess.Popen([sys.executable, "-c", HELD_AT_STEP_15, *args, "--output-dir", str(out)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not tmp_path.joinpath("crash.held").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"the run ended ({proc.returncode}) before it was killed"
    assert not (out / "lora_adapter").exists() and getattr(ckpt.latest_checkpoint(out), "name", None) == "step-10", \
        sorted(p.name for p in ckpt.list_checkpoints(out))
    resumed = smolforge_here(*args, "--output-dir", str(out), "--resume")
    assert resumed.exit_code == 0, resumed.output[-3000:]
    ref = load_file(str(tmp_path / "ref" / "lora_adapter" / "adapter_model.safetensors"))
    got = load_file(str(out / "lora_adapter" / "adapter_model.safetensors"))
    assert_same(ref, got)


def test_a_rerun_into_a_used_output_dir_is_refused_and_deletes_nothing(tmp_path):
    """Without --resume, a second run into the same dir would have its new checkpoints pruned (the old
    run's steps are higher) and a later --resume would continue the old run: refused, exit 2."""
    args = ["train", "--model", "tiny-llama", "--data", "bundled", "--max-steps", "4", "--batch-size", "2",
            "--max-length", "48", "--save-every", "2", "--num-threads", "1", "--quiet", "--output-dir", str(tmp_path),
            "--set", "data.max_eval_samples=4", "--set", "eval_accuracy=false", "--set", "tensorboard=false"]
    first = smolforge_here(*args)  # in this process: the refusal is the command's decision, not a process's
    assert first.exit_code == 0, first.output
    before = sorted(p.name for p in ckpt.list_checkpoints(tmp_path))
    again = smolforge_here(*args)
    assert again.exit_code == 2 and isinstance(again.exception, SystemExit), again.output
    assert "already holds checkpoints" in again.stderr and "--resume" in again.stderr
    assert "Traceback" not in again.stderr
    assert sorted(p.name for p in ckpt.list_checkpoints(tmp_path)) == before == ["step-2", "step-4"]
    resumed = smolforge_here(*args, "--resume")  # continuing it is fine
    assert resumed.exit_code == 0, resumed.output


@pytest.mark.parametrize("method", ["prefix", "prompt", "ia3", "adapter", "none"])
def test_every_peft_method_trains_through_the_engine(tmp_path, method):
    result = train(cfg(tmp_path, max_steps=3, peft=PeftSpec(method=method, num_virtual_tokens=4), eval_accuracy=True,
                       max_new_tokens=3))
    assert result.steps == 3 and result.eval["eval_loss"] > 0 and "accuracy" in result.eval
    assert Path(result.adapter_dir).name == f"{method}_adapter"


def test_a_failed_directory_swap_puts_the_old_copy_back(tmp_path, monkeypatch):
    """Checkpoints and downloaded artifacts are swapped into place; if the swap fails, the old copy
    is back where it was (never neither), and the new tree was fsynced before the swap."""
    from smolforge import paths

    final, new = tmp_path / "step-5", tmp_path / ".step-5.tmp"
    final.mkdir()
    (final / "weights").write_text("old")
    new.mkdir()
    (new / "weights").write_text("new")
    synced, real_replace = [], paths.os.replace
    monkeypatch.setattr(paths, "fsync_tree", lambda root: synced.append(Path(root)))

    def failing_replace(src, dst):
        if Path(src) == new:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(paths.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        paths.atomic_replace_dir(new, final)
    assert (final / "weights").read_text() == "old" and synced == [new]
    monkeypatch.setattr(paths.os, "replace", real_replace)
    paths.atomic_replace_dir(new, final)
    assert (final / "weights").read_text() == "new" and not new.exists()
    assert not list(tmp_path.glob(".step-5.old-*"))
