"""Issue 28's bounded load test (soak tier, loopback only): 200 authenticated chat requests against a real
`smolforge serve`, alone and then with 50 hostile requests beside them (ten 1 MB prompts among them),
twice. Every normal request is answered 200, every hostile one gets its 4xx, the engine never
restarts; printed: p50/p99 of the normal requests per round and the server's RSS after each round.
The goal (issue 28): p99 with the hostile requests within 1.5x of p99 without, RSS flat across the
two mixed rounds."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import tree_rss_mb
from servehelpers import hostile_bodies, start_server

pytestmark = [pytest.mark.soak, pytest.mark.timeout(1800)]

NORMAL = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16,
          "temperature": 0}
NORMAL_CALLS, NORMAL_THREADS, HOSTILE_CALLS, HOSTILE_THREADS = 200, 8, 50, 4


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def round_of(srv, hostile: bool) -> dict:
    """One round: the normal requests (and the hostile ones, started together); latencies and statuses."""
    auth = {"Authorization": f"Bearer {srv.token}", "Content-Type": "application/json"}
    bodies = [h for h in hostile_bodies(mb_prompt=False)]
    big = [h for h in hostile_bodies() if h.code == "context_length_exceeded"]
    plan = (big * 10 + bodies * 3)[:HOSTILE_CALLS] if hostile else []
    latencies, statuses, refusals = [], [], []
    lock = threading.Lock()
    local = threading.local()

    def client() -> httpx.Client:
        if not hasattr(local, "c"):
            local.c = httpx.Client(base_url=srv.base, timeout=120)
        return local.c

    def normal(_: int) -> None:
        t = time.perf_counter()
        r = client().post("/v1/chat/completions", json=NORMAL, headers=auth)
        with lock:
            latencies.append(time.perf_counter() - t)
            statuses.append(r.status_code)

    def bad(i: int) -> None:
        h = plan[i]
        r = client().post(h.path, content=h.body, headers=auth if h.auth else {"Content-Type": "application/json"})
        with lock:
            refusals.append((h.name, r.status_code, h.status))

    with ThreadPoolExecutor(NORMAL_THREADS) as normals, ThreadPoolExecutor(HOSTILE_THREADS) as hostiles:
        waits = [hostiles.submit(bad, i) for i in range(len(plan))] + [normals.submit(normal, i)
                                                                       for i in range(NORMAL_CALLS)]
        for w in waits:
            w.result()
    return {"p50": pct(latencies, 0.5), "p99": pct(latencies, 0.99), "statuses": statuses, "refusals": refusals,
            "rss_mb": tree_rss_mb(srv.proc.pid)}


def test_normal_requests_beside_hostile_ones(model_copy, tmp_path):
    srv = start_server(tmp_path, model_copy)
    try:
        round_of(srv, hostile=False)  # warm: first batches, allocator, tokenizer caches
        alone = round_of(srv, hostile=False)
        mixed = [round_of(srv, hostile=True) for _ in range(2)]
        health = httpx.get(f"{srv.base}/health", timeout=60).json()
    finally:
        srv.proc.terminate()
        srv.proc.wait(timeout=30)
    for name, r in [("alone", alone), ("mixed 1", mixed[0]), ("mixed 2", mixed[1])]:
        print(f"\n{name}: p50 {r['p50']:.2f} s, p99 {r['p99']:.2f} s, RSS {r['rss_mb']:.0f} MB")
    print(f"p99 mixed/alone: {mixed[0]['p99'] / alone['p99']:.2f}, {mixed[1]['p99'] / alone['p99']:.2f}; "
          f"RSS growth between the mixed rounds: {mixed[1]['rss_mb'] - mixed[0]['rss_mb']:+.0f} MB")
    for r in [alone, *mixed]:
        assert r["statuses"] == [200] * NORMAL_CALLS
    wrong = [x for r in mixed for x in r["refusals"] if x[1] != x[2]]
    assert not wrong and all(len(r["refusals"]) == HOSTILE_CALLS for r in mixed), wrong
    assert health["ok"] and health["restarts"] == 0
    assert mixed[1]["rss_mb"] - mixed[0]["rss_mb"] < 50  # flat: the second mixed round keeps nothing more
