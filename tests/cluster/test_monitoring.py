"""Monitoring of a real data-parallel job: TensorBoard per rank, W&B offline per rank, the job store's
per-rank series, and a real Prometheus server scraping the coordinator with (and without) the token.

One short 2-rank job for the whole module, on the session's shared cluster (tests/conftest.py
`shared_cluster`: a coordinator that takes no training work, workers w1 and w2 of 1 CPU each, so one
rank on each; it had a cluster of its own, ~30 s of the CI tier's time). Prometheus (Debian's `prometheus` package, installed by .ci/run) runs as our
own child process on a free loopback port with its storage in tmp; only that process is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import require
from localcluster import LocalCluster, free_port

pytestmark = pytest.mark.timeout(600)

PROMETHEUS = Path("/usr/bin/prometheus")
STEPS = 40
HOLD = 20  # the ranks hold after this step until Prometheus has seen them
LR = 2e-3


def _wait(what: str, check, timeout: float, every: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"{what} not seen within {timeout} s")


def _start_prometheus(base: Path, cluster: LocalCluster) -> tuple[subprocess.Popen, int]:
    """A Prometheus with two scrape jobs on the coordinator: with the token (from a file, as
    deploy/prometheus/prometheus.yml shows) and without it."""
    token_file = base / "prom-token"
    token_file.write_text(cluster.token)
    token_file.chmod(0o600)
    port = free_port()
    config = base / "prometheus.yml"
    config.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: smolforge
    metrics_path: /metrics
    honor_labels: true
    authorization:
      type: Bearer
      credentials_file: {token_file}
    static_configs:
      - targets: ["{cluster.hostport}"]
  - job_name: smolforge-no-token
    metrics_path: /metrics
    static_configs:
      - targets: ["{cluster.hostport}"]
""")
    proc = subprocess.Popen([str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={base / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=open(base / "prometheus.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    _wait("Prometheus ready", lambda: _ready(port, proc), 60)
    return proc, port


def _ready(port: int, proc: subprocess.Popen) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"prometheus exited with {proc.returncode}")
    try:
        return httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _query(port: int, promql: str) -> list[dict]:
    r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": promql}, timeout=5)
    r.raise_for_status()
    return r.json()["data"]["result"]


def _not_failed(client, job_id: str) -> bool:
    st = client.get_job_status(job_id)
    if st["state"] == "failed":
        pytest.fail(str(st["error"]))
    return True


@pytest.fixture(scope="module")
def world(module_cluster):
    cluster = module_cluster.c
    base = module_cluster.base / "monitor"
    base.mkdir()
    prom = None
    # Both ranks hold after step HOLD (fault `hold-step`, smolforge.train.faults) until Prometheus has
    # scraped the job's loss and each rank's: the job is surely running then, on any machine.
    holds = [cluster.base / f"node-{w}" / "node" / "fault-hold-step" for w in ("w1", "w2")]
    try:
        prom_port = None
        if PROMETHEUS.exists():
            prom, prom_port = _start_prometheus(base, cluster)
        client = cluster.client()
        train = {"model": "tiny-llama", "data": {"path": "bundled", "max_samples": 32, "max_eval_samples": 4},
                 "max_steps": STEPS, "batch_size": 2, "lr": LR, "save_every": 0, "eval_accuracy": False,
                 "tensorboard": True, "wandb": "smolforge-test"}
        for hold in holds:
            hold.parent.mkdir(parents=True, exist_ok=True)
            hold.write_text(str(HOLD))
        job_id = client.submit_job({"kind": "data_parallel", "num_workers": 2, "cpus_per_worker": 1,
                                    "max_retries": 0, "train": train})
        seen_running: list[dict] = []
        try:
            if prom_port:  # while the job runs: the loss through Prometheus, then each rank's
                seen_running = _wait("the job's loss in Prometheus", lambda: _query(
                    prom_port, f'smolforge_job_loss{{job="{job_id}"}}') if _not_failed(client, job_id) else [],
                    300, every=1.0)
                ranks_running = _wait("both ranks' loss in Prometheus", lambda: r if len(r := _query(
                    prom_port, f'smolforge_rank_loss{{job="{job_id}"}}')) == 2 else [], 300, every=1.0)
        finally:
            for hold in holds:  # the shared cluster's next modules must not hold
                hold.unlink(missing_ok=True)
        st = _wait("job completed", lambda: (s := client.get_job_status(job_id))["state"] in
                   ("completed", "failed", "cancelled") and s, 300)
        assert st["state"] == "completed", st
        nodes = {t["rank"]: t["node_name"] for t in st["tasks"] if t["kind"] == "dp_rank"}
        yield {"c": cluster, "client": client, "job": job_id, "status": st, "prom_port": prom_port,
               "prom_loss": seen_running, "prom_ranks": ranks_running if prom_port else [],
               "runs": cluster.state / "runs" / job_id, "nodes": nodes}
    finally:
        for hold in holds:
            hold.unlink(missing_ok=True)
        if prom is not None:  # only the process this test started
            os.killpg(prom.pid, signal.SIGTERM)
            try:
                prom.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(prom.pid, signal.SIGKILL)
                prom.wait(timeout=10)


def test_store_has_job_and_per_rank_series(world):
    names = {m["name"] for m in world["client"].job_metrics(world["job"])}
    for name in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert {name, f"{name}.rank0", f"{name}.rank1"} <= names, names
    rank1 = world["client"].job_metrics(world["job"], "loss.rank1")
    assert [m["step"] for m in rank1] == list(range(1, STEPS + 1))


def test_tensorboard_run_dir_per_rank(world):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for rank in (0, 1):
        acc = EventAccumulator(str(world["runs"] / "tensorboard" / f"rank{rank}"))
        acc.Reload()
        losses = acc.Scalars("train/loss")
        assert [e.step for e in losses] == list(range(1, STEPS + 1))
        stored = {m["step"]: m["value"] for m in world["client"].job_metrics(world["job"], f"loss.rank{rank}")}
        assert all(abs(e.value - stored[e.step]) < 1e-5 for e in losses)
        assert "train/lr" in acc.Tags()["scalars"]


def test_wandb_offline_run_per_rank_holds_the_loss_history(world):
    wandb_bin = Path(sys.executable).parent / "wandb"  # the venv's (the package's own CLI)
    runs = sorted((world["runs"] / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    by_rank = {}
    for run in runs:  # read back with wandb's own reader of the transaction log
        out = subprocess.run([str(wandb_bin), "leet", "inspect", str(run), "--json"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        records = [json.loads(line) for line in out.splitlines() if line.strip()]
        header = next(r["run"] for r in records if r["type"] == "run")
        history = {r["history"]["item"]["_step"]: r["history"]["item"] for r in records if r["type"] == "history"}
        rank = int(header["display_name"].split("_rank")[1].split("_")[0])
        assert header["display_name"] == f"ddp-worker-{world['nodes'][rank]}_rank{rank}_lr{LR:g}_bs2"
        assert header["project"] == "smolforge-test"
        assert header["config"]["update"]["train"]["lr"] == LR  # the job's config is logged
        by_rank[rank] = {step: item["train/loss"] for step, item in history.items() if "train/loss" in item}
    assert sorted(by_rank) == [0, 1]
    for rank, losses in by_rank.items():
        stored = {m["step"]: m["value"] for m in world["client"].job_metrics(world["job"], f"loss.rank{rank}")}
        assert sorted(losses) == sorted(stored) and all(abs(losses[s] - stored[s]) < 1e-5 for s in stored)


def test_prometheus_scrapes_the_job_with_the_token_and_gets_401_without(world):
    port = world["prom_port"]
    require(port is not None, str(PROMETHEUS), "apt-get install prometheus (Debian's package; .ci/run installs it "
            "as root without starting its service)")
    job = world["job"]
    (sample,) = world["prom_loss"]
    assert sample["metric"]["job"] == job and sample["metric"]["node"] == world["nodes"][0]  # label node: rank 0's
    assert 0 < float(sample["value"][1]) < 20
    ranks = {s["metric"]["rank"]: s["metric"]["node"] for s in world["prom_ranks"]}
    assert ranks == {str(r): n for r, n in world["nodes"].items()} and sorted(ranks.values()) == ["w1", "w2"]
    targets = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    health = {t["labels"]["job"]: t for t in targets}
    assert health["smolforge"]["health"] == "up"
    assert health["smolforge-no-token"]["health"] == "down"
    assert "401" in health["smolforge-no-token"]["lastError"]
