"""The parameter-server strategies (`ssp`, `sync-ps`, `async-ps`) on a real cluster of processes.

One cluster for the module: a coordinator and three workers (1 CPU each). The server is a Ray actor
on a rank's node; workers are real processes that the tests slow down (fault injection), SIGSTOP,
SIGCONT and SIGKILL, and one test kills the server's whole node. What they assert is what the
policies decided (counted parts, waits, dropped parts, events), never a duration; the fast proofs of
the same policies are in tests/test_ps_inprocess.py, so the jobs here are as short as their claims allow.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
import torch
from safetensors.torch import load_file

from localcluster import LocalCluster

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    base = tmp_path_factory.mktemp("ps")
    models = base / "models"
    shutil.copytree(preset_dir("tiny-llama"), models / "tiny-copy")
    data = base / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(160, seed=7)))
    cluster = LocalCluster(base)
    try:
        cluster.start_coordinator(models_dir=models)
        cluster.add_workers(["w1", "w2", "w3"], models_dir=models)
        cluster.wait_nodes(["coordinator", "w1", "w2", "w3"])
        yield {"c": cluster, "models": models, "data": data, "base": base}
    finally:
        cluster.close()


def spec(w, strategy: str, config: dict | None = None, workers: int = 2, steps: int = 40, **train) -> dict:
    cfg = {"model": "tiny-copy", "data": {"path": str(w["data"]), "max_eval_samples": 8, "max_length": 64},
           "max_steps": steps, "batch_size": 2, "save_every": 0, "eval_accuracy": False, "lr": 1e-3, "seed": 3,
           "log_every": 5, "keep_last": 2, "peft": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0}}
    cfg.update(train)
    return {"kind": "data_parallel", "num_workers": workers, "max_retries": 2, "strategy": strategy,
            "strategy_config": config or {}, "train": cfg}


def wait_state(client, job_id, states, timeout=600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = client.get_job_status(job_id)
        if st["state"] in states:
            return st
        if st["state"] in ("failed", "cancelled"):
            raise AssertionError(f"job {job_id} {st['state']}: {st['error']}\n" + timeline(client, job_id))
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not {states} after {timeout}s: {st}\n" + timeline(client, job_id))


def wait_event(client, job_id, kind, timeout=300) -> dict:
    """The job's first event of `kind` (the bound only turns a hang into a failure)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = next((e for e in client.job_events(job_id) if e["kind"] == kind), None)
        if found:
            return found
        if client.get_job_status(job_id)["state"] not in ("pending", "running"):
            break
        time.sleep(0.2)
    raise AssertionError(f"job {job_id}: no {kind} event\n" + timeline(client, job_id))


def wait_step(client, job_id, step, timeout=300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = client.get_job_status(job_id)
        if (st["step"] or 0) >= step or st["state"] not in ("pending", "running"):
            return st
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not reach step {step}: {st}")


def timeline(client, job_id) -> str:
    return "\n".join(f"{e['ts']:.2f} {e['kind']}: {e['message']}" for e in client.job_events(job_id))


def rank_pid(st: dict, rank: int) -> int:
    return next(t for t in st["tasks"] if t["kind"] == "dp_rank" and t["rank"] == rank and t["state"] == "running")["pid"]


def hold_files(w, step: int) -> list:
    """Every rank that starts on any node holds after `step` (fault `hold-step`, train/faults.py) until
    its file is removed; the files."""
    dirs = [w["c"].state / "node"] + [w["base"] / f"node-{n}" / "node" for n in ("w1", "w2", "w3")]
    files = [d / "fault-hold-step" for d in dirs]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(str(step))
    return files


def adapter(w, job_id) -> dict[str, torch.Tensor]:
    path = w["c"].client().download_adapter(job_id, w["base"] / "downloads" / job_id)
    return load_file(str(path / "adapter_model.safetensors"))


def first_loss(client, job_id) -> float:
    rows = client.job_metrics(job_id, "loss")
    return min(rows, key=lambda r: r["step"])["value"]


# soak: tests/test_ps_inprocess.py proves K = 0 equals one process and the bound's counted waits; the
# strategy's numbers in job show, metrics and /metrics: tests/cluster/test_task_logs.py's ssp job
@pytest.mark.soak
def test_ssp_with_k0_equals_ddp_and_a_slow_worker_stays_within_the_bound(world):
    """K = 0 with three workers: every part computed on the weights of its step, the step applied once
    all parts are in: DDP's weights. K = 2 with w2 slowed (150 ms per sample, about 3x): no staleness
    exceeds 2, no error, and the fast worker waits at the bound (counted) and computes more parts."""
    client = world["c"].client()
    # one job at a time: the three worker nodes take one three-worker job (a second would start degraded)
    ddp = client.submit_job(spec(world, "ddp", workers=3, steps=20))
    ref = wait_state(client, ddp, ("completed",))["result"]
    k0 = client.submit_job(spec(world, "ssp", {"staleness_bound": 0}, workers=3, steps=20))
    res = wait_state(client, k0, ("completed",))["result"]
    assert res["strategy"] == "ssp" and res["steps"] == 20 and res["workers"] == 3, res
    mine, theirs = adapter(world, k0), adapter(world, ddp)
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert res["staleness_max_per_rank"] == [0, 0, 0], res
    assert res["optimizer_state_bytes_per_rank"] == [0, 0, 0] and ref["optimizer_state_bytes_per_rank"][0] > 0
    assert all(b > 0 for b in res["comm_bytes_sent_per_rank"])
    # (its learning is DDP's: the same weights; the K = 2 job below shows ssp learning on its own)

    slow = world["c"].state.parent / "node-w2" / "node" / "fault-sample-delay-s"
    slow.parent.mkdir(parents=True, exist_ok=True)
    slow.write_text("0.15")
    try:
        job = client.submit_job({**spec(world, "ssp", {"staleness_bound": 2}, steps=30), "allowed_nodes": ["w1", "w2"]})
        st = wait_state(client, job, ("completed",))
    finally:
        slow.unlink()
    res = st["result"]
    slow_rank = res["nodes"].index("w2") if "w2" in res["nodes"] else None
    assert slow_rank is not None, res
    fast = 1 - slow_rank
    assert max(res["staleness_max_per_rank"]) <= 2, res
    assert res["parts_done_per_rank"][fast] > res["parts_done_per_rank"][slow_rank], res
    assert sum(res["parts_done_per_rank"]) == 60 and res["steps"] == 30
    assert res["bound_waits_per_rank"][fast] > 0, res  # it waited at the bound for the slow one, never failed
    assert res["final_loss"] < first_loss(client, job)
    # the strategy's numbers are in the job's metrics too (job show, dashboard, Prometheus)
    assert client.job_metrics(job, f"staleness_max.rank{fast}")
    shown = world["c"].cli("job", "show", job)
    assert shown.returncode == 0 and "staleness_max:" in shown.stdout and "parts_done:" in shown.stdout, shown.stdout
    scrape = world["c"].api("GET", "/metrics").text
    samples = [s for fam in text_string_to_metric_families(scrape) for s in fam.samples
               if s.name == "smolforge_job_strategy_metric"]
    assert any(s.labels == {"job": job, "rank": str(fast), "name": "staleness_max"} for s in samples), samples


def test_sync_ps_rides_out_a_stopped_worker_and_a_killed_one(world):
    """Rank 1 is SIGSTOPped until the server has closed steps at their deadline without it and it left
    the barrier as a straggler (the event); then SIGCONT: its late part is dropped and counted, it comes
    back (the event) and contributes again. Then a second job loses rank 1 to SIGKILL and finishes.

    Alone, rank 0 runs a step in ~15 ms: once rank 1 had left the barrier, rank 0 could end the job
    before the SIGCONTed rank 1 asked for work again (CI, 2026-11-30: straggler at step 27, the other 23
    steps in 0.3 s, no `straggler_back`). So every rank holds after step HOLD_AT (fault `hold-step`):
    the job cannot end before rank 1 is back. Rank 1 is continued only once rank 0 is held (the race's
    worst case, every run), and the hold is released on the `straggler_back` event."""
    client = world["c"].client()
    cfg = {"deadline_max_s": 5.0, "deadline_min_s": 0.2}  # straggler_after: 3 deadlines missed in a row
    steps, hold_at = 70, 50
    # rank 1 stopped at step >= 10 misses 3 deadlines well before HOLD_AT; the steps after the hold give
    # rank 1 far more than the 5 contributed parts asked below
    files = hold_files(world, hold_at)
    try:
        job = client.submit_job(spec(world, "sync-ps", cfg, steps=steps))
        st = wait_step(client, job, 10)  # past the first arrivals: the deadline adapts
        pid = rank_pid(st, 1)
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped_at = client.get_job_status(job)["step"] or 0
            assert stopped_at + 3 < hold_at, f"rank 1 stopped at step {stopped_at}: too late to miss 3 deadlines"
            wait_event(client, job, "straggler", timeout=120)
            before = client.get_job_status(job)
            wait_event(client, job, "held", timeout=120)  # rank 0 ran on alone to HOLD_AT: the race's worst case
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_event(client, job, "straggler_back", timeout=120)  # rank 0 is held: the job cannot end first
    finally:
        for f in files:
            f.unlink(missing_ok=True)
    res = wait_state(client, job, ("completed",))["result"]
    kinds = [e["kind"] for e in client.job_events(job)]
    assert "held" in kinds and kinds.index("held") < kinds.index("straggler_back"), timeline(client, job)
    assert res["steps"] == steps, res
    assert res["server"]["closed_at_deadline"] >= 3, res["server"]  # the steps it missed closed without it
    assert res["dropped_per_rank"][1] >= 1 and res["server"]["dropped"]["1"] == res["dropped_per_rank"][1], res
    parts_then = (before["comm"].get("metrics_per_rank") or [{}, {}])[1].get("parts_done", 0)
    assert res["parts_done_per_rank"][1] - res["dropped_per_rank"][1] > parts_then + 5, (res, parts_then)
    assert res["final_loss"] < first_loss(client, job)

    job = client.submit_job(spec(world, "sync-ps", cfg, steps=30))
    st = wait_step(client, job, 10)
    os.kill(rank_pid(st, 1), signal.SIGKILL)
    st = wait_state(client, job, ("completed",))
    kinds = [e["kind"] for e in client.job_events(job)]
    assert "member_left" in kinds and "recovering" not in kinds, timeline(client, job)
    assert st["result"]["steps"] == 30 and st["result"]["workers"] == 1


@pytest.mark.soak  # the CI tier's proof: the in-process test of the same name (tests/test_ps_inprocess.py)
def test_sync_ps_polyak_average_is_the_ema_of_the_raw_weights(world):
    """Every checkpoint holds the server's raw weights and its Polyak average (three workers, one
    checkpoint per step). The average starts at the initial weights and at step k is the EMA carried
    over the raw weights of every step up to k: decay x (the average at k-1) + (1 - decay) x (raw at k).
    The final adapter (final: polyak) is the server's last average, not its raw weights. (Rank 0's
    last periodic checkpoint is at step 10 of 12, its own push travelling with its next claim; the
    in-process test checks the chain through the very last step.)"""
    client = world["c"].client()
    decay = 0.8
    job = client.submit_job(spec(world, "sync-ps", {"polyak_decay": decay, "final": "polyak"}, steps=12,
                                 save_every=1, keep_last=20, workers=3))
    res = wait_state(client, job, ("completed",))["result"]
    assert res["workers"] == 3, res  # and it learns with three (below)
    root = world["c"].state / "artifacts" / job / "checkpoints"
    steps = sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if p.is_dir())
    raw = {s: load_file(str(root / f"step-{s}" / "trainable.safetensors")) for s in steps}
    ema = {s: torch.load(root / f"step-{s}" / "optim.pt", weights_only=True)["strategy"]["ema"] for s in steps}
    unbroken = 0
    while unbroken + 1 in raw:
        unbroken += 1
    assert steps[0] == 0 and unbroken >= 8 and max(steps) == 12, str(steps)
    want = dict(raw[0])  # the initial weights
    for s in range(unbroken + 1):
        if s:
            want = {k: decay * want[k] + (1 - decay) * raw[s][k] for k in want}
        for k in want:
            torch.testing.assert_close(ema[s][k], want[k], atol=1e-6, rtol=1e-5, msg=lambda m: f"step {s}, {k}: {m}")
    final, last = adapter(world, job), max(steps)
    assert set(final) == {k.replace(".default", "") for k in ema[last]}, (sorted(final), sorted(ema[last]))
    for k in ema[last]:
        torch.testing.assert_close(final[k.replace(".default", "")], ema[last][k], atol=0, rtol=0,
                                   msg=lambda m: f"{k}: {m}")
    assert any(not torch.allclose(ema[last][k], raw[last][k]) for k in raw[last])  # the average, not the raw
    assert res["final_loss"] < first_loss(client, job)


# soak: what a worker sends is the codec's payload (ps_worker counts `payload_bytes` of it), int8 about a quarter
# of fp32: tests/test_codecs.py::test_a_blockwise_codec_sends_what_it_claims; async-ps with int8 applies every part
# and learns: tests/test_ps_inprocess.py::test_async_ps_applies_every_part_and_learns
@pytest.mark.soak  # the same claim in CI: tests/test_codecs.py::test_a_blockwise_codec_sends_what_it_claims + tests/test_ps_inprocess.py
def test_async_ps_int8_sends_a_quarter_of_fp32s_bytes_and_both_learn(world):
    client = world["c"].client()
    fp32 = client.submit_job(spec(world, "async-ps", {"codec": "fp32"}, steps=30))
    a = wait_state(client, fp32, ("completed",))["result"]  # one at a time: two at once may start degraded
    int8 = client.submit_job(spec(world, "async-ps", {"codec": "int8"}, steps=30))
    b = wait_state(client, int8, ("completed",))["result"]
    assert a["workers"] == b["workers"] == 2, (a, b)
    per_push = lambda r: sum(r["comm_bytes_sent_per_rank"]) / sum(r["parts_done_per_rank"])  # noqa: E731
    assert per_push(b) <= 0.30 * per_push(a), (per_push(b), per_push(a))
    assert sum(a["parts_done_per_rank"]) == sum(b["parts_done_per_rank"]) == 60
    assert b["final_loss"] < first_loss(client, int8) and a["final_loss"] < first_loss(client, fp32)


def test_async_ps_with_sparse_loses_a_worker_without_a_pause(world):
    """async-ps with the sparse codec both ways (issue 45): each push is the codec's bytes, pulls are deltas
    through it (`ps_pull.py`), far below fp32, counted on the worker and the server; rank 1 is SIGKILLed at
    step 10 and the job goes on without a pause, and learns (lr 1e-2: the in-process runs' rate for sparse)."""
    from smolforge.parallel.codecs import make_codec

    client = world["c"].client()
    job = client.submit_job(spec(world, "async-ps", {"codec": "sparse"}, steps=60, lr=1e-2))
    st = wait_step(client, job, 10)
    os.kill(rank_pid(st, 1), signal.SIGKILL)
    st = wait_state(client, job, ("completed",))
    res = st["result"]
    kinds = [e["kind"] for e in client.job_events(job)]
    assert "member_left" in kinds and "recovering" not in kinds, timeline(client, job)
    assert res["steps"] == 60 and res["workers"] == 1, res
    assert res["claim_waits_per_rank"][0] == 0, res  # async-ps never made rank 0 wait, not for the dead one either
    numel, parts, pulls = res["trainable_params"], res["parts_done_per_rank"][0], res["pulls_per_rank"][0]
    assert res["comm_bytes_sent_per_rank"][0] == parts * make_codec("sparse").nbytes(numel), res
    server = res["server"]
    assert server["pull_deltas"] > 0 and server["pull_bytes"] >= res["bytes_pulled_per_rank"][0] > 0, server
    # its pulls: a keyframe to start, the final weights whole, deltas between (each a few % of fp32)
    assert res["bytes_pulled_per_rank"][0] < 0.25 * pulls * 4 * numel, (res, server)
    assert res["final_loss"] < 0.8 * first_loss(client, job), res["final_loss"]


def test_async_ps_takes_in_a_joiner_from_the_current_weights(world):
    """The coordinator is lent to a running async-ps job: it is placed at once as member 2, pulls the
    server's current weights and takes parts like the others, with no restart. The two members are
    slowed (0.3 s per sample) so the job outlasts the joiner's start on a slow machine: unslowed, a
    loaded CI machine once finished all 200 steps before the joiner had computed a part."""
    c, client = world["c"], world["c"].client()
    delays = [c.state.parent / f"node-{n}" / "node" / "fault-sample-delay-s" for n in ("w1", "w2")]
    for f in delays:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("0.3")
    try:
        job = client.submit_job({**spec(world, "async-ps", {}, steps=100), "allowed_nodes": ["w1", "w2"]})
        wait_step(client, job, 3)
    finally:
        for f in delays:  # read once, when a rank starts: the running ranks keep their delay
            f.unlink(missing_ok=True)
    client.join_job(job)
    st = wait_state(client, job, ("completed",))
    res = st["result"]
    kinds = [e["kind"] for e in client.job_events(job)]
    assert "member_joining" in kinds and "recovering" not in kinds, timeline(client, job)
    assert len([t for t in st["tasks"] if t["kind"] == "dp_group"]) == 1
    assert res["workers"] == 3 and "coordinator" in res["nodes"], res
    joiner = res["nodes"].index("coordinator")
    assert res["parts_done_per_rank"][joiner] > 0 and res["pulls_per_rank"][joiner] > 0, res
    assert sum(res["parts_done_per_rank"]) == 200, res


@pytest.mark.soak  # the CI tier's proof of `job leave`: tests/cluster/test_cluster.py (ddp, and diloco's members)
def test_async_ps_lets_a_lent_worker_leave_at_its_next_step(world):
    """The coordinator, lent to a running async-ps job (member 2), is given back with `leave_job` once it
    has started: it leaves after its next step, the server hands its unfinished parts to the others as
    it does for a lost member, and the job completes on its two workers with no restart. Every member is
    slowed (0.3 s per sample) so the job outlasts the joiner's start and the leave on a slow machine."""
    c, client = world["c"], world["c"].client()
    delays = [c.state.parent / f"node-{n}" / "node" / "fault-sample-delay-s" for n in ("w1", "w2")]
    delays.append(c.state / "node" / "fault-sample-delay-s")
    for f in delays:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("0.3")
    try:
        job = client.submit_job({**spec(world, "async-ps", {}, steps=100), "allowed_nodes": ["w1", "w2"]})
        wait_step(client, job, 3)
        client.join_job(job)
        deadline = time.time() + 300  # the joiner says it started (it trains from then on)
        while not any(e["kind"] == "rank_started" and "coordinator" in e["message"] for e in client.job_events(job)):
            assert time.time() < deadline, timeline(client, job)
            time.sleep(0.3)
    finally:
        for f in delays:  # read once, when a rank starts: the running ranks keep their delay
            f.unlink(missing_ok=True)
    client.leave_job(job)
    st = wait_state(client, job, ("completed",))
    events = client.job_events(job)
    kinds = [e["kind"] for e in events]
    left = [e["data"] for e in events if e["kind"] == "member_left"]
    assert len(left) == 1 and isinstance(left[0].pop("step"), int), timeline(client, job)
    assert left == [{"node": "@coordinator", "boundary": "step", "rank": 2, "node_name": "coordinator"}], left
    assert "recovering" not in kinds and "worker_failed" not in kinds and not st["attempts"], timeline(client, job)
    assert len([t for t in st["tasks"] if t["kind"] == "dp_group"]) == 1  # no restart
    res = st["result"]
    assert res["steps"] == 100 and res["workers"] == 2 and "coordinator" not in res["nodes"], res


def test_the_servers_node_killed_the_job_resumes_from_its_checkpoint_elsewhere(world):
    """Three workers; the server sits with rank 2. Its whole node is SIGKILLed mid-job: the round fails,
    and the job resumes from the last checkpoint (which holds the server's state) with a new server on
    another node, and completes. Every rank is held after step HOLD (fault `hold-step`) until the node
    is killed, so the kill lands mid-job at a known step, after a checkpoint, however fast the steps go
    (a run made long enough to outlast the kill took 80 steps, 60 of them after the restart)."""
    c, client = world["c"], world["c"].client()
    hold = 12  # a checkpoint every 5 steps: 5 and 10 are kept before the kill
    files = [c.state.parent / f"node-{n}" / "node" / "fault-hold-step" for n in ("w1", "w2", "w3")]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(str(hold))
    try:
        job = client.submit_job(spec(world, "async-ps", {}, workers=3, steps=30, save_every=5))
        deadline = time.time() + 300  # a hang guard only
        while len(held := [e for e in client.job_events(job) if e["kind"] == "held"]) < 3 or not any(
                e["kind"] == "checkpoint" for e in client.job_events(job)):
            assert time.time() < deadline and client.get_job_status(job)["state"] in ("pending", "running"), \
                timeline(client, job)
            time.sleep(0.3)
        st = client.get_job_status(job)
        ps = next(t for t in st["tasks"] if t["kind"] == "param_server")
        c.kill_worker(ps["node_name"])
    finally:
        for f in files:  # the ranks left go on (to the dead server); the restarted ones are never held
            f.unlink(missing_ok=True)
    assert sorted(e["data"]["rank"] for e in held) == [0, 1, 2] and st["step"] < 30, (held, st["step"])
    st = wait_state(client, job, ("completed",), timeout=600)
    kinds = [e["kind"] for e in client.job_events(job)]
    assert "recovered" in kinds, timeline(client, job)
    servers = [t for t in st["tasks"] if t["kind"] == "param_server"]
    assert len(servers) == 2 and servers[-1]["node_name"] != ps["node_name"], servers
    recovered = next(e for e in client.job_events(job) if e["kind"] == "recovered")
    assert "checkpoints" in recovered["message"] or "step-" in recovered["message"], recovered
    assert st["result"]["steps"] == 30
    assert st["result"]["final_loss"] < first_loss(client, job)  # it learned (three workers, then the two left)
