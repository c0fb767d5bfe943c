"""Issue 28's bounded load test of the coordinator (soak tier, loopback only), the half beside
`tests/serve/test_load.py`: a real coordinator and one worker, a data-parallel job held at a known
step (fault `hold-step`) so it is running through the whole load, then 200 authenticated API calls
(the job list, the job, its events, the nodes, /metrics, the status) from a few client threads, alone
and then with 50 hostile requests beside them (the review's findings, `test_coordinator_fuzz.HOSTILE`),
twice. Every normal call is answered 200, every hostile one gets a 4xx, none a 5xx; the job is still
held at its step when the load ends and completes once released; the coordinator's RSS stays flat
between the two mixed rounds (a leak guard with a generous bound).

Printed, not asserted (a speed claim, see BENCHMARKS.md): p50/p99 of the normal calls alone and
mixed, and the coordinator's RSS after each round. The goal (issue 28): p99 mixed within 1.5x of p99
alone, RSS flat across the two mixed rounds."""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import rss_mb
from localcluster import LocalCluster
from test_cluster import SHORT, hold, job_spec, release, submit_held, wait_state
from test_coordinator_fuzz import HOSTILE

pytestmark = [pytest.mark.soak, pytest.mark.timeout(1200)]

HELD_AT = 4  # the job's rank holds after this step for the whole load (the hold ends by itself after 300 s)
NORMAL_CALLS, NORMAL_THREADS, HOSTILE_CALLS, HOSTILE_THREADS = 200, 4, 50, 2
RSS_GROWTH_MB = 50  # between the two mixed rounds: the second may keep nothing the first did not


@pytest.fixture
def world(tmp_path):
    """A coordinator and worker w1 (1 CPU each, both hold `tiny-copy`), as `test_cluster.world`."""
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    models = tmp_path / "models"
    shutil.copytree(preset_dir("tiny-llama"), models / "tiny-copy")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(160, seed=7)))
    with LocalCluster(tmp_path) as cluster:
        cluster.start_coordinator(models_dir=models)
        cluster.add_worker("w1", models_dir=models)
        cluster.wait_nodes(["coordinator", "w1"])
        yield {"c": cluster, "data": data, "base": tmp_path}  # what `test_cluster` helpers read


def normal_paths(job: str) -> list[str]:
    """What a dashboard or `smolforge status` asks while a job runs."""
    return ["/api/v1/jobs", f"/api/v1/jobs/{job}", f"/api/v1/jobs/{job}/events", "/api/v1/nodes", "/metrics",
            "/api/v1/status"]


def hostile_plan(job: str) -> list[tuple[str, str, bytes | None]]:
    """HOSTILE_CALLS requests from the fuzz test's list, aimed at the running job where they name one."""
    reqs = [(m, p.replace("fuzz-running", job).replace("fuzz-done", job), body) for m, p, body, _ in HOSTILE]
    return (reqs * (HOSTILE_CALLS // len(reqs) + 1))[:HOSTILE_CALLS]


def round_of(cluster: LocalCluster, job: str, hostile: bool) -> dict:
    """One round: the normal calls (with the hostile ones started beside them); latencies, statuses
    and the coordinator's RSS afterwards. Each thread keeps one connection for the round."""
    headers = {"Authorization": f"Bearer {cluster.token}", "Content-Type": "application/json"}
    paths, plan = normal_paths(job), hostile_plan(job) if hostile else []
    latencies, normals, refusals = [], [], []
    lock, local, clients = threading.Lock(), threading.local(), []

    def client() -> httpx.Client:
        if not hasattr(local, "c"):
            local.c = httpx.Client(base_url=f"http://{cluster.hostport}", headers=headers, timeout=60)
            with lock:
                clients.append(local.c)
        return local.c

    def normal(i: int) -> None:
        t = time.perf_counter()
        r = client().get(paths[i % len(paths)])
        with lock:
            latencies.append(time.perf_counter() - t)
            normals.append((paths[i % len(paths)], r.status_code))

    def bad(i: int) -> None:
        method, path, body = plan[i]
        r = client().request(method, path, content=body)
        with lock:
            refusals.append((method, path[:80], r.status_code))

    try:
        with ThreadPoolExecutor(NORMAL_THREADS) as ok, ThreadPoolExecutor(HOSTILE_THREADS) as evil:
            waits = [evil.submit(bad, i) for i in range(len(plan))] + [ok.submit(normal, i)
                                                                       for i in range(NORMAL_CALLS)]
            for w in waits:
                w.result()
    finally:
        for c in clients:
            c.close()
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"p50": cuts[49], "p99": cuts[98], "normals": normals, "refusals": refusals,
            "rss_mb": rss_mb(cluster.coordinator.p.pid)}


def test_api_calls_beside_hostile_ones_during_a_running_job(world):
    cluster, client = world["c"], world["c"].client()
    files = hold(world, HELD_AT, nodes=("coordinator", "w1"))  # wherever the rank is placed
    try:
        job = submit_held(world, job_spec(world, num_workers=1, max_steps=SHORT), HELD_AT, ranks=1)
        round_of(cluster, job, hostile=False)  # warm: connections, the first renders of /metrics
        alone = round_of(cluster, job, hostile=False)
        mixed = [round_of(cluster, job, hostile=True) for _ in range(2)]
        during = client.get_job_status(job)
        went_on = [x["line"] for x in client.task_logs(job) if "goes on after step" in x["line"]]
    finally:
        release(files)
    final = wait_state(client, job, ("completed",))
    after = [x["line"] for x in client.task_logs(job) if "goes on after step" in x["line"]]
    for name, r in [("alone", alone), ("mixed 1", mixed[0]), ("mixed 2", mixed[1])]:
        print(f"\n{name}: p50 {r['p50'] * 1000:.1f} ms, p99 {r['p99'] * 1000:.1f} ms, RSS {r['rss_mb']:.0f} MB")
    print(f"p99 mixed/alone: {mixed[0]['p99'] / alone['p99']:.2f}, {mixed[1]['p99'] / alone['p99']:.2f}; "
          f"RSS growth between the mixed rounds: {mixed[1]['rss_mb'] - mixed[0]['rss_mb']:+.0f} MB")
    for r in [alone, *mixed]:
        wrong = [x for x in r["normals"] if x[1] != 200]
        assert not wrong and len(r["normals"]) == NORMAL_CALLS, wrong[:10]
    refusals = [x for r in mixed for x in r["refusals"]]
    assert len(refusals) == 2 * HOSTILE_CALLS and all(400 <= x[2] < 500 for x in refusals), \
        [x for x in refusals if not 400 <= x[2] < 500]
    assert during["state"] == "running" and during["step"] == HELD_AT and not went_on, (during, went_on)
    assert final["state"] == "completed" and final["step"] == SHORT, final
    assert len(after) == 1 and after[0].rstrip().endswith("released"), after  # by us: not a joiner, not the time limit
    growth = mixed[1]["rss_mb"] - mixed[0]["rss_mb"]
    assert growth < RSS_GROWTH_MB, f"the coordinator's RSS grew by {growth:.0f} MB in the second mixed round"
