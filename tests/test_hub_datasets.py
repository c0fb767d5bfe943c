"""Datasets by their Hub names, offline (issue 46 item 3): `--dataset-name` on train and launch, and
`{dataset_name: ...}` in job specs, read from a `save_to_disk` directory or the local Hugging Face
cache that the test makes (no network: HF_HUB_OFFLINE), written once as JSONL; a name not cached
fails at once with exit 2 and the command that caches it."""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import last_json, smolforge_here

ALPACA = [{"instruction": f"Say the number {i}.", "input": "", "output": f"The number is {i}."} for i in range(16)]


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
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA)}).save_to_disk(str(saved))
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


def test_launch_and_job_specs_send_the_named_dataset_as_jsonl(hub, offline, tmp_path, monkeypatch):
    """launch resolves --dataset-name at submit into the JSONL path it uploads; a spec's
    `{dataset_name: ...}` is resolved where local files are staged (both backends' submit_job)."""
    import smolforge.cli.launch as launch
    from smolforge.cluster.control.kinds import stage_spec

    sent: list[dict] = []
    monkeypatch.setattr(launch, "_submit_and_follow", lambda spec, *_, **__: sent.append(spec))
    proc = smolforge_here("launch", "--model", "tiny-llama", "--dataset-name", "acme/tiny_notes",
                          "--dataset-column", "content", "--workers", "2", "--max-steps", "2")
    assert proc.exit_code == 0, proc.output[-3000:]
    (jsonl,) = offline.glob("*.jsonl")
    assert sent[0]["train"]["data"]["path"] == str(jsonl)
    uploaded: list[Path] = []
    spec = {"kind": "data_parallel", "train": {"model": "tiny-llama",
                                               "data": {"path": {"dataset_name": str(hub["saved"])}}}}
    staged = stage_spec(spec, lambda path: uploaded.append(path) or "upload:ab12")
    assert staged["train"]["data"]["path"] == "upload:ab12"
    assert [json.loads(line) for line in uploaded[0].read_text().splitlines()] == ALPACA


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
], ids=["both", "split-without-name", "column-of-a-file"])
def test_dataset_flags_that_do_not_go_together_are_one_message(args, needle, offline, tmp_path):
    proc = _train(tmp_path, *args)
    assert proc.exit_code == 2 and needle in proc.stderr, proc.output[-2000:]
    assert proc.stderr.count("error:") == 1 and "\n  fix:" in proc.stderr and "Traceback" not in proc.output
