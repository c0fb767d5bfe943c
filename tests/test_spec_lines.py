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
