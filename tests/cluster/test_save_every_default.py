"""One default for a data-parallel job's checkpoints (`specs.default_save_every`), whichever road the
spec takes: `smolforge submit` of a job file (through the client, as the coordinator validates it),
`launch`'s flags, and the seeds' task shape. A job file without `save_every` once got TrainConfig's 0
(no checkpoint: a dead worker cost the whole run) while `launch` got a tenth of the steps. In this
process: the client's request is captured instead of sent, then parsed as `JobManager.submit` does."""

from __future__ import annotations

from typing import Any

import pytest

from smolforge.cluster.control import kinds
from smolforge.cluster.control.specs import default_save_every

JOB_FILE = """kind: data_parallel
num_workers: 2
train:
  model: tiny-llama
  data: {path: bundled}
  max_steps: 120
"""


def _submitted(tmp_path, text: str, overrides: list[str] | None = None) -> Any:
    """What the coordinator's manager validates for `smolforge submit job.yaml [--set ...]`."""
    from smolforge.client import Client

    job_file = tmp_path / "job.yaml"
    job_file.write_text(text)
    posted: list[dict] = []
    client = Client("127.0.0.1", 1, token="t0k")  # nothing listens there: the request is captured below
    client._request = lambda method, path, **kw: posted.append(kw["json"]) or {"job_id": "j1"}  # type: ignore[method-assign]
    try:
        assert client.submit_job(job_file, overrides) == "j1"
    finally:
        client.close()
    [spec] = posted
    return kinds.parse(spec)


def test_a_submitted_job_file_without_save_every_gets_the_default(tmp_path):
    job = _submitted(tmp_path, JOB_FILE)
    assert job.train.save_every == default_save_every(120) == 12, job.train.save_every
    # the default follows the steps a --set gives, and an epochs-only job gets the epochs' default
    assert _submitted(tmp_path, JOB_FILE, ["train.max_steps=3000"]).train.save_every == 200
    epochs = JOB_FILE.replace("  max_steps: 120\n", "  epochs: 1\n")
    assert _submitted(tmp_path, epochs).train.save_every == default_save_every(None) == 50


@pytest.mark.parametrize("given, expected", [(0, 0), (7, 7)], ids=["off", "set"])
def test_a_save_every_given_is_kept(tmp_path, given, expected):
    assert _submitted(tmp_path, JOB_FILE + f"  save_every: {given}\n").train.save_every == expected


def test_launch_and_the_seeds_get_the_same_default():
    from smolforge.cli.launch import _launch_spec

    launch = kinds.parse(_launch_spec("tiny-llama", "bundled", gpu="no", sets=[], num_workers=2, batch_size=4,
                                      max_retries=2, cpus_per_worker=1.0, name=None, max_steps=120))
    seed = kinds.parse({"model": "tiny-llama", "dataset": "bundled", "num_workers": 2})
    assert (launch.train.save_every, seed.train.save_every) == (default_save_every(120), default_save_every(None))
