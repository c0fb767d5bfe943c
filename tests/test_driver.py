"""One driver around the Trainer: a fine-tuning run and a distillation student are the same run
(`smolforge.train.driver`), differing in their data source and loss; `smolforge train` runs it in
this process (the documented shortcut: no Ray, no embedded cluster)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from smolforge.config import DataSpec, PeftSpec, TrainConfig
from smolforge.distill.losses import KDConfig
from smolforge.distill.shard_source import DirShardSource
from smolforge.distill.student import StudentConfig, train_student
from smolforge.distill.teacher import GenSettings, run_teacher_local
from smolforge.train import driver
from smolforge.train.engine import train

LORA = PeftSpec(method="lora", r=4, alpha=8, dropout=0.0)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("store") / "teacher_outputs"
    run_teacher_local("tiny-llama", "bundled", d, num_shards=1, max_samples=8,
                      settings=GenSettings(max_new_tokens=4, top_k=4, batch_size=8), device="cpu")
    return d


def test_a_fine_tuning_run_and_a_student_are_the_one_driver(tmp_path, store, monkeypatch):
    """Both go through `Driver.run` (no driver of their own), and their mid-run checkpoints are written
    by its one save: the same files, the same state, each with what its source needs to replay."""
    seen: list[tuple[str, str]] = []
    real = driver.Driver.run

    def spy(self):
        result = real(self)
        seen.append((self.s.label, type(result).__name__))
        return result

    monkeypatch.setattr(driver.Driver, "run", spy)
    run = train(TrainConfig(model="tiny-llama", data=DataSpec(path="bundled", max_length=48, max_eval_samples=4,
                                                               max_samples=40),
                            peft=LORA, output_dir=str(tmp_path / "run"), max_steps=2, save_every=1, batch_size=4,
                            lr=1e-3, quiet=True, tensorboard=False, eval_accuracy=False, num_threads=1))
    student = train_student(StudentConfig(base_model="tiny-llama", output_dir=str(tmp_path / "student_0"), max_steps=2,
                                          save_every=1, batch_size=4, lr=1e-3, device="cpu", num_threads=1, peft=LORA,
                                          kd=KDConfig(kd_ratio=0.5), eval_accuracy=False, wait_timeout_s=60,
                                          poll_s=0.05),
                            DirShardSource(store, poll_s=0.05))
    assert seen == [("train", "TrainResult"), ("student student_0", "StudentResult")]
    assert run.steps == student.steps == 2 and run.adapter_dir and student.adapter_dir
    step1 = [tmp_path / who / "checkpoints" / "step-1" for who in ("run", "student_0")]
    assert sorted(p.name for p in step1[0].iterdir()) == sorted(p.name for p in step1[1].iterdir())
    state = [json.loads((p / "state.json").read_text()) for p in step1]
    assert state[0]["step"] == state[1]["step"] == 1
    assert {"model", "peft", "strategy", "world"} <= state[0].keys() and "shard_order" not in state[0]
    assert state[1]["shard_order"] == [0] and state[1]["model"] == "tiny-llama"
    # the run saves its final state, a student only its adapter (its checkpoints exist to resume it)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] != ["step-1"]
    assert [p.name for p in (tmp_path / "student_0" / "checkpoints").iterdir()] == ["step-1"]


def test_smolforge_train_runs_in_this_process_without_ray(tmp_path, monkeypatch):
    """The one-process shortcut, as docs/design.md records it: `smolforge train` hands its config to the
    driver here; any `import ray` on the way (the embedded cluster, a backend) would fail."""
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    out = tmp_path / "run"
    got = CliRunner().invoke(app, ["train", "--model", "tiny-llama", "--data", "bundled", "--max-steps", "2",
                                   "--batch-size", "2", "--max-length", "48", "--max-samples", "16",
                                   "--num-threads", "1", "--output-dir", str(out), "--set", "data.max_eval_samples=2",
                                   "--set", "eval_accuracy=false", "--no-tensorboard", "--json"],
                             env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None})
    assert got.exit_code == 0, (got.output, got.exception)
    summary = json.loads(got.output.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["strategy"] == "single"
    assert Path(summary["adapter_dir"]) == out / "lora_adapter"


def test_the_thread_knob_sets_a_runs_default_threads_and_refuses_a_bad_value(monkeypatch):
    """$SMOLFORGE_NUM_THREADS is a run's torch threads when it is given no --num-threads (the tests' CLI
    processes run beside their own Ray workers with 1); unset, the CPUs this process may use."""
    import os

    from smolforge.errors import SmolforgeError

    monkeypatch.delenv(driver.THREADS_ENV, raising=False)
    assert driver.available_cpus() == len(os.sched_getaffinity(0))
    for given, threads in (("1", 1), (" 3 ", 3)):
        monkeypatch.setenv(driver.THREADS_ENV, given)
        assert driver.available_cpus() == threads
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(driver.THREADS_ENV, bad)
        with pytest.raises(SmolforgeError) as err:
            driver.available_cpus()
        assert f"{driver.THREADS_ENV}={bad!r}" in err.value.render() and "fix:" in err.value.render()
