"""A run's directory and its manifest (`smolforge.rundir`, issue 43 item 4): a command replaces only
what its own kind of run wrote there, refuses a directory holding another kind's (the demo's old mark is
no exception), and never removes a file a user added."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from smolforge.rundir import MANIFEST, claim_run_dir, read_manifest


def _invoke(argv: list[str]):
    from smolforge.cli.main import app

    return CliRunner().invoke(app, argv, env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None})


def _train_run(path, manifest: bool = True):
    """A `train` run's directory as it leaves it: checkpoints, an adapter, metrics (and its manifest,
    written as the run's claim before it writes them)."""
    if manifest:
        claim_run_dir(path, "train", ("checkpoints", "lora_adapter", "summary.json", "metrics.jsonl"))
    for name in ("step-5", "step-10"):
        (path / "checkpoints" / name).mkdir(parents=True)
        (path / "checkpoints" / name / "trainable.safetensors").write_bytes(b"weights " + name.encode())
    (path / "lora_adapter").mkdir()
    (path / "metrics.jsonl").write_text("{}\n")
    return sorted(p.relative_to(path) for p in path.rglob("*") if p.name != MANIFEST)


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "from-before-manifests"])
def test_the_demo_chain_over_a_train_run_is_refused_and_deletes_nothing(tmp_path, monkeypatch, manifest):
    """`demo --output-dir run1` over a train run's directory, then `demo --workflow sft` there: both exit 2
    and every file of the run stays. A run from before manifests carrying the old demo mark
    (`.smolforge-demo`, which once let the sft demo delete its checkpoints) is refused the same way."""
    import smolforge.cli.demo as demo_cli
    import smolforge.distill.demo as distill_demo

    def not_refused(*_a, **_k):  # a demo that was not refused would train for minutes: fail at once instead
        raise AssertionError("the demo was not refused")

    monkeypatch.setattr(demo_cli, "distill_summary", not_refused)
    monkeypatch.setattr(distill_demo, "run_demo", not_refused)
    monkeypatch.setattr("smolforge.train.engine.train", not_refused)
    run = tmp_path / "run1"
    before = _train_run(run, manifest)
    if not manifest:
        (run / ".smolforge-demo").write_text("written by `smolforge demo`\n")  # the mark the old demo left
        before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for workflow in ("distill", "sft"):
        res = _invoke(["demo", "--workflow", workflow, "--output-dir", str(run)])
        assert res.exit_code == 2, res.output
        assert res.stderr.startswith("error:") and "fix:" in res.stderr and "Traceback" not in res.stderr
        assert ("holds a `train` run's outputs" if manifest else "that no .smolforge-run.json records") in res.stderr
    assert sorted(p.relative_to(run) for p in run.rglob("*") if p.name != MANIFEST) == before
    assert (read_manifest(run) or {}).get("kind", "train") == "train"  # never marked as a demo's


def test_a_demo_replaces_what_an_earlier_demo_wrote_and_keeps_a_users_file(tmp_path):
    """The demo's own earlier outputs (recorded in its manifest) go; a file and a folder the user added
    there stay; a name the demo writes that the user made first is refused, not deleted."""
    from smolforge.cli.demo import SFT_REPLACES
    from smolforge.distill.demo import claim_demo_dir
    from smolforge.errors import SmolforgeError

    demo = tmp_path / "demo"
    claim_demo_dir(demo, SFT_REPLACES)
    (demo / "checkpoints" / "step-400").mkdir(parents=True)
    (demo / "notes.txt").write_text("mine")
    (demo / "mine").mkdir()
    (demo / "mine" / "data.jsonl").write_text("{}\n")
    claim_demo_dir(demo, SFT_REPLACES)
    assert not (demo / "checkpoints").exists()
    assert (demo / "notes.txt").read_text() == "mine" and (demo / "mine" / "data.jsonl").is_file()
    (demo / "distill").mkdir()  # the user's, where no demo wrote one: the distill demo is refused, deletes nothing
    with pytest.raises(SmolforgeError, match="already holds distill, which no earlier demo run wrote"):
        claim_demo_dir(demo, ("distill", "sft-baseline"))
    assert (demo / "distill").is_dir() and (demo / "notes.txt").is_file()


def test_a_re_export_replaces_only_its_own_files(tmp_path):
    """Exporting again into an earlier export's directory replaces that export's files and keeps the ones
    a user added (a file and a folder); an export into a train run's directory is refused (exit 2)."""
    from smolforge.models.export.run import SUMMARY, export

    out = tmp_path / "hf"
    export("tiny-llama", "hf", out)
    (out / "NOTES.md").write_text("how I use this model")
    (out / "extra").mkdir()
    (out / "extra" / "eval.json").write_text("{}")
    (out / "config.json").write_text("{}")  # an export's own file, changed: the re-export writes it anew
    summary = export("tiny-llama", "hf", out)
    assert (out / "NOTES.md").read_text() == "how I use this model" and (out / "extra" / "eval.json").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert set(read_manifest(out)["written"]) == set(summary["files"]) and SUMMARY in summary["files"]
    assert "NOTES.md" not in read_manifest(out)["written"]
    run = tmp_path / "run1"
    before = _train_run(run)
    res = _invoke(["export", "--model", "tiny-llama", "--to", "hf", "--output-dir", str(run)])
    assert res.exit_code == 2 and "holds a `train` run's outputs" in res.stderr, res.output
    assert sorted(p.relative_to(run) for p in run.rglob("*") if p.name != MANIFEST) == before


def _claims():
    """Each kind's own entry point that claims its --output-dir, called as its command calls it."""
    from smolforge.config import DataSpec, TrainConfig
    from smolforge.distill.demo import check_demo_dir
    from smolforge.distill.settings import refuse_used_run_dir
    from smolforge.models.export.run import check_output_dir
    from smolforge.split.merge import merge_run
    from smolforge.train.engine import refuse_used_output_dir

    return {
        "train": lambda d: refuse_used_output_dir(TrainConfig(model="tiny-llama", data=DataSpec(path="bundled"),
                                                              output_dir=str(d))),
        "demo": lambda d: check_demo_dir(d, ("checkpoints",)),
        "distill": lambda d: refuse_used_run_dir(d, resume=False),
        "export": lambda d: check_output_dir(d),
        "split": lambda d: merge_run(d),
    }


@pytest.mark.parametrize("owner", ["train", "demo", "distill", "export", "split"])
def test_every_kind_refuses_a_directory_of_another_kind(tmp_path, owner):
    """The one rule at every entry point: a directory whose manifest names another kind of run is refused
    (SmolforgeError: exit 2 from the CLI), before anything is written or deleted there."""
    from smolforge.errors import SmolforgeError

    claims = _claims()
    for kind, claim in claims.items():
        if kind == owner:
            continue
        d = tmp_path / f"{owner}-for-{kind}"
        claim_run_dir(d, owner, ("checkpoints",))
        (d / "checkpoints").mkdir()
        (d / "checkpoints" / "kept").write_text("the owner's")
        manifest = (d / MANIFEST).read_bytes()
        with pytest.raises(SmolforgeError, match=f"holds a `{owner}` run's outputs"):
            claim(d)
        assert (d / MANIFEST).read_bytes() == manifest and (d / "checkpoints" / "kept").read_text() == "the owner's"
