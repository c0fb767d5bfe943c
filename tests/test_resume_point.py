"""Resumes know what a step meant (issue 43, item 1): `train.resume_point` is the one rule.

The design, stated: a resume under the same rows per step (batch_size x grad_accum x world, however
split) continues at the saved step, which is the same sample of the same order; under other rows per
step or another seed it is refused, exit 2, naming each setting and the value to pass; over changed
training rows it is refused unless `--resume-new-data`. One paused run (3 steps of an epoch of 6, 4 rows
per step, tiny-llama) is shared; each test resumes its own copy of it.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from smolforge.config import DataSpec, PeftSpec, TrainConfig
from smolforge.errors import SmolforgeError
from smolforge.train import checkpoint as ckpt
from smolforge.train.engine import TrainHooks, train
from smolforge.train.resume_point import STATE_KEY, StepMeaning, resume_point
from tests.helpers import write_jsonl

RECORDS = [{"prompt": f"What is {a} plus {a + 1}?", "completion": str(2 * a + 1)} for a in range(28)]
COMMON = dict(model="tiny-llama", peft=PeftSpec(method="lora", r=4, alpha=8, dropout=0.1), epochs=1.0, batch_size=4,
              lr=5e-3, warmup_steps=2, quiet=True, tensorboard=False, eval_accuracy=False, num_threads=1, seed=3)


def cfg(out: Path, data: Path, **kw) -> TrainConfig:
    base = dict(COMMON, data=DataSpec(path=str(data), max_length=48, eval_fraction=0.1), output_dir=str(out))
    base.update(kw)
    return TrainConfig(**base)


def recording(trained: list, stop_after: int | None = None) -> TrainHooks:
    """Hooks that keep every row a training forward saw (its token ids, unpadded) and pause after a step."""
    done = [0]

    def seen(module, args, kwargs):
        if module.training:
            trained.extend(tuple(row[mask.bool()].tolist())  # without the padding to the micro-batch's longest
                           for row, mask in zip(kwargs["input_ids"], kwargs["attention_mask"]))

    return TrainHooks(on_model=lambda m: m.register_forward_pre_hook(seen, with_kwargs=True),
                      on_step=lambda info: done.__setitem__(0, info.step),
                      should_stop=(lambda: "pause" if done[0] >= stop_after else None) if stop_after else None)


@pytest.fixture(scope="module")
def paused(tmp_path_factory) -> dict:
    """The shared run: an epoch of 6 steps at 4 rows per step, paused after step 3."""
    root = tmp_path_factory.mktemp("paused")
    data = write_jsonl(root / "data.jsonl", RECORDS)
    rows: list = []
    result = train(cfg(root / "run", data), recording(rows, stop_after=3))
    assert result.stopped == "pause" and result.steps == 3 and result.samples == 12 and len(rows) == 12
    return {"root": root, "data": data, "out": root / "run", "rows": rows}


def copy_of(paused: dict, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(paused["out"], out)
    return out


def test_a_checkpoint_records_what_its_step_meant(paused):
    state = ckpt.read_state(ckpt.latest_checkpoint(paused["out"]))
    meaning = StepMeaning.from_state(state[STATE_KEY])
    assert (state["step"], state["samples_done"]) == (3, 12)
    assert (meaning.rows_per_step, meaning.batch_size, meaning.grad_accum, meaning.world) == (4, 4, 1, 1)
    assert (meaning.seed, meaning.max_length, meaning.packing, meaning.data_rows) == (3, 48, False, 26)
    assert ckpt.verify(ckpt.latest_checkpoint(paused["out"]))  # state.json stays under the manifest's checksums


@pytest.mark.parametrize("change, named, fix", [({"batch_size": 8}, "batch_size 4 -> 8", "--batch-size 4"),
                                                ({"grad_accum": 2}, "grad_accum 1 -> 2", "--grad-accum 1")])
def test_a_resume_under_other_rows_per_step_is_refused_naming_the_setting(paused, tmp_path, change, named, fix):
    """The field case: batch 4 resumed at batch 8 (or accumulation 2) read step 3 as sample 24 and skipped
    rows. Refused before a step is taken, the setting and its value in the message."""
    out = copy_of(paused, tmp_path)
    rows: list = []
    with pytest.raises(SmolforgeError) as err:
        train(cfg(out, paused["data"], resume=True, **change), recording(rows))
    assert named in err.value.what and fix in err.value.fix and err.value.exit_code == 2
    assert rows == [] and [p.name for p in ckpt.list_checkpoints(out)] == ["step-3"]


def test_a_resume_under_the_same_rows_per_step_continues_at_the_same_sample(paused, tmp_path):
    """batch 2 x accumulation 2 is 4 rows per step, as the checkpoint: it continues at step 3, and the rows
    trained before and after the pause are the uninterrupted epoch's, each once; the summary counts them."""
    out = copy_of(paused, tmp_path)
    after: list = []
    resumed = train(cfg(out, paused["data"], resume=True, batch_size=2, grad_accum=2), recording(after))
    whole: list = []
    full = train(cfg(tmp_path / "full", paused["data"]), recording(whole))
    assert resumed.steps == full.steps == 6 and resumed.data["resume_note"] is None
    assert len(after) == 12 and Counter(paused["rows"] + after) == Counter(whole)
    assert resumed.samples == full.samples == len(paused["rows"]) + len(after) == 24


def test_a_changed_data_file_is_refused_exit_2_unless_the_flag_says_so(paused, tmp_path):
    out = copy_of(paused, tmp_path)
    changed = write_jsonl(tmp_path / "changed.jsonl", RECORDS[:-4] + [{"prompt": "Name a colour.", "completion": "red"}])
    from smolforge.cli.main import app  # the command line, in this process (as tests/test_bad_input.py)

    got = CliRunner().invoke(app, ["train", "--model", "tiny-llama", "--data", str(changed), "--output-dir", str(out),
                                   "--resume", "--batch-size", "4", "--seed", "3", "--max-length", "48", "--lora-r", "4",
                                   "--lora-alpha", "8", "--lora-dropout", "0.1", "--num-threads", "1", "--quiet",
                                   "--no-tensorboard"], env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None})
    assert got.exit_code == 2 and isinstance(got.exception, SystemExit), (got.exception, got.output[-2000:])
    assert got.stderr.startswith("error:") and got.stderr.count("error:") == 1 and "\n  fix:" in got.stderr
    assert "training data changed" in got.stderr and "--resume-new-data" in got.stderr.split("fix:")[1]
    assert "Traceback" not in got.output and [p.name for p in ckpt.list_checkpoints(out)] == ["step-3"]
    after: list = []
    resumed = train(cfg(out, changed, resume=True, resume_new_data=True), recording(after))
    assert "changed training data" in resumed.data["resume_note"] and resumed.steps == 5  # 23 rows: 5 steps
    assert resumed.samples == 12 + len(after) == 20


def test_one_rule_for_every_world_size():
    """What a data-parallel round asks when its group re-formed on another number of ranks (each rank's
    driver asks this very function): the job's global batch kept, it continues at the same sample; the
    per-rank batch kept instead (other rows per step), refused naming the world."""
    def meaning(world: int, batch: int, **kw) -> StepMeaning:
        return StepMeaning(**{**dict(rows_per_step=world * batch, batch_size=batch, grad_accum=1, world=world, seed=0,
                                     max_length=48, packing=False, data_rows=100, data_sha256="ab" * 32), **kw})

    state = {"step": 5, "samples_done": 20, STATE_KEY: meaning(2, 2).to_state()}
    point = resume_point(state, meaning(1, 4), 4)
    assert (point.step, point.samples, point.note) == (5, 20, None)
    with pytest.raises(SmolforgeError) as err:
        resume_point(state, meaning(1, 2), 2)
    assert "world 2 -> 1" in err.value.what and "a world of 2" in err.value.fix
    with pytest.raises(SmolforgeError) as err:
        resume_point(state, meaning(2, 2, max_length=64), 4)
    assert "max_length 48 -> 64" in err.value.what and "--max-length 48" in err.value.fix


def test_an_old_checkpoint_resumes_from_its_step_with_one_line():
    now = StepMeaning(rows_per_step=4, batch_size=4, grad_accum=1, world=1, seed=0, max_length=48, packing=False,
                      data_rows=100, data_sha256="ab" * 32)
    point = resume_point({"step": 3, "model": "tiny-llama", "world": 1}, now, 4)
    assert (point.step, point.samples) == (3, 12) and "inferred from its step" in point.note
    student = resume_point({"step": 3}, None, 8)  # a run with no meaning (a student replays its own order)
    assert (student.step, student.samples, student.note) == (3, 24, None)
