"""The seeds' Python API as their users call it: examples/seeds_api.py (the seed guides' calls, only the
import lines changed) runs against a real local cluster (a coordinator and two workers, each its own
process) from the coordinator's machine: `create_distributed_training(...)` and `Client()` find the
coordinator and its token through $SMOLFORGE_HOME, never through argv."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from localcluster import ROOT, LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from smolforge.data.synthetic import generate

    base = tmp_path_factory.mktemp("seeds")
    data = base / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(16, seed=5)))
    work = base / "work"
    work.mkdir()
    with LocalCluster(base) as cluster:
        cluster.start_coordinator()
        cluster.add_workers(["w1", "w2"])
        env = {**cluster.env, "SMOLFORGE_HOME": str(cluster.state), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "seeds_api.py"), "--teacher", "tiny-llama",
                               "--student", "tiny-llama", "--data", str(data), "--max-samples", "16"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert cluster.token not in " ".join(proc.args)
        yield proc, work


def test_the_seed_script_runs_as_written(run):
    proc, work = run
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "[✓] SEEDS API OK" in proc.stdout, out[-6000:]
    # discover_nodes: the seeds' nested resources beside the flat keys
    assert "w1: 1 CPUs" in out and "0 GPUs" in out and "No GPU nodes detected" in out
    # the output layout the seeds show
    assert sorted(p.name for p in (work / "teacher_outputs").glob("batch_*.json")) == ["batch_0.json", "batch_1.json"]
    for n, method in enumerate(["lora", "lora", "lora", "prefix", "prompt", "prompt", "adapter", "ia3"]):
        assert (work / "output" / f"student_{n}" / f"{method}_adapter").is_dir(), (n, method, out[-3000:])
    assert (work / "merged_model" / "final_adapter" / "adapter_config.json").exists()
    assert len(list((work / "parallel" / "teacher_outputs").glob("batch_*.json"))) >= 2
    # the guide's heavy TaskConfig on a teacher: refused, saying what and where it does apply
    assert "refused: a teacher task cannot honour resources.ram_gb, resources.gpu_memory_gb, priority 'high'" in out
    # Client(): the seeds' resource request no node here has is refused at submit, naming the nodes
    assert "no node here could ever run that request" in out
    for line in ("paused: paused", "cancelled: cancelled"):
        assert line in out, out[-3000:]
