"""Models found while a worker runs (issue 33 item 5): a model copied into a worker's --models-dir after
it joined is advertised and placed on without a re-join by hand.

A cluster of its own (a coordinator and one worker joined with an empty models dir), since the worker
re-registers with Ray when its models change and the session's shared cluster must not see that. The
worker's rescan timer is off (SMOLFORGE_RESCAN_S=0), so what the test sees comes from `worker rescan`.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from localcluster import LocalCluster

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("model-rescan")
    (base / "models-w1").mkdir()
    c = LocalCluster(base)
    c.env["SMOLFORGE_RESCAN_S"] = "0"
    try:
        c.start_coordinator()
        c.add_worker("w1", models_dir=base / "models-w1")
        c.wait_nodes(["coordinator", "w1"])
        yield c
    finally:
        c.close()


def job_spec(c: LocalCluster) -> dict:
    from smolforge.data.synthetic import generate

    data = c.base / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(16, seed=3)))
    train = {"model": "tiny-late", "data": {"path": str(data), "max_eval_samples": 4, "max_length": 32},
             "max_steps": 2, "batch_size": 2, "save_every": 0, "eval_accuracy": False, "log_every": 1,
             "peft": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0}}
    return {"kind": "data_parallel", "num_workers": 1, "max_retries": 0, "train": train}


def wait_model_listed(client, node: str, model: str, timeout: float = 60) -> dict:
    """`node` online with `model` in the coordinator's node table (a bound against a hang only)."""
    deadline = time.time() + timeout
    nodes: list[dict] = []
    while time.time() < deadline:
        nodes = client.list_nodes()
        for n in nodes:
            if n["name"] == node and n["state"] == "online" and model in n["models"]:
                return n
        time.sleep(0.5)
    raise AssertionError(f"{model} not listed on {node} in {timeout}s: "
                         f"{[(n['name'], n['state'], n['models']) for n in nodes]}")


def wait_done(client, job_id: str, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = client.get_job_status(job_id)
        if st["state"] in ("completed", "failed", "cancelled"):
            return st
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not done in {timeout}s: {st}")


def test_a_model_copied_in_after_join_is_placed_on_without_a_rejoin(cluster):
    from smolforge.errors import SmolforgeError
    from smolforge.models.tiny import preset_dir

    c, client = cluster, cluster.client()
    with pytest.raises(SmolforgeError, match="does not hold model tiny-late"):
        client.submit_job(job_spec(c))  # before: no node holds it, refused at once

    shutil.copytree(preset_dir("tiny-llama"), c.base / "models-w1" / "tiny-late")
    r = c.cli("worker", "rescan", "--state-dir", str(c.base / "node-w1"))
    assert r.returncode == 0 and "found model tiny-late; re-registering" in r.stdout, r.stdout + r.stderr
    node = wait_model_listed(client, "w1", "tiny-late")
    assert node["ray_resources"].get("model:tiny-late"), node["ray_resources"]
    c.workers["w1"].wait_for("found model tiny-late; re-registering", 10)

    job_id = client.submit_job(job_spec(c))
    st = wait_done(client, job_id)
    assert st["state"] == "completed", (st["error"], client.job_logs(job_id))
    assert [t["node_name"] for t in st["tasks"] if t["kind"] == "dp_rank"] == ["w1"]

    r = c.cli("worker", "rescan", "--state-dir", str(c.base / "node-w1"))  # nothing new: no re-register
    assert r.returncode == 0 and "no change (1 models)" in r.stdout, r.stdout + r.stderr


def test_model_changes_counts_models_not_their_aliases(tmp_path):
    from smolforge.cluster.nodes.discovery import model_changes

    old = {"same": "/m/same", "moved": "/m/moved", "gone": "/m/gone", "same-alias": "alias:same"}
    new = {"same": "/m/same", "moved": "/x/moved", "b": "/m/b", "b-alias": "alias:b"}
    assert model_changes(old, new) == (["b", "moved"], ["gone"])  # a moved model's new path is advertised
    assert model_changes(new, dict(new)) == ([], [])


def test_the_timer_waits_for_an_idle_node_before_re_registering(tmp_path, monkeypatch):
    """In process: the timer finds a new model while a task holds the node's CPU (says so, keeps the
    node), and re-registers at the first check after the CPU is free."""
    from types import SimpleNamespace

    from smolforge.cluster.nodes import worker
    from smolforge.cluster.nodes.discovery import Inventory
    from smolforge.cluster.nodes.statedir import StateDir

    monkeypatch.setenv(worker.RESCAN_ENV, "0.05")
    monkeypatch.setattr(worker, "POLL_S", 0.01)
    stopped = []
    monkeypatch.setattr(worker.ray_process, "stop", lambda proc, timeout: stopped.append(proc))
    (tmp_path / "models" / "late").mkdir(parents=True)
    (tmp_path / "models" / "late" / "config.json").write_text("{}")
    lines: list[str] = []
    node = worker.WorkerNode(worker.WorkerOptions("127.0.0.1:1", models_dir=str(tmp_path / "models"),
                                                  scan_hf_cache=False), announce=lines.append)
    node.inv, node.proc = Inventory("w1", 1, 1.0), SimpleNamespace(poll=lambda: None)
    free = iter([0.0, 0.0, 1.0])  # busy at two checks, then idle
    monkeypatch.setattr(node, "_nodes", lambda token: [{"name": "w1", "alive": True, "ray_resources": {"CPU": 1.0},
                                                         "available": {"CPU": next(free)}}])
    assert node._watch(StateDir.at(tmp_path / "state")) is None  # None: stopped to re-register
    assert stopped == [node.proc]
    assert lines == ["found model late; this node is busy (1 of 1 CPUs in use): re-registering when it is idle"] * 2 + [
        "found model late; re-registering"], lines


def test_rescan_without_a_running_worker_says_how_to_start_one(tmp_path):
    """No worker.json, or one left by a worker that is gone: one message, before any request is left."""
    import subprocess

    from smolforge.cluster.nodes import worker
    from smolforge.errors import SmolforgeError

    with pytest.raises(SmolforgeError, match="no worker runs with state dir") as err:
        worker.request_rescan(str(tmp_path))
    assert "smolforge worker join" in err.value.render()
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / worker.PID_FILE).write_text(json.dumps({"pid": gone.pid}))
    with pytest.raises(SmolforgeError, match=f"pid {gone.pid}. is gone"):
        worker.request_rescan(str(tmp_path))
    assert not (tmp_path / worker.RESCAN_FILE).exists()
