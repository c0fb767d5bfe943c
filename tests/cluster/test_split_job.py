"""A split job outlives its trunk's node (issue 33, item 2), on the session's shared cluster (coordinator +
w1, w2, every node holding tiny-copy): the coordinator places the trunk on a worker, the client runs on
the coordinator's node (the default, where the uploaded data is), and when the trunk's node is
SIGKILLed the runner places the trunk again on the other worker from the last shared checkpoint; the
client reconnects, rolls back to that checkpoint and completes. `jobs` lists the job all along.

The client holds after step HOLD (fault `hold-step` in the coordinator's node directory) and the test
waits for it to say so (`held`), so the node dies at a known step, after the checkpoint of step
SAVE_EVERY was shipped: the trunk placed again starts from exactly that one. This module kills a
worker: it runs just before test_cluster (tests/workunits.py) and joins the worker again as it ends.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

pytestmark = pytest.mark.timeout(600)

STEPS, SAVE_EVERY, HOLD = 12, 4, 6


def wait_for(client, job_id: str, what: str, done, timeout: float = 300) -> None:
    """Poll until `done(status, events)`: a hang guard, not a timing; the job's timeline if it never comes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st, events = client.get_job_status(job_id), client.job_events(job_id)
        if done(st, events):
            return
        assert st["state"] not in ("failed", "cancelled"), f"{what}: {st['state']} {st.get('error')}\n{timeline(events)}"
        time.sleep(0.5)
    raise AssertionError(f"job {job_id}: no {what} within {timeout} s\n{timeline(client.job_events(job_id))}")


def timeline(events: list[dict]) -> str:
    return "\n".join(f"{e['kind']}: {e['message']}" for e in events)


def of_kind(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


def listed(client, job_id: str) -> str:
    """The job's state as `jobs` (the list every client reads) shows it; it must be there."""
    states = {j["id"]: j["state"] for j in client.list_jobs()}
    assert job_id in states, states
    return states[job_id]


def jobs_command(c):
    """`smolforge jobs` against the coordinator, in this process (typer's runner: no interpreter to start)."""
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    return CliRunner().invoke(app, ["jobs", "--coordinator", c.hostport],
                              env={"SMOLFORGE_COORDINATOR": c.hostport, "SMOLFORGE_TOKEN": c.token, "COLUMNS": "250"})


def split_spec(data) -> dict:
    return {"kind": "split", "name": "split-trunk-loss", "max_retries": 2, "replace_timeout_s": 120,
            "split": {"model": "tiny-copy", "split_point_1": 1, "split_point_2": 3, "dataset": str(data),
                      "max_steps": STEPS, "save_interval": SAVE_EVERY, "batch_size": 4, "max_seq_length": 48,
                      "max_eval_samples": 4, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0, "log_interval": 4,
                      "learning_rate": 5e-3, "seed": 3}}


def test_a_split_job_whose_trunk_node_dies_completes_from_the_last_shared_checkpoint(module_cluster, tmp_path):
    from smolforge.data.synthetic import generate

    c = module_cluster.c
    client = c.client()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(48, seed=3)))
    hold = c.state / "node" / "fault-hold-step"  # the coordinator's node directory: the client's
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.write_text(str(HOLD))
    killed, rejoining = None, False
    try:
        job_id = client.submit_job(split_spec(data))
        assert listed(client, job_id) in ("pending", "running")
        wait_for(client, job_id, "held client", lambda st, ev: of_kind(ev, "held"))
        events = client.job_events(job_id)
        first = of_kind(events, "trunk_placed")[0]["data"]
        assert [e["data"]["step"] for e in of_kind(events, "checkpoint")] == [SAVE_EVERY], timeline(events)
        assert first["node"] in ("w1", "w2") and listed(client, job_id) == "running", first
        killed = first["node"]
        os.kill(first["pid"], signal.SIGKILL)  # the trunk's process (Ray runs it in a session of its own)
        c.kill_worker(killed)  # and the node: its `worker join` process group, raylet and all
        hold.unlink()  # the client goes on: its next call finds no trunk
        wait_for(client, job_id, "trunk lost", lambda st, ev: of_kind(ev, "trunk_lost"))
        assert listed(client, job_id) == "running"
        wait_for(client, job_id, "trunk placed again", lambda st, ev: len(of_kind(ev, "trunk_placed")) == 2)
        assert listed(client, job_id) == "running"
        shown = jobs_command(c)  # the `jobs` command lists it too, while it runs again
        assert shown.exit_code == 0 and job_id in shown.stdout, shown.output
        # whole again for the modules after this one: the node joins again under its name once Ray has
        # it dead (one live node per name), while the job goes on elsewhere
        c.wait_nodes([killed], state="dead", timeout=120)
        c.add_worker(killed, models_dir=module_cluster.models, wait=False)
        rejoining = True
        wait_for(client, job_id, "completion", lambda st, ev: st["state"] == "completed")
    finally:
        hold.unlink(missing_ok=True)
        if killed and not rejoining:  # a failure on the way: the modules after this one need the node
            c.wait_nodes([killed], state="dead", timeout=120)
            c.add_worker(killed, models_dir=module_cluster.models, wait=False)
    assert listed(client, job_id) == "completed"
    st, events = client.get_job_status(job_id), client.job_events(job_id)
    story = timeline(events)
    kinds = [e["kind"] for e in events]
    lost, again = of_kind(events, "trunk_lost")[0], of_kind(events, "trunk_placed")[1]["data"]
    resumed = of_kind(events, "client_resumed")
    assert lost["data"]["node"] == killed and "retry 1 of 2 from checkpoint step-4" in lost["message"], story
    assert again["node"] == ({"w1", "w2"} - {killed}).pop() and again["stored"] == [SAVE_EVERY], story
    assert [e["data"]["step"] for e in resumed] == [SAVE_EVERY], story  # the last shared checkpoint, exactly
    assert kinds.index("held") < kinds.index("trunk_lost") < kinds.index("client_resumed") < kinds.index("recovered")
    assert st["step"] == STEPS and st["result"]["steps"] == STEPS and st["result"]["rollbacks"] == 1, st["result"]
    assert st["result"]["trunk_placements"] == 2 and st["result"]["trunk_moves"] == 1, st["result"]
    rows = {t["id"].split("-", 2)[-1]: (t["node_name"], t["state"]) for t in st["tasks"]}
    assert rows == {"client": ("coordinator", "completed"), "trunk-1": (killed, "failed"),
                    "trunk-2": (again["node"], "completed")}, rows
    assert any(a["kind"] == "adapter" for a in client.list_artifacts(job_id))
    c.workers[killed].wait_for(f"Registered as {killed}", 120)


# soak: a second node death on the shared cluster (about 3 minutes on the 2-core runner, where the CI tier is over
# its budget); the recovery it ends in is the trunk test's (stored checkpoints, the newest shared step), and the
# client's "which node" is proven in the CI tier by the pure test below
@pytest.mark.soak
def test_a_split_job_whose_client_node_dies_completes_from_the_last_shared_checkpoint(module_cluster, tmp_path):
    """The client on w1 (`client_node`), the trunk on w2 (`trunk_nodes`); w1 dies while the client holds after
    step HOLD: the base runner's FailurePolicy starts another attempt, `placement.client_plan` places the
    client on the coordinator's node (w1 was lost), which fetches the client's stored checkpoints as the new
    trunk fetches the trunk's, and both resume from the last shared checkpoint (step SAVE_EVERY)."""
    from smolforge.data.synthetic import generate

    c = module_cluster.c
    c.wait_nodes(["coordinator", "w1", "w2"], timeout=120)  # the test before this one joined its node again
    client = c.client()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(48, seed=3)))
    hold = c.base / "node-w1" / "node" / "fault-hold-step"  # w1's node directory: the client's
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.write_text(str(HOLD))
    spec = {**split_spec(data), "name": "split-client-loss", "client_node": "w1", "trunk_nodes": ["w2"]}
    killed = False
    try:
        job_id = client.submit_job(spec)
        wait_for(client, job_id, "held client", lambda st, ev: of_kind(ev, "held"))
        events = client.job_events(job_id)
        assert [e["data"]["step"] for e in of_kind(events, "checkpoint")] == [SAVE_EVERY], timeline(events)
        rows = {t["id"].split("-", 2)[-1]: t for t in client.get_job_status(job_id)["tasks"]}
        assert rows["client"]["node_name"] == "w1", rows
        os.kill(rows["client"]["pid"], signal.SIGKILL)  # the client's process (Ray runs it in a session of its own)
        c.kill_worker("w1")  # and its node
        killed = True
        wait_for(client, job_id, "client placed again", lambda st, ev: of_kind(ev, "client_placed"))
        assert listed(client, job_id) == "running"
        c.wait_nodes(["w1"], state="dead", timeout=120)
        c.add_worker("w1", models_dir=module_cluster.models, wait=False)  # whole again for the modules after
        killed = False
        wait_for(client, job_id, "completion", lambda st, ev: st["state"] == "completed")
    finally:
        hold.unlink(missing_ok=True)
        if killed:
            c.wait_nodes(["w1"], state="dead", timeout=120)
            c.add_worker("w1", models_dir=module_cluster.models, wait=False)
    st, events = client.get_job_status(job_id), client.job_events(job_id)
    story = timeline(events)
    recovering = of_kind(events, "recovering")
    placed = of_kind(events, "client_placed")[0]["data"]
    assert len(recovering) == 1 and "the client on w1 was lost" in recovering[0]["message"], story
    assert "retry 1 of 2 from checkpoint step-4" in recovering[0]["message"], story
    assert placed == {"node": "coordinator", "stored": ["step-4"]}, story
    assert [e["data"]["node"] for e in of_kind(events, "trunk_placed")] == ["w2", "w2"], story
    assert st["step"] == STEPS and st["result"]["steps"] == STEPS, st["result"]
    assert st["result"]["resumed_from"] == SAVE_EVERY and st["result"]["client_node"] == "coordinator", st["result"]
    rows = {t["id"].split("-", 2)[-1]: (t["node_name"], t["state"]) for t in st["tasks"]}
    assert rows == {"client": ("w1", "failed"), "client-2": ("coordinator", "completed"),
                    "trunk-1": ("w2", "stopped"), "trunk-2": ("w2", "completed")}, rows
    assert any(a["kind"] == "adapter" for a in client.list_artifacts(job_id))
    c.workers["w1"].wait_for("Registered as w1", 120)


def _node(name: str, role: str = "worker", models: tuple[str, ...] = ("org/m",), free: float = 2.0):
    from smolforge.cluster.nodes import ray_glue

    res = {"CPU": 2.0, **({ray_glue.WORKER_RESOURCE: 2.0} if role == "worker" else {}),
           **{ray_glue.model_resource(m): 1000.0 for m in models}}
    return ray_glue.NodeInfo(node_id=f"{name:x<16}", name=name, address="127.0.0.1", alive=True, role=role, cpus=2,
                             gpus=0, ram_gb=8.0, gpu_type=None, models=list(models), resources=res,
                             available={**res, "CPU": free}, labels={ray_glue.NAME_LABEL: name,
                                                                     ray_glue.ROLE_LABEL: role})


def test_the_client_plan_keeps_client_node_until_a_client_is_lost_there_then_the_coordinator_first():
    """`placement.client_plan` (pure: a node table by hand, no cluster): where `client_node` says while no
    client of the job was lost there; after a loss, the coordinator's node when it can run it, else the
    worker with the most free CPUs, never the lost node; no node at all is refused, saying why."""
    from smolforge.cluster.control.placement import COORDINATOR, client_plan
    from smolforge.errors import SmolforgeError

    coord, w1, w2, w3 = _node("coord", "coordinator"), _node("w1"), _node("w2", free=1.0), _node("w3", free=2.0)
    table = [coord, w1, w2, w3]
    plan = client_plan("org/m", "w1", 1.0, False, table, set())
    assert (plan.node, plan.again, plan.req.allowed_nodes) == ("w1", False, ["w1"])
    assert client_plan("org/m", COORDINATOR, 1.0, False, table, set()).req.on_coordinator
    plan = client_plan("org/m", "w1", 1.0, False, table, {w1.node_id})
    assert (plan.node, plan.again, plan.req.on_coordinator) == ("coord", True, True) and "lost on w1" in plan.why
    plan = client_plan("org/m", "w1", 1.0, False, [_node("coord", "coordinator", models=()), w1, w2, w3], {w1.node_id})
    assert (plan.node, plan.req.allowed_nodes) == ("w3", ["w3"])  # the coordinator lacks the model: most free CPUs
    plan = client_plan("org/m", COORDINATOR, 1.0, False, table, {coord.node_id})
    assert plan.node == "w3" and plan.again
    with pytest.raises(SmolforgeError):
        client_plan("org/m", "w1", 1.0, False, [w1], {w1.node_id})
    with pytest.raises(SmolforgeError):  # the named node is gone, no client was lost: refused as before
        client_plan("org/m", "w9", 1.0, False, table, set())
