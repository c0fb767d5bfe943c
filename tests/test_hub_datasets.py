"""Datasets by their Hub names, offline (issue 46 item 3): `--dataset-name` on train and launch, and
`{dataset_name: ...}` in job specs, read from a `save_to_disk` directory or the local Hugging Face
cache that the test makes (no network: HF_HUB_OFFLINE), written once as JSONL; a name not cached
fails at once with exit 2 and the command that caches it."""

from __future__ import annotations

import glob
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import last_json, smolforge_here

ALPACA = [{"instruction": f"Say the number {i}.", "input": "", "output": f"The number is {i}."} for i in range(16)]
HELD_OUT = [{"instruction": f"Say the letter {c}.", "input": "", "output": f"The letter is {c}."} for c in "abcd"]


def _cache_entry(root: Path, repo: str, config: str, rows: list[dict]) -> None:
    """REPO's CONFIG in the HF datasets cache under ROOT/cache, laid out as `load_dataset` leaves it
    (<ns>___<name>/<config>/<version>/<hash>/: dataset_info.json and <name>-train.arrow), built offline
    by datasets' own json builder from ROWS."""
    from datasets.packaged_modules.json.json import Json

    name = repo.split("/")[-1]
    source = root / f"{name}.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    Json(cache_dir=str(root / "build"), dataset_name=name, data_files={"train": str(source)},
         config_name=config, hash="0123abcd").download_and_prepare()
    entry = root / "cache" / repo.replace("/", "___") / config / "0.0.0"
    entry.mkdir(parents=True)
    shutil.move(glob.glob(str(root / "build" / name / f"{config}-*" / "0.0.0" / "0123abcd"))[0], entry / "0123abcd")


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict[str, Path]:
    """A save_to_disk DatasetDict (alpaca rows) and two Hub-cache entries: `acme/tiny_notes` (a text
    column named `content`) and the seeds' `wikitext` / `wikitext-2-raw-v1` (a `text` column)."""
    import datasets

    root = tmp_path_factory.mktemp("hub")
    saved = root / "alpaca_saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA),
                          "validation": datasets.Dataset.from_list(HELD_OUT)}).save_to_disk(str(saved))
    _cache_entry(root, "acme/tiny_notes", "default",
                 [{"content": f"note {i}: the sky is blue.", "id": i} for i in range(16)])
    _cache_entry(root, "wikitext", "wikitext-2-raw-v1", [{"text": f" = Article {i} = \n"} for i in range(16)])
    return {"saved": saved, "cache": root / "cache"}


@pytest.fixture
def offline(hub, tmp_path, monkeypatch):
    """The test's HF cache as the datasets cache, offline, and a SMOLFORGE_HOME of its own."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(hub["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SMOLFORGE_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "datasets"


def _train(tmp_path: Path, *by_name: str):
    return smolforge_here("train", "--model", "tiny-llama", *by_name, "--max-steps", "2", "--batch-size", "2",
                          "--max-length", "32", "--output-dir", str(tmp_path / "run"), "--num-threads", "1",
                          "--set", "data.max_eval_samples=2", "--no-tensorboard", "--json")


def _rows(folder: Path) -> list[dict]:
    (path,) = folder.glob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_save_to_disk_dataset_trains_by_name(hub, offline, tmp_path):
    proc = _train(tmp_path, "--dataset-name", str(hub["saved"]), "--dataset-split", "train")
    assert proc.exit_code == 0, proc.output[-3000:]
    assert last_json(proc.stdout)["steps"] == 2
    assert _rows(offline) == ALPACA  # alpaca rows, as JSONL's shape detection reads them


def test_a_hub_cache_dataset_trains_by_name_with_its_text_column(hub, offline, tmp_path):
    proc = _train(tmp_path, "--dataset-name", "acme/tiny_notes", "--dataset-column", "content")
    assert proc.exit_code == 0, proc.output[-3000:]
    assert last_json(proc.stdout)["steps"] == 2
    assert _rows(offline)[3] == {"text": "note 3: the sky is blue."}


def test_a_name_not_cached_fails_at_once_with_the_fix(hub, offline, tmp_path, monkeypatch):
    import smolforge.train.engine as engine

    monkeypatch.setattr(engine, "train", lambda *a, **k: pytest.fail("trained without a dataset"))
    proc = _train(tmp_path, "--dataset-name", "acme/absent", "--dataset-config", "small")
    assert proc.exit_code == 2, proc.output[-3000:]
    assert "acme/absent (small) split train is not in the local Hugging Face cache" in proc.stderr
    assert "fix: on a machine with internet run: python -c \"import datasets; datasets.load_dataset('acme/absent', " \
           "'small', split='train')\"" in proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.output
    assert not offline.exists()


def test_launch_sends_the_named_dataset_as_jsonl(hub, offline, tmp_path, monkeypatch):
    """launch resolves --dataset-name at submit into the JSONL path it uploads."""
    import smolforge.cli.launch as launch

    sent: list[dict] = []
    monkeypatch.setattr(launch, "_submit_and_follow", lambda spec, *_, **__: sent.append(spec))
    proc = smolforge_here("launch", "--model", "tiny-llama", "--dataset-name", "acme/tiny_notes",
                          "--dataset-column", "content", "--workers", "2", "--max-steps", "2")
    assert proc.exit_code == 0, proc.output[-3000:]
    (jsonl,) = offline.glob("*.jsonl")
    assert sent[0]["train"]["data"]["path"] == str(jsonl)


SPEC_SECTIONS = {  # kind: (the job spec around a dataset by name, where its file lands)
    "data_parallel": (lambda named: {"kind": "data_parallel", "train": {"model": "tiny-llama", "data": named}},
                      "train.data.path"),
    "seed-task": (lambda named: {"model": "tiny-llama", **named}, "train.data.path"),
    "distill": (lambda named: {"kind": "distill", "distill": {"teacher": "small-llama", "students": ["tiny-llama"],
                                                              **named}}, "distill.data"),
    "split": (lambda named: {"kind": "split", "split": {"model": "tiny-llama", "split_point_1": 1,
                                                        "split_point_2": 3, **named}}, "split.dataset"),
    # the seeds' stage calls as jobs: a teacher stage's prompts, a students stage's held-out set
    "distill_task teacher": (lambda named: {"kind": "distill_task", "stage": "teacher",
                                            "args": {"model_path": "small-llama", **named}}, "args.dataset_path"),
    "distill_task students": (lambda named: {"kind": "distill_task", "stage": "students", "teacher_job": "j1",
                                             "args": {"base_model": "tiny-llama", **named}}, "args.eval_data"),
}


@pytest.mark.parametrize("kind", list(SPEC_SECTIONS))
def test_every_job_kind_reads_its_dataset_by_name_at_submit(kind, hub, offline):
    """A spec's `dataset_name` (config.NamedDataset, beside the kind's data file) is read where the job
    is submitted (`stage_spec`, both backends' submit_job) into one JSONL upload; what the coordinator
    then validates names the upload only."""
    from smolforge.cluster.control.kinds import parse, stage_spec
    from smolforge.config import get_path

    build, where = SPEC_SECTIONS[kind]
    uploaded: list[Path] = []
    staged = stage_spec(build({"dataset_name": str(hub["saved"]), "dataset_split": "train"}),
                        lambda path: uploaded.append(path) or "upload:ab12")
    assert get_path(staged, where) == "upload:ab12"
    assert [json.loads(line) for line in uploaded[0].read_text().splitlines()] == ALPACA
    job = parse(staged)
    assert get_path(job.model_dump(), where.rpartition(".")[0] + ".dataset_name") is None


def test_the_seeds_split_train_line_reads_a_cached_wikitext(hub, offline, tmp_path, monkeypatch):
    """SplitLearn's `--dataset-name wikitext --dataset-config wikitext-2-raw-v1` (a seed spelling of
    `split train`) is the cached dataset as JSONL; not cached, it is refused (test_seed_lines.py)."""
    import smolforge.split.trainer as trainer

    seen: list = []
    done = SimpleNamespace(steps=0, final_loss=0.0, adapter_dir="-")
    monkeypatch.setattr(trainer, "train_split", lambda cfg: seen.append(cfg) or done)
    monkeypatch.chdir(tmp_path)
    proc = smolforge_here("split", "train", "--model-type", "gpt2", "--model-name", "tiny-gpt2", "--split-point-1", "0",
                          "--split-point-2", "6", "--dataset-name", "wikitext", "--dataset-config", "wikitext-2-raw-v1",
                          "--max-train-samples", "8")
    assert proc.exit_code == 0, proc.output[-3000:]
    (jsonl,) = offline.glob("*.jsonl")
    assert seen and seen[0].dataset == str(jsonl)
    assert _rows(offline)[0] == {"text": " = Article 0 = \n"}


@pytest.mark.parametrize("args,needle", [
    (["--data", "bundled", "--dataset-name", "acme/tiny_notes"], "both --data bundled and --dataset-name acme/tiny_notes"),
    (["--data", "bundled", "--dataset-split", "test"], "--dataset-split needs --dataset-name"),
    (["--dataset-name", "bundled", "--dataset-column", "text"], "--dataset-column: bundled is a local dataset"),
    (["--data", "bundled", "--dataset-eval-split", "validation"], "--dataset-eval-split needs --dataset-name"),
    (["--dataset-name", "bundled", "--dataset-eval-split", "validation"], "--dataset-eval-split: bundled is a local dataset"),
    (["--dataset-name", "acme/absent", "--eval-data", "bundled", "--dataset-eval-split", "validation"],
     "both --eval-data bundled and --dataset-eval-split validation"),
], ids=["both", "split-without-name", "column-of-a-file", "eval-split-without-name", "eval-split-of-a-file",
        "eval-file-and-split"])
def test_dataset_flags_that_do_not_go_together_are_one_message(args, needle, offline, tmp_path):
    proc = _train(tmp_path, *args)
    assert proc.exit_code == 2 and needle in proc.stderr, proc.output[-2000:]
    assert proc.stderr.count("error:") == 1 and "\n  fix:" in proc.stderr and "Traceback" not in proc.output


@pytest.mark.parametrize("kind", ["data_parallel", "distill", "split", "distill_task teacher", "distill_task students"])
def test_a_coordinator_refuses_a_spec_whose_name_was_not_read_at_submit(kind):
    """A spec posted straight to a coordinator (not through Client/submit, which read the name) still
    naming a dataset: refused at its submit, naming the field (the coordinator has no such cache)."""
    from smolforge.cluster.control.kinds import check_uploads, parse
    from smolforge.errors import SmolforgeError

    build, where = SPEC_SECTIONS[kind]
    job = parse(build({"dataset_name": "wikitext"}))
    with pytest.raises(SmolforgeError, match=rf"{where.rpartition('.')[0]}.dataset_name 'wikitext' was not read"):
        check_uploads(job, lambda ref: True)


ABSENT = ("--dataset-name", "acme/absent")
EVERY_PATH = {  # every command and spec that reads a dataset, naming one that is not cached ({dir}: the test's)
    "train": ["train", "--model", "tiny-llama", *ABSENT, "--max-steps", "1"],
    "train --set": ["train", "--model", "tiny-llama", "--set", "dataset_name=acme/absent", "--max-steps", "1"],
    "train --config": ["train", "--config", "{dir}/train.yaml"],
    "eval": ["eval", "--model", "tiny-llama", *ABSENT],
    "launch": ["launch", "--model", "tiny-llama", *ABSENT, "--max-steps", "1"],
    "launch --set": ["launch", "--model", "tiny-llama", "--set", "dataset_name=acme/absent", "--max-steps", "1"],
    "launch teacher_student": ["launch", "--mode", "teacher_student", "--model", "small-llama", "--student",
                               "tiny-llama", *ABSENT],
    "launch split --set": ["launch", "--mode", "split", "--model", "tiny-llama", "--split-point-1", "1",
                           "--split-point-2", "3", "--set", "split.dataset_name=acme/absent"],
    "distill": ["distill", "--teacher", "small-llama", "--student", "tiny-llama", *ABSENT],
    "split train": ["split", "train", "--model", "tiny-llama", "--split-point-1", "1", "--split-point-2", "3", *ABSENT],
    "submit data_parallel": ["submit", "{dir}/dp.yaml"],
    "submit seed task": ["submit", "{dir}/task.yaml"],
    "submit distill": ["submit", "{dir}/distill.yaml"],
    "submit split": ["submit", "{dir}/split.yaml"],
    "submit distill_task": ["submit", "{dir}/teacher.yaml"],
    "submit distill_task --set": ["submit", "{dir}/students.yaml", "--set", "dataset_name=acme/absent"],
    "submit --set": ["submit", "{dir}/bare.yaml", "--set", "dataset_name=acme/absent"],
}
SPEC_FILES = {
    "train.yaml": "model: tiny-llama\ndata: {dataset_name: acme/absent}\nmax_steps: 1\n",
    "dp.yaml": "kind: data_parallel\ntrain: {model: tiny-llama, data: {dataset_name: acme/absent}, max_steps: 1}\n",
    "task.yaml": "model: tiny-llama\ndataset_name: acme/absent\n",
    "distill.yaml": "kind: distill\ndistill: {teacher: small-llama, students: [tiny-llama], dataset_name: acme/absent}\n",
    "split.yaml": "kind: split\nsplit: {model: tiny-llama, split_point_1: 1, split_point_2: 3, dataset_name: acme/absent}\n",
    "bare.yaml": "kind: data_parallel\ntrain: {model: tiny-llama, max_steps: 1}\n",
    "teacher.yaml": "kind: distill_task\nstage: teacher\nargs: {model_path: small-llama, dataset_name: acme/absent}\n",
    "students.yaml": "kind: distill_task\nstage: students\nteacher_job: j1\nargs: {base_model: tiny-llama}\n",
}


@pytest.fixture
def spec_files(tmp_path) -> Path:
    for name, text in SPEC_FILES.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _nothing_starts(monkeypatch) -> None:
    """Any model load, training run or cluster start fails the test: the refusal comes first."""
    import smolforge.cluster.embedded as embedded
    import smolforge.models.loading as loading
    import smolforge.train.engine as engine

    for module, name in ((engine, "train"), (loading, "load_model"), (loading, "load_tokenizer")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("started before the dataset was read"))
    monkeypatch.setattr(embedded.EmbeddedCluster, "handle", property(lambda self: pytest.fail("started a cluster")))


@pytest.mark.parametrize("path", list(EVERY_PATH))
def test_a_name_not_cached_fails_at_once_on_every_path(path, hub, offline, spec_files, monkeypatch):
    """Flags, --set, --config and job specs of every command that reads a dataset: a Hub name that is not
    in the local cache is one message, exit 2, with the `load_dataset` call that caches it, before any
    model loads or cluster starts (data.hub.by_name, the one resolver every path asks)."""
    _nothing_starts(monkeypatch)
    monkeypatch.chdir(spec_files)
    proc = smolforge_here(*(arg.format(dir=spec_files) for arg in EVERY_PATH[path]))
    assert proc.exit_code == 2, proc.output[-3000:]
    assert "dataset acme/absent split train is not in the local Hugging Face cache" in proc.stderr
    assert "datasets.load_dataset('acme/absent', split='train')" in proc.stderr
    assert proc.stderr.count("error:") == 1 and "\n  fix:" in proc.stderr and "Traceback" not in proc.output
    assert not offline.exists()  # nothing written


@pytest.mark.parametrize("args,needle", [
    (["train", "--config", "{dir}/both.yaml"], "data: Value error, both path bundled and dataset_name acme/tiny_notes"),
    (["train", "--model", "tiny-llama", "--data", "bundled", "--set", "dataset_name=acme/tiny_notes"],
     "both path bundled and dataset_name acme/tiny_notes"),
    (["train", "--model", "tiny-llama", "--data", "bundled", "--set", "dataset_split=test"],
     "dataset_split needs dataset_name"),
    # a spec file's: at the line of the first of the two the file wrote (the --set's value has none)
    (["submit", "{dir}/both_job.yaml"], "both_job.yaml:1: both train.data.path bundled and train.data.dataset_name "
                                        "acme/tiny_notes"),
    (["submit", "{dir}/split.yaml", "--set", "split.dataset=bundled"],
     "split.yaml:2: both split.dataset bundled and split.dataset_name acme/absent"),
    (["launch", "--model", "tiny-llama", "--dataset", "bundled", "--set", "dataset_name=acme/tiny_notes"],
     "job spec: both train.data.path bundled and train.data.dataset_name acme/tiny_notes"),
], ids=["train-config", "train-set", "train-set-split-alone", "submit", "submit-split-set", "launch-set"])
def test_a_spec_with_a_file_and_a_name_is_refused_naming_both(args, needle, hub, offline, spec_files, monkeypatch):
    _nothing_starts(monkeypatch)
    (spec_files / "both.yaml").write_text("model: tiny-llama\ndata: {path: bundled, dataset_name: acme/tiny_notes}\n")
    (spec_files / "both_job.yaml").write_text("train: {model: tiny-llama, data: {path: bundled, dataset_name: "
                                              "acme/tiny_notes}}\n")
    proc = smolforge_here(*(arg.format(dir=spec_files) for arg in args))
    assert proc.exit_code == 2 and needle in proc.stderr, proc.output[-2000:]
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.output
    assert not offline.exists()  # refused before the name was read


def test_a_config_file_and_set_train_and_eval_by_name(hub, offline, tmp_path):
    """`train --config` with `data: {dataset_name: ...}` and `--set dataset_column=...` trains from the
    test's Hub cache; `eval --dataset-name` evaluates on the same rows (written once)."""
    (tmp_path / "train.yaml").write_text("model: tiny-llama\ndata: {dataset_name: acme/tiny_notes, max_length: 32}\n")
    proc = smolforge_here("train", "--config", str(tmp_path / "train.yaml"), "--set", "dataset_column=content",
                          "--max-steps", "2", "--batch-size", "2", "--output-dir", str(tmp_path / "run"),
                          "--num-threads", "1", "--set", "data.max_eval_samples=2", "--no-tensorboard", "--json")
    assert proc.exit_code == 0, proc.output[-3000:]
    assert last_json(proc.stdout)["steps"] == 2
    assert _rows(offline)[3] == {"text": "note 3: the sky is blue."}
    proc = smolforge_here("eval", "--model", "tiny-llama", "--dataset-name", "acme/tiny_notes", "--dataset-column",
                          "content", "--max-samples", "2", "--max-length", "32", "--max-new-tokens", "1", "--json")
    assert proc.exit_code == 0, proc.output[-3000:]
    assert last_json(proc.stdout)["examples"] == 2
    assert len(list(offline.glob("*.jsonl"))) == 1  # the same file, not written again


HELP_LINES = [["train"], ["eval"], ["launch"], ["distill"], ["split", "train"]]


@pytest.mark.parametrize("command", HELP_LINES, ids=" ".join)
def test_help_shows_the_dataset_flags_with_an_example(command):
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    out = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "300"}).output
    head, options = out.split("Options", 1)  # the command's text, then its flags
    for flag in ("--dataset-name", "--dataset-config", "--dataset-split", "--dataset-column", "--dataset-eval-split"):
        assert flag in options, flag
    examples = [p for p in re.split(r"\n\s*\n", head) if p.strip().startswith("Example")]
    assert any(f"smolforge {' '.join(command)} " in p and "--dataset-name" in p for p in examples), examples


def test_a_data_flag_replaces_the_config_file_s_dataset_by_name(tmp_path):
    """Flags come after the --config file: --data there replaces the file's `data.dataset_name` (not both)."""
    from smolforge.cli.train import build_train_config

    (tmp_path / "c.yaml").write_text("model: tiny-llama\ndata: {dataset_name: acme/absent, max_length: 32}\n")
    cfg = build_train_config(tmp_path / "c.yaml", [], {"data": "bundled"}, {})
    assert (cfg.data.path, cfg.data.dataset_name, cfg.data.max_length) == ("bundled", None, 32)


def _held_out(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_eval_split_of_a_dataset_by_name_is_the_held_out_file(hub, offline, tmp_path):
    """`dataset_eval_split` (TRL's dataset_test_split) reads the named dataset's other split into the
    held-out file, by the one resolver: a train --config, `--set` on a job spec read at submit into the
    uploaded `train.data.eval_path`, and a spec naming a held-out file too refused naming both."""
    from smolforge.cli.train import build_train_config
    from smolforge.cluster.control.kinds import apply_job_overrides, stage_spec
    from smolforge.errors import SmolforgeError

    (tmp_path / "c.yaml").write_text(f"model: tiny-llama\ndata: {{dataset_name: {hub['saved']}, "
                                     "dataset_eval_split: validation}\n")
    cfg = build_train_config(tmp_path / "c.yaml", [], {}, {})
    assert (_held_out(cfg.data.path), _held_out(cfg.data.eval_path)) == (ALPACA, HELD_OUT)
    spec = apply_job_overrides({"kind": "data_parallel", "train": {"model": "tiny-llama"}},
                               [f"dataset_name={hub['saved']}", "dataset_eval_split=validation"])
    uploads: dict[str, list] = {}
    staged = stage_spec(spec, lambda path: uploads.setdefault(f"upload:{len(uploads)}", _held_out(path)) and
                        f"upload:{len(uploads) - 1}")
    data = staged["train"]["data"]
    assert (uploads[data["path"]], uploads[data["eval_path"]]) == (ALPACA, HELD_OUT)
    assert "dataset_eval_split" not in data
    both = {"kind": "data_parallel", "train": {"model": "tiny-llama", "data": {
        "dataset_name": str(hub["saved"]), "eval_path": "bundled", "dataset_eval_split": "validation"}}}
    with pytest.raises(SmolforgeError, match="both train.data.eval_path bundled and train.data.dataset_eval_split"):
        stage_spec(both, lambda path: "upload:x")


# --- issue 46 leftovers: the eval split on every path, the seeds' calls by name, `data show` -------------------

def test_eval_reads_a_datasets_eval_split_whole(hub, offline):
    """A real run: `eval --dataset-eval-split validation` evaluates on that split, whole (4 rows), as
    train holds it out; without it, the --dataset-split rows (16)."""
    args = ("eval", "--model", "tiny-llama", "--dataset-name", str(hub["saved"]), "--max-length", "32",
            "--max-new-tokens", "1", "--batch-size", "4", "--json")
    proc = smolforge_here(*args, "--dataset-eval-split", "validation")
    assert proc.exit_code == 0, proc.output[-3000:]
    assert last_json(proc.stdout)["examples"] == len(HELD_OUT)


def _sent_by(monkeypatch) -> list:
    """What launch, distill and split train hand over (a job spec, split train's config), recorded instead."""
    import dataclasses

    import smolforge.cli.distill as distill
    import smolforge.cli.launch as launch
    import smolforge.split.trainer as trainer
    from smolforge.cluster.control import kinds

    sent: list = []
    monkeypatch.setattr(launch, "_submit_and_follow", lambda spec, *_, **__: sent.append(spec))
    monkeypatch.setattr(distill, "run_distill_job", lambda spec, *_, **__: sent.append(spec) or {})
    monkeypatch.setattr(distill, "_export_and_show", lambda *_: None)
    monkeypatch.setattr(trainer, "train_split", lambda cfg: sent.append(cfg.model_dump()) or SimpleNamespace(
        to_dict=dict, steps=0, final_loss=0.0, adapter_dir="-"))
    # the distill check plans the run (tokenizers, PEFT): not what this test asks
    monkeypatch.setitem(kinds.KINDS, "distill", dataclasses.replace(kinds.KINDS["distill"], check=lambda job: None))
    return sent


SPLIT = ("--split-point-1", "1", "--split-point-2", "3")
EVAL_SPLIT_PATHS = {  # command line -> where its held-out file lands in what it builds
    "launch": (["launch", "--model", "tiny-llama", "--max-steps", "1"], "train.data.eval_path"),
    "launch --stages": (["launch", "--model", "tiny-llama", "--stages", "2", "--max-steps", "1"], "train.data.eval_path"),
    "launch split": (["launch", "--mode", "split", "--model", "tiny-llama", *SPLIT], "split.eval_dataset"),
    "launch teacher_student": (["launch", "--mode", "teacher_student", "--model", "small-llama", "--student",
                                "tiny-llama"], "distill.eval_data"),
    "distill": (["distill", "--teacher", "small-llama", "--student", "tiny-llama"], "distill.eval_data"),
    "split train": (["split", "train", "--model", "tiny-llama", *SPLIT, "--quiet"], "eval_dataset"),
}


@pytest.mark.parametrize("path", list(EVAL_SPLIT_PATHS))
def test_every_command_reads_the_eval_split_into_its_held_out_file(path, hub, offline, tmp_path, monkeypatch):
    """`--dataset-eval-split` on launch (data-parallel, pipeline, split, distillation), distill and split
    train: the split read by the one resolver into the held-out file of what the command builds."""
    from smolforge.config import get_path

    sent = _sent_by(monkeypatch)
    monkeypatch.chdir(tmp_path)
    command, where = EVAL_SPLIT_PATHS[path]
    proc = smolforge_here(*command, "--dataset-name", str(hub["saved"]), "--dataset-eval-split", "validation")
    assert proc.exit_code == 0, proc.output[-3000:]
    assert _held_out(get_path(sent[0], where)) == HELD_OUT


EVAL_WHERE = {"data_parallel": "train.data.eval_path", "seed-task": "train.data.eval_path",
              "distill": "distill.eval_data", "split": "split.eval_dataset", "distill_task students": "args.eval_path"}


@pytest.mark.parametrize("kind", list(EVAL_WHERE))
def test_every_job_kind_reads_its_eval_split_at_submit(kind, hub, offline):
    """A spec's `dataset_eval_split` beside `dataset_name`: read at submit into the kind's held-out file
    (`JobKind.named_eval`), uploaded; the coordinator's spec names the uploads only."""
    from smolforge.cluster.control.kinds import parse, stage_spec
    from smolforge.config import get_path

    build, where = SPEC_SECTIONS[kind]
    uploads: dict[str, list] = {}
    staged = stage_spec(build({"dataset_name": str(hub["saved"]), "dataset_eval_split": "validation"}),
                        lambda path: uploads.setdefault(f"upload:{len(uploads)}", _held_out(path)) and
                        f"upload:{len(uploads) - 1}")
    assert (uploads[get_path(staged, where)], uploads[get_path(staged, EVAL_WHERE[kind])]) == (ALPACA, HELD_OUT)
    parse(staged)


def test_split_and_distill_students_read_the_held_out_file_whole(hub, offline):
    """What runs reads the held-out file as it is (not a split of it): split learning's DataSpec, and the
    distill students' eval examples."""
    from smolforge.cluster.workloads.distill.students import StudentTasks
    from smolforge.data.hub import by_name
    from smolforge.split.trainer import SplitTrainConfig

    held = by_name(str(hub["saved"]), split="validation")
    spec = SplitTrainConfig(model="tiny-llama", split_point_1=1, split_point_2=3, eval_dataset=held).data_spec()
    assert spec.eval_path == held
    examples = StudentTasks._eval_examples(None, held, held, 200)  # as `start_students` calls it
    assert [ex["messages"][-1]["content"] for ex in examples] == [row["output"] for row in HELD_OUT]


class _Recorder:
    """The job API an Orchestrator uses, recording what it submits (parsed as a coordinator parses it)."""

    runs_in_process = False

    def __init__(self):
        self.specs: list[dict] = []

    def submit_job(self, spec: dict) -> str:
        from smolforge.cluster.control import kinds

        kinds.parse(spec)
        self.specs.append(spec)
        return f"job-{len(self.specs):010x}"


def test_the_seeds_calls_take_a_dataset_by_name(hub, offline, tmp_path, monkeypatch):
    """`create_data_parallel_tasks(dataset_name=...)` submits the spec's own fields (read at submit);
    `create_teacher_task` / `create_student_tasks` read the name here into the files they send."""
    from smolforge.orchestrator import Orchestrator

    monkeypatch.chdir(tmp_path)
    orch = Orchestrator("teacher_student", backend=_Recorder())
    orch.create_data_parallel_tasks("tiny-llama", dataset_name="acme/tiny_notes", dataset_column="content",
                                    dataset_eval_split="validation", max_steps=1)
    assert orch.backend.specs[0]["train"]["data"] == {"dataset_name": "acme/tiny_notes", "dataset_column": "content",
                                                      "dataset_eval_split": "validation", "max_length": 256}
    orch.create_teacher_task("small-llama", dataset_name=str(hub["saved"]), output_dir="./run")
    assert _held_out(orch.backend.specs[1]["args"]["dataset_path"]) == ALPACA
    orch.create_student_tasks("tiny-llama", num_students=1, dataset_name=str(hub["saved"]),
                              dataset_eval_split="validation")
    args = orch.backend.specs[2]["args"]
    assert (_held_out(args["eval_data"]), _held_out(args["eval_path"])) == (ALPACA, HELD_OUT)


@pytest.mark.parametrize("call,needle", [
    (lambda o: o.create_data_parallel_tasks("tiny-llama", "bundled", dataset_name="acme/x"),
     "both dataset_path bundled and dataset_name acme/x"),
    (lambda o: o.create_data_parallel_tasks("tiny-llama"), "no dataset: give dataset_path or dataset_name"),
    (lambda o: o.create_data_parallel_tasks("tiny-llama", "bundled", dataset_split="test"),
     "dataset_split needs dataset_name"),
    (lambda o: o.create_parallel_teacher_tasks("small-llama", output_dir="./run"),
     "no dataset: give dataset_path or dataset_name"),
    (lambda o: o.create_student_tasks("tiny-llama", "./run", eval_data="bundled", dataset_name="acme/x"),
     "both eval_data bundled and dataset_name acme/x"),
    (lambda o: o.create_student_tasks("tiny-llama", "./run", dataset_name="acme/x", eval_path="e.jsonl",
                                      dataset_eval_split="validation"), "both eval_path e.jsonl and dataset_eval_split"),
], ids=["dp-both", "dp-neither", "dp-split-alone", "teacher-neither", "students-both", "students-eval-both"])
def test_a_seed_call_with_both_or_neither_dataset_is_one_error(call, needle, offline):
    from smolforge.errors import SmolforgeError
    from smolforge.orchestrator import Orchestrator

    with pytest.raises(SmolforgeError, match=re.escape(needle)) as err:
        call(Orchestrator("teacher_student", backend=_Recorder()))
    assert err.value.fix and not offline.exists()  # refused before anything was read


def test_data_show_says_what_training_reads_from_a_cached_name(hub, offline):
    """`data show NAME`: where the name resolved (its cache directory), the shape, rows and columns, the
    column used, two rows as training text and the held-out set; a JSONL file the same way."""
    proc = smolforge_here("data", "show", "acme/tiny_notes", "--dataset-column", "content", "--json")
    assert proc.exit_code == 0, proc.output[-3000:]
    info = last_json(proc.stdout)
    assert (info["kind"], Path(info["where"]).is_relative_to(hub["cache"] / "acme___tiny_notes")) == (
        "Hugging Face cache", True)
    assert (info["format"], info["columns"], info["columns_used"], info["rows"]) == ("text", ["content", "id"],
                                                                                       ["content"], 16)
    assert len(info["samples"]) == 2  # the first training rows (after the held-out split), as their text
    assert all(re.fullmatch(r"note \d+: the sky is blue\.", sample["text"]) for sample in info["samples"])
    assert info["held_out"]["rows"] == 1 and "10% split" in info["held_out"]["how"]
    text = smolforge_here("data", "show", str(hub["saved"]), "--dataset-eval-split", "validation")
    assert text.exit_code == 0, text.output[-3000:]
    assert "save_to_disk directory" in text.stdout and "alpaca (columns used: instruction, input, output" in text.stdout
    assert "held out:  4 rows, split validation, whole" in text.stdout
    assert "user: Say the number 0.\nassistant: The number is 0." in text.stdout
    file = smolforge_here("data", "show", info["file"], "--json")
    assert (last_json(file.stdout)["kind"], last_json(file.stdout)["rows"]) == ("JSONL file", 16)


def test_data_show_of_a_name_not_cached_is_exit_2_with_the_fix(hub, offline):
    proc = smolforge_here("data", "show", "acme/absent")
    assert proc.exit_code == 2, proc.output[-3000:]
    assert "datasets.load_dataset('acme/absent', split='train')" in proc.stderr and "Traceback" not in proc.output
    assert "pass SOURCE (the argument) DIR" in proc.stderr and "--dataset-name" not in proc.stderr  # its own spelling
