"""Jobs that queue and run side by side, on a real cluster: the session's shared one (tests/conftest.py
`shared_cluster`; the module had a cluster of its own, ~30 s of the CI tier's time).

coordinator (no work) + w1, w2 (1 CPU and 4 GB of reservable RAM each). The queue's jobs take a
whole worker each (1 CPU); the RAM reservation's take half a CPU and 3 GB, so two would fit one worker
by CPUs but not by RAM. Every job is a one-worker tiny-llama LoRA run of a few steps on bundled data.
"""

from __future__ import annotations

import time

import pytest
import yaml

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(module_cluster):
    """The session's shared cluster (coordinator + w1, w2 of 1 CPU each), whole and idle."""
    return module_cluster.c


def spec(steps: int, nodes: list[str], cpus: float = 1, **extra) -> dict:
    return {"kind": "data_parallel", "num_workers": 1, "allowed_nodes": nodes, "max_retries": 0, "cpus_per_worker": cpus,
            "train": {"model": "tiny-llama", "max_steps": steps, "batch_size": 2, "save_every": 0, "log_every": 5,
                      "eval_accuracy": False, "lr": 1e-3,
                      "data": {"path": "bundled", "max_samples": 32, "max_eval_samples": 4, "max_length": 48}},
            **extra}


def wait_for(what, check, timeout=240.0, every=0.3):
    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"{what}: not after {timeout}s")
        time.sleep(every)


def job(client, job_id) -> dict:
    j = client.get_job(job_id)
    assert j["state"] not in ("failed", "cancelled"), (job_id, j["state"], j["error"], client.job_logs(job_id)[-15:])
    return j


def first_event(client, job_id, kind) -> int:
    return next(e["id"] for e in client.job_events(job_id) if e["kind"] == kind)


def test_two_jobs_side_by_side_a_third_waits_and_a_high_one_overtakes(cluster):
    """A and B run at once on w1 and w2; C (normal) and then H (high, through `smolforge submit
    --priority high`) wait as pending with a reason naming the busy workers. A ends first: H, though
    submitted after C, takes its worker; C runs once B ends. Every job completes."""
    client = cluster.client()
    a = client.submit_job(spec(4, ["w1", "w2"], name="a"))
    b = client.submit_job(spec(30, ["w1", "w2"], name="b"))
    c = client.submit_job(spec(2, ["w1", "w2"], name="c"))
    job_file = cluster.base / "h.yaml"
    job_file.write_text(yaml.safe_dump(spec(2, ["w1", "w2"], name="h")))
    r = cluster.cli("submit", str(job_file), "--priority", "high")
    assert r.returncode == 0, r.stderr
    h = r.stdout.strip().splitlines()[-1]
    assert client.get_job(h)["spec"]["priority"] == "high"

    # A and B run side by side, on disjoint workers
    running = wait_for("a and b running on their workers", lambda: all(
        job(client, j)["state"] == "running" and job(client, j)["nodes"] for j in (a, b)) and
        [job(client, j) for j in (a, b)])
    assert sorted(x["nodes"][0] for x in running) == ["w1", "w2"]
    where = {x["id"]: x["nodes"][0] for x in running}

    # C and H wait, saying for what: both workers, each busy with its job
    for waiting in (c, h):
        expected = (f"waiting for 1 worker with 1 CPU: ", f"{where[a]} busy with {a}", f"{where[b]} busy with {b}")
        st = wait_for(f"{waiting} waiting for the busy workers", lambda: (
            lambda j: j if j["state"] == "pending" and all(x in (j["pending_reason"] or "") for x in expected)
            else None)(job(client, waiting)), timeout=60)
        assert st["pending_reason"].startswith(expected[0]), st["pending_reason"]
    assert client.get_job_status(c)["pending_reason"] == client.get_job(c)["pending_reason"]
    shown = cluster.cli("job", "show", c)
    assert shown.returncode == 0 and "pending" in shown.stdout and "waiting for" in shown.stdout, shown.stdout
    assert "pending" in cluster.cli("jobs").stdout

    # A ends first: H (high) takes its worker while C (normal, submitted earlier) still waits for B
    wait_for("a completed", lambda: job(client, a)["state"] == "completed")
    st = wait_for("h running", lambda: (lambda j: j if j["state"] in ("running", "completed") else None)(job(client, h)))
    if job(client, b)["state"] == "running":  # B is still on its worker: C waits behind H
        assert job(client, c)["state"] == "pending"
    for j in (b, c, h):
        wait_for(f"{j} completed", lambda: job(client, j)["state"] == "completed")
    assert first_event(client, h, "dequeued") < first_event(client, c, "dequeued")  # overtaken in the queue
    assert job(client, h)["started"] < job(client, c)["started"]
    # the fresh jobs never started on fewer workers than asked
    assert not any(e["kind"] == "degraded" for j in (a, b, c, h) for e in client.job_events(j))


def test_a_ram_reservation_keeps_two_jobs_off_one_node(cluster):
    """w1 has 1 CPU and 4 GB to reserve: two half-CPU jobs of 3 GB each never share it; the second
    waits, saying it is short of RAM there, not of CPUs, and runs once the first is done."""
    client = cluster.client()
    # ram-1 holds after its step 2 (fault injection: a file in w1's node directory) until the test has
    # seen ram-2 wait: a short job on a fast machine was done before the test looked (a CI flake)
    hold = cluster.base / "node-w1" / "node" / "fault-hold-step"
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.write_text("2")
    try:
        first = client.submit_job(spec(6, ["w1"], cpus=0.5, name="ram-1", resources={"ram_gb": 3}))
        second = client.submit_job(spec(2, ["w1"], cpus=0.5, name="ram-2", resources={"ram_gb": 3}))
        wait_for("ram-1 held", lambda: any(e["kind"] == "held" for e in client.job_events(first)))
        expected = f"waiting for 1 worker with 0.5 CPUs, 3 GB RAM: w1 busy with {first} (1 GB RAM free)"
        st = wait_for("ram-2 waiting for RAM", lambda: (lambda j: j if j["pending_reason"] == expected
                                                        else None)(job(client, second)))
        assert st["state"] == "pending", st
        assert st["spec"]["min_ram_gb"] == 3
    finally:
        hold.unlink(missing_ok=True)
    wait_for("both completed", lambda: all(job(client, j)["state"] == "completed" for j in (first, second)))
    one, two = job(client, first), job(client, second)
    assert two["started"] >= one["finished"] and one["nodes"] == two["nodes"] == ["w1"]


# soak: the capacity check is JobManager.check_capacity, its RAM message proven in process by
# test_queue_units.py::test_no_node_could_ever_hold_it_fails_at_submit_listing_nodes, and its refusal through the
# API at submit on a real cluster by test_cluster.py::test_unsatisfiable_requirement_fails_at_once
@pytest.mark.soak  # the same claim in CI: tests/cluster/test_cluster.py::test_unsatisfiable_requirement_fails_at_once + test_queue_units.py
def test_a_request_no_node_can_ever_meet_fails_at_submit(cluster):
    from smolforge.errors import SmolforgeError

    with pytest.raises(SmolforgeError) as err:
        cluster.client().submit_job({"model": "tiny-llama", "dataset": "bundled", "num_workers": 1,
                                     "resources": {"ram_gb": 64, "cpu_cores": 1}})
    text = err.value.render()
    assert "no node can run this task" in text and "< 64 GB" in text
    assert all(f"  - {n} [" in text for n in ("w1", "w2")), text
