"""A bad field in a spec file is reported as `file:line` (issue 46): the YAML loader's node marks
(`config.key_lines`) kept beside the parsed file (`config.SpecFile`), asked when pydantic refuses a
field (`config.spec_error`). One message, exit 2, before a model loads or a cluster starts."""

from __future__ import annotations

import pytest

from tests.helpers import smolforge_here

JOB = """\
# a data-parallel job
kind: data_parallel
num_workers: 2
train:
  model: tiny-llama
  data:
    path: bundled
    max_lenght: 64
  max_steps: 2
"""
TRAIN = """\
model: tiny-llama
data: {path: bundled}
lr: 0.1
batch_size: -3
"""


@pytest.fixture
def nothing_starts(monkeypatch, tmp_path):
    """A cluster start or a model load fails the test: the refusal comes first."""
    import smolforge.cluster.embedded as embedded
    import smolforge.models.loading as loading

    monkeypatch.setattr(embedded.EmbeddedCluster, "handle", property(lambda self: pytest.fail("started a cluster")))
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setenv("SMOLFORGE_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("command, text, line, field", [
    (["submit"], JOB, 8, "train.data.max_lenght: Extra inputs are not permitted (did you mean 'max_length'?)"),
    (["train", "--config"], TRAIN, 4, "batch_size: Input should be greater than or equal to 1"),
], ids=["submit", "train --config"])
def test_a_bad_field_is_named_as_file_and_line(command, text, line, field, nothing_starts, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    proc = smolforge_here(*command, str(spec))
    assert proc.exit_code == 2, proc.output[-2000:]
    assert proc.stderr.startswith(f"error: {spec}:{line}: invalid ") and field in proc.stderr, proc.stderr
    assert f"fix: correct or remove the key at line {line} of {spec}" in proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.output


def test_each_field_its_line_and_none_for_a_value_the_file_did_not_give(tmp_path):
    """Several bad fields: each with its line; a missing one: its section's line; a value a flag or --set
    replaced is not the file's (no line: the file is named alone); list items and aliases by their node."""
    from smolforge.config import TrainConfig, key_lines, load_yaml, validate
    from smolforge.errors import SmolforgeError

    (tmp_path / "t.yaml").write_text(TRAIN)
    doc = load_yaml(tmp_path / "t.yaml")
    with pytest.raises(SmolforgeError) as err:
        validate(TrainConfig, doc)
    assert err.value.where == f"{tmp_path / 't.yaml'}:4" and "batch_size (line" not in err.value.what  # one: where says it
    doc["batch_size"] = 0  # as `--batch-size 0` would: not the file's value any more
    with pytest.raises(SmolforgeError) as err:
        validate(TrainConfig, doc, where="cmd")
    assert err.value.where == "cmd" and "batch_size: Input should be" in err.value.what  # the caller's where
    (tmp_path / "two.yaml").write_text("model: tiny-llama\ndata:\n  format: alpaca\nbatch_size: 0\nepochs: 0\n")
    with pytest.raises(SmolforgeError) as err:
        validate(TrainConfig, load_yaml(tmp_path / "two.yaml"))
    assert err.value.where.endswith("two.yaml:2")  # the data section: its own check (no path given) names it
    assert "data (line 2): Value error, no dataset" in err.value.what
    assert "batch_size (line 4)" in err.value.what and "epochs (line 5)" in err.value.what
    marks = key_lines("a: &x [1, {b: 2}]\nc: *x\nd:\n  - e\n  - f: 3\n")
    assert marks[("a", 1, "b")] == 1 and marks[("d", 1)] == 5 and marks[("d", 1, "f")] == 5 and marks[("c",)] == 2


TASK = """\
# the seeds' task shape: {{model, dataset, ...}}, a data-parallel job
model: tiny-llama
{rest}
priority: high
"""


@pytest.mark.parametrize("rest, extra, line, said", [
    ("dataset: [a, b]", [], 3, "invalid DataParallelJob: train.data.path: Input should be a valid string"),
    ("dataset: nope.jsonl", ["--set", "lr=0.01"], 3, "dataset nope.jsonl does not exist"),
    ("dataset: bundled\nbatch_size: -3", [], 4,
     "invalid DataParallelJob: batch_size: Extra inputs are not permitted (did you mean 'train.batch_size'?)"),
], ids=["a dataset of the wrong type", "a dataset that is not there, with --set", "a training key"])
def test_the_seeds_task_shape_names_its_bad_field_at_its_line(rest, extra, line, said, nothing_starts, tmp_path):
    """The seeds' task file has `dataset` where the job has `train.data.path` (`specs.from_seed_task`): the
    refusal names the file's line of `dataset` (its line moved with it, `SEED_TASK_MOVES`), also for the
    upload's check and with a --set beside it (which goes into the translated job's train section); a
    training key written beside `model` is at its line, with where it belongs."""
    spec = tmp_path / "task.yaml"
    spec.write_text(TASK.format(rest=rest))
    proc = smolforge_here("submit", str(spec), *extra)
    assert proc.exit_code == 2, proc.output[-2000:]
    assert proc.stderr.startswith(f"error: {spec}:{line}: {said}"), proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.output


def test_the_seed_translation_moves_each_keys_line(tmp_path):
    """`from_seed_task` of a file: each moved key at its new path keeps its line, a section the move made is
    at its first key's, and a value changed after the file was read has none."""
    from smolforge.cluster.control.specs import from_seed_task
    from smolforge.config import load_yaml

    (tmp_path / "t.yaml").write_text(TASK.format(rest="dataset: d.jsonl\ndataset_split: train"))
    doc = from_seed_task(load_yaml(tmp_path / "t.yaml"))
    assert doc == {"priority": "high", "train": {"model": "tiny-llama", "data": {"path": "d.jsonl",
                                                                               "dataset_split": "train"}}}
    lines = {loc: doc.line_of(loc) for loc in [("train", "model"), ("train", "data", "path"), ("train", "data"),
                                               ("train", "data", "dataset_split"), ("priority",)]}
    assert lines == {("train", "model"): 2, ("train", "data", "path"): 3, ("train", "data"): 3,
                     ("train", "data", "dataset_split"): 4, ("priority",): 5}
    assert doc.marks[("train",)] == 2 and doc.place(("train", "data", "path")) == f"{tmp_path / 't.yaml'}:3"
    doc["train"]["data"]["path"] = "other.jsonl"  # as a --set would
    assert doc.line_of(("train", "data", "path")) is None


STAGE = """\
kind: distill_task
stage: teacher
args:
  model_path: tiny-llama
  dataset_path: bundled
{bad}
"""


@pytest.mark.parametrize("bad, line, said", [
    ("  temprature: 0.7", 6, "args.temprature is not an argument of the teacher stage (did you mean 'temperature'?)"),
    ("  top_k: many", 6, "args.top_k: Input should be a valid integer"),
    ("  output_dir: /tmp/x", 6, "args.output_dir is not for the job to give"),
], ids=["misspelt", "wrong type", "the job's own"])
def test_a_stage_jobs_bad_arg_is_named_at_its_line(bad, line, said, nothing_starts, tmp_path):
    """A `distill_task` job's `args` are checked where it is submitted (`JobKind.check_here`, the pure part
    of `stage_args`), each refusal at the key's `file:line`; a missing one at the `args` section's."""
    spec = tmp_path / "stage.yaml"
    spec.write_text(STAGE.format(bad=bad))
    proc = smolforge_here("submit", str(spec))
    assert proc.exit_code == 2, proc.output[-2000:]
    assert proc.stderr.startswith(f"error: {spec}:{line}: {said}"), proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.output


def test_a_stage_jobs_missing_arg_is_named_at_its_args_section(tmp_path):
    """In process (no CLI): the required `dataset_path` missing is the `args` section's line; a spec not read
    from a file keeps the stage's name as where."""
    from smolforge.cluster.control.kinds import check_fields
    from smolforge.config import load_yaml
    from smolforge.errors import SmolforgeError

    (tmp_path / "s.yaml").write_text("kind: distill_task\nstage: teacher\nargs:\n  model_path: tiny-llama\n")
    doc = load_yaml(tmp_path / "s.yaml")
    with pytest.raises(SmolforgeError) as err:
        check_fields(doc)
    assert err.value.where == f"{tmp_path / 's.yaml'}:3" and "needs args.dataset_path" in err.value.what
    with pytest.raises(SmolforgeError) as err:
        check_fields(dict(doc))
    assert err.value.where == "job spec (args of the teacher stage)"


DISTILL_JOB = """\
kind: distill
distill:
  teacher: tiny-llama
  students: [tiny-llama]
  data: bundled
{bad}
"""
NO_STUDENT = """\
kind: distill
distill:
  teacher: tiny-llama
  students: []
  data: bundled
"""
OTHER_VOCAB = """\
kind: distill
distill:
  teacher: {teacher}
  students: [{student}]
  data: bundled
{bad}
"""
MLP_JOB = """\
kind: data_parallel
train:
  model: mlp
  data: {{path: digits}}
{bad}
"""


@pytest.mark.parametrize("text, bad, line, said", [
    (DISTILL_JOB, "  kd_loss: kl", 6, "unknown KD loss 'kl'"),
    (DISTILL_JOB, "  beta: 2.5", 6, "JSD beta must be in [0, 1]"),
    (DISTILL_JOB, "  aggregate: linear", 6, "unknown --aggregate 'linear'"),
    (DISTILL_JOB, "  save_every: -5", 6, "--save-every must be 0 or more"),
    (DISTILL_JOB, "  replace_timeout_s: 0", 6, "replace_timeout_s must be positive"),
    (DISTILL_JOB, "  peft: lora\n  peft_config:\n    r: 0", 8, "r: Input should be greater than or equal to 1"),
    (DISTILL_JOB, "  peft: lorra", 6, "invalid PeftSpec: method"),
    (DISTILL_JOB, "  teacher_responses: mine", 6, "unknown teacher responses 'mine'"),
    (DISTILL_JOB, "  samples_per_prompt: 2", 6, "identical samples"),
    (DISTILL_JOB, "  teacher_backend: nope", 6, "unknown --teacher-backend 'nope'"),
    (DISTILL_JOB, "  eval: false\n  eval_data: bundled", 6, "--no-eval skips the students' evaluation"),
    (DISTILL_JOB, "  lr: -1", 6, "invalid DistillJob: distill.lr: Input should be greater than 0"),  # pydantic's own
    (MLP_JOB, "  peft: {method: lora}", 5, "--peft/--lora-r/--lora-alpha (train.peft) does not apply"),
    (STAGE, "  top_p: 1.5", 6, "args.top_p: top_p must be in (0, 1]"),  # the builder's
    # refusals across settings (`SmolforgeError.fields`): at the line of the first of them the file wrote
    (NO_STUDENT, "", 4, "no student model given"),
    (DISTILL_JOB, "  top_k: 0", 6, "top_k, max_new_tokens and batch_size must be ≥ 1"),
    (DISTILL_JOB, "  teacher_backend: llamacpp\n  teacher_quant: q3", 7, "unknown --teacher-quant 'q3'"),
    (DISTILL_JOB, "  teacher_backend: openai\n  teacher_url: http://127.0.0.1:9/v1", 7, "cannot reach the teacher endpoint"),
    (DISTILL_JOB, "  students_strategy: zero1", 6, "--students-strategy zero1 needs --students-sync ddp"),
    (DISTILL_JOB, "  dataset_name: acme/absent", 5, "both distill.data bundled and distill.dataset_name acme/absent"),
    (DISTILL_JOB, "  dataset_eval_split: validation", 6, "distill.dataset_eval_split needs distill.dataset_name"),
    (OTHER_VOCAB, "  on_policy_ratio: 0.5", 6, "have different tokenizers"),
    (STAGE, "  responses: reference\n  samples_per_prompt: 2\n  temperature: 0.7", 6,
     "args.responses, args.samples_per_prompt: samples_per_prompt > 1 with reference responses"),
    (MLP_JOB, "strategy_config: {inner_steps: 5}", 5, "the ddp strategy takes no settings (got inner_steps)"),
], ids=["kd_loss", "beta", "aggregate", "save_every", "replace_timeout_s", "peft_config.r", "peft", "teacher_responses",
        "samples_per_prompt", "teacher_backend", "eval with eval_data", "lr", "a model kind's unused setting",
        "a stage job's value", "no student", "teacher settings below 1", "llamacpp quant", "openai probe",
        "students_strategy without ddp", "data and dataset_name", "eval split without a name", "shared tokenizer",
        "a stage job's two args", "a strategy's settings"])
def test_a_value_refused_after_parsing_is_named_at_its_line(text, bad, line, said, nothing_starts, tmp_path):
    """A job's value checks that run after its spec parsed (the kind's `check`: `distill.settings.check_run`,
    `models.kinds.refuse_unused`) name the refused setting as the error's field, and `config.placed` finds
    its line in the file (`smolforge submit`, embedded: before the cluster starts). A refusal across
    settings (two that contradict each other, the settings that need one vocabulary, the endpoint teacher's
    probe) names each (`fields`) and is at the line of the first of them the file wrote."""
    spec = tmp_path / "job.yaml"
    spec.write_text(text.format(bad=bad, **(_two_vocabularies(tmp_path) if "{teacher}" in text else {})))
    proc = smolforge_here("submit", str(spec))
    assert proc.exit_code == 2, proc.output[-2000:]
    assert proc.stderr.startswith(f"error: {spec}:{line}: ") and said in proc.stderr, proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.output


def test_a_distill_specs_held_out_file_is_read_at_submit(nothing_starts, tmp_path):
    """`distill.eval_data: FILE` in a job file is read where it is submitted, before it is uploaded
    (`JobKind.read_at_submit`, the one JSONL reader): a bad line is exit 2 at the held-out file's line."""
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2="\n')
    spec = tmp_path / "job.yaml"
    spec.write_text(DISTILL_JOB.format(bad=f"  eval_data: {held}"))
    proc = smolforge_here("submit", str(spec))
    assert proc.exit_code == 2, proc.output[-2000:]
    assert proc.stderr.startswith(f"error: {held}:2: malformed JSON") and "fix:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.output


def _two_vocabularies(tmp_path) -> dict[str, str]:
    """A teacher and a student whose token ids differ, cheaply: the presets' tokenizer trained to 512 and to
    640 tokens, each with a config naming its family (no weights, no preset built: the submit's check reads
    tokenizer files alone)."""
    import json

    from smolforge.models.tiny import train_tokenizer

    made = {}
    for role, size in (("teacher", 512), ("student", 640)):
        made[role] = out = tmp_path / f"{role}-{size}"
        train_tokenizer(size).save_pretrained(out)
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": size}))
    return {role: str(path) for role, path in made.items()}
