"""Timeouts that agree: rank 0 ships each checkpoint to the coordinator while the other ranks wait at
the save's barrier. Over Wi-Fi a big checkpoint takes long; the ranks' collective timeout must outlast
the upload's bound, or every round fails at its first checkpoint.

Here the upload is made slow on purpose (SMOLFORGE_FAULT_UPLOAD_DELAY_S, read by the DP rank) and the
collective timeout set shorter than that delay: the job completes, because the group's timeout is
never shorter than `checkpoint_upload_timeout_s` plus a margin."""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest

from test_embedded_recovery import _cli, _env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_slow_checkpoint_upload_does_not_time_out_the_other_ranks(tmp_path):
    from smolforge.data.synthetic import generate

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(32, seed=3)))
    ray_tmp = tempfile.mkdtemp(prefix="sfr", dir="/tmp")
    env = {**_env(tmp_path / "home", ray_tmp), "SMOLFORGE_FAULT_UPLOAD_DELAY_S": "12"}
    try:
        proc = _cli(env, "launch", "--model", "tiny-llama", "--dataset", str(data), "--workers", "2",
                    "--batch-size", "2", "--max-steps", "4", "--max-length", "48", "--save-every", "4",
                    "--max-retries", "0", "--set", "dist_timeout_s=8", "--set", "checkpoint_upload_timeout_s=30",
                    "--set", "eval_accuracy=false", "--set", "data.max_eval_samples=4",
                    "--output-dir", str(tmp_path / "out"), "--quiet", "--json", timeout=500)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        final = json.loads(proc.stdout.strip().splitlines()[-1])
        assert final["state"] == "completed" and final["result"]["steps"] == 4, final
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
