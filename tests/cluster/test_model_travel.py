"""Models travel (issue 31 item 2), on a real multi-process cluster: a data-parallel job whose model
only the coordinator's machine holds runs on two workers that lacked it; they fetch it in checksummed
pieces (one fetch killed mid-way resumes, one damaged piece is refused and sent again), keep it in
their models dirs and advertise it; a second job on the model sends nothing.

A cluster of its own (a coordinator holding `tiny-far` in its models dir, two workers with empty
ones; a distill run's teacher and student, `tiny-teach` and `tiny-learn`, also only there), since the
workers re-register with Ray once they hold the new model (the session's shared
cluster must not see that). The workers' rescan timer is off (SMOLFORGE_RESCAN_S=0): what they
advertise afterwards comes from the rescan the fetch asks for. The piece protocol, the disk-space
refusal and placement's choices are tests/cluster/test_model_travel_units.py.

Last, on the same cluster, a model copied into a worker's models dir after it joined (issue 33 item 5;
tests/cluster/test_model_rescan.py has its pieces in process): it had a cluster of its own, for the same
reasons as this module's (~35 s of the CI tier).

Before it, the `serve` job kind as a user submits it (`smolforge serve --stages 2` against the
coordinator), on `SERVED`, which both workers hold from the start and the coordinator does not (so the
planner puts a stage on each worker): greedy answers through the stages are the single-process engine's
tokens, through the official `openai` client too; a stage actor SIGKILLed mid-stream fails that request
and is placed again; `job cancel` stops the API and every stage; `--stages auto` keeps the model whole on
one worker. It had a cluster of its own (tests/cluster/test_serve_job.py, ~40 s of the CI tier to start);
this topology is the one it asked for (the coordinator holds no copy of the served model).

Last, on a third serve job with stage 1 armed for fault `hold-stage`: `/metrics` answers while stage 1 is
held inside a forward (every stage's counters, the request still waiting), and a stage whose status group
is held is reported `_stage_up 0` after the scrape's bound, neither killed nor re-placed (issue 44).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest

from localcluster import LocalCluster, free_port

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny-far"
STAGED = "tiny-staged"  # served in 3 stages: the workers receive only their stages' parts
PIPED = "tiny-piped"  # trained in 2 pipeline stages: each worker receives the config part and its stage's part
TEACHER, STUDENT = "tiny-teach", "tiny-learn"  # a distill run's models, only the coordinator holds them
EXIT_AFTER = 3  # w1's first fetch dies after writing this many pieces
DAMAGED = 4  # the holder sends the 4th piece it serves damaged, once
SERVED = "tiny-copy"  # both workers hold it from the start, the coordinator does not: the serve job's model
PROMPTS = ["What is 2 + 3?", "Reverse abc", "the of and to in is you that it he was for on are as with his", "sum"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from smolforge.cluster.nodes.model_fetch import PIECE_BYTES_ENV
    from smolforge.models.tiny import preset_dir

    base = tmp_path_factory.mktemp("model-travel")
    shutil.copytree(preset_dir("tiny-llama"), base / "coord-models" / MODEL)
    for name in (STAGED, PIPED, TEACHER, STUDENT):
        shutil.copytree(preset_dir("tiny-llama"), base / "coord-models" / name)
    c = LocalCluster(base)
    c.env["SMOLFORGE_RESCAN_S"] = "0"
    c.env[PIECE_BYTES_ENV] = str(256 << 10)  # the 3.4 MB model in 19 pieces
    try:
        c.start_coordinator(models_dir=base / "coord-models")
        for name in ("w1", "w2"):
            shutil.copytree(preset_dir("tiny-llama"), base / f"models-{name}" / SERVED)
            c.add_worker(name, models_dir=base / f"models-{name}", wait=False)
        for name in ("w1", "w2"):
            c.workers[name].wait_for(f"Registered as {name}", 120)
        c.wait_nodes(["coordinator", "w1", "w2"])
        yield c
    finally:
        c.close()


def sums(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def job_spec(c: LocalCluster, model: str = MODEL) -> dict:
    from smolforge.data.synthetic import generate

    data = c.base / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(16, seed=5)))
    train = {"model": model, "data": {"path": str(data), "max_eval_samples": 4, "max_length": 32},
             "max_steps": 2, "batch_size": 2, "save_every": 0, "eval_accuracy": False, "log_every": 1,
             "peft": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0}}
    return {"kind": "data_parallel", "num_workers": 2, "max_retries": 0, "train": train}


def job_end(client, job_id: str) -> tuple[dict, list[dict]]:
    """The job's status once it ended (a bound against a hang only) and its model_transfer events."""
    deadline = time.time() + 300
    st = client.get_job_status(job_id)
    while st["state"] not in ("completed", "failed", "cancelled") and time.time() < deadline:
        time.sleep(0.5)
        st = client.get_job_status(job_id)
    return st, [e for e in client.job_events(job_id) if e["kind"] == "model_transfer"]


def run_job(c: LocalCluster, model: str = MODEL) -> tuple[dict, list[dict]]:
    """Submit, wait (a bound against a hang only), and return the status and its model_transfer events."""
    client = c.client()
    job_id = client.submit_job(job_spec(c, model))
    st, events = job_end(client, job_id)
    assert st["state"] == "completed", (st.get("error"), [e["message"] for e in events], client.job_logs(job_id)[-30:])
    assert sorted(t["node_name"] for t in st["tasks"] if t["kind"] == "dp_rank") == ["w1", "w2"]
    return st, events


def wait_listed(c: LocalCluster, names: list[str], timeout: float = 180, model: str = MODEL) -> None:
    """Every node in `names` online and advertising `model` (a bound against a hang only)."""
    deadline = time.time() + timeout
    nodes: list[dict] = []
    while time.time() < deadline:
        nodes = c.client().list_nodes()
        held = {n["name"] for n in nodes if n["state"] == "online" and model in n["models"]}
        if set(names) <= held:
            return
        time.sleep(0.5)
    raise AssertionError(f"{model} not listed on {names} in {timeout}s: "
                         f"{[(n['name'], n['state'], n['models']) for n in nodes]}")


def data_of(e: dict) -> dict:
    d = e.get("data")
    return json.loads(d) if isinstance(d, str) else (d or {})


def test_a_model_only_the_coordinator_holds_travels_to_both_workers(cluster):
    c = cluster
    (c.base / "node-w1" / "node").mkdir(parents=True, exist_ok=True)
    (c.base / "node-w1" / "node" / "fault-fetch-exit-after").write_text(str(EXIT_AFTER))
    (c.state / "node").mkdir(parents=True, exist_ok=True)
    (c.state / "node" / "fault-fetch-corrupt-piece").write_text(str(DAMAGED))

    _, events = run_job(c)
    data = [data_of(e) for e in events]
    total = next(d["pieces_total"] for d in data if d.get("state") == "planned")
    done = {d["node"]: d for d in data if d.get("state") == "done"}
    assert set(done) == {"w1", "w2"}, [e["message"] for e in events]
    # w1's fetch died after EXIT_AFTER pieces; the next one kept them and asked only for the rest
    assert [d["node"] for d in data if d.get("state") == "cut"] == ["w1"], [e["message"] for e in events]
    assert (done["w1"]["resumed"], done["w1"]["pieces"]) == (EXIT_AFTER, total - EXIT_AFTER)
    assert (done["w2"]["resumed"], done["w2"]["pieces"]) == (0, total)
    assert done["w1"]["refused"] + done["w2"]["refused"] == 1  # the damaged piece, refused and sent again
    want = sums(c.base / "coord-models" / MODEL)
    for name in ("w1", "w2"):
        assert sums(c.base / f"models-{name}" / MODEL) == want  # checksums equal
    # the fetches asked each worker to rescan: both advertise it once they joined Ray again (and the next
    # test's plan must not pick a node that is about to leave Ray for that)
    wait_listed(c, ["w1", "w2"])


@pytest.mark.soak  # the same claim in CI: the second run of test_a_distill_run_brings_its_teacher_and_student_to_the_workers (bring_model's cache hit)
def test_a_second_job_on_the_model_sends_nothing(cluster):
    c = cluster
    wait_listed(c, ["w1", "w2"])  # the first job's fetches asked each worker to rescan: both advertise it now
    _, events = run_job(c)
    data = [data_of(e) for e in events]
    assert [d for d in data if d.get("pieces")] == [], [e["message"] for e in events]
    hits = [d for d in data if d.get("cache_hit")]
    assert hits and sorted(hits[0]["nodes"]) == ["w1", "w2"], [e["message"] for e in events]


@pytest.mark.soak
def test_a_model_one_worker_holds_goes_from_that_worker_to_the_other(cluster):
    """The second instance: the holder is a worker, not the coordinator; placement puts one rank on it
    (it holds the model) and the other worker fetches the model from it."""
    from smolforge.models.tiny import preset_dir

    c, near = cluster, "tiny-near"
    shutil.copytree(preset_dir("tiny-llama"), c.base / "models-w1" / near)
    r = c.cli("worker", "rescan", "--state-dir", str(c.base / "node-w1"))
    assert r.returncode == 0 and f"found model {near}" in r.stdout, r.stdout + r.stderr
    wait_listed(c, ["w1"], model=near)
    _, events = run_job(c, near)
    data = [data_of(e) for e in events]
    planned = [d for d in data if d.get("state") == "planned"]
    assert [(d["source"], d["nodes"]) for d in planned] == [("w1", ["w2"])], [e["message"] for e in events]
    assert [d["nodes"] for d in data if d.get("cache_hit")] == [["w1"]]
    done = [d for d in data if d.get("state") == "done"]
    assert [(d["node"], d["pieces"], d["resumed"]) for d in done] == [("w2", planned[0]["pieces_total"], 0)]
    assert sums(c.base / "models-w2" / near) == sums(c.base / "models-w1" / near)
    # the fetch asked w2 to rescan: it re-joins (a new Ray node) after the job. The next test's plan must
    # not pick the node that is about to go (its part's fetch was unschedulable: `make test-all` failed)
    wait_listed(c, ["w2"], model=near)


def test_a_served_model_sends_each_stage_only_its_part(cluster):
    """`serve --stages 2` on the two workers (`stage_nodes`) of a model only the coordinator holds:
    each worker receives only its stage's part (fewer bytes than the whole model, never advertised as
    the model), and greedy answers through the stages are the single-process tokens."""
    import httpx

    from smolforge.cluster.nodes.discovery import scan_models_dir
    from smolforge.serve.engine import Engine
    from smolforge.serve.model import ServedModel
    from smolforge.serve.sampling import SamplingParams

    c, client = cluster, cluster.client()
    whole = sum(p.stat().st_size for p in (c.base / "coord-models" / STAGED).iterdir())
    job_id = client.submit_job({"kind": "serve", "model": STAGED, "stages": 2, "port": 0, "model_name": "tiny",
                                "stage_nodes": ["w1", "w2"]})
    try:
        deadline, url = time.time() + 300, None
        while url is None and time.time() < deadline:
            events = client.job_events(job_id)
            url = next((data_of(e)["url"] for e in events if e["kind"] == "serving"), None)
            st = client.get_job_status(job_id)
            assert st["state"] in ("pending", "running"), (st.get("error"), [e["message"] for e in events])
            time.sleep(0.5)
        assert url, [e["message"] for e in client.job_events(job_id)]
        events = client.job_events(job_id)
        stages = {data_of(e)["stage"]: data_of(e)["node"] for e in events if e["kind"] == "stage"}
        done = {d["node"]: d for d in map(data_of, (e for e in events if e["kind"] == "model_transfer"))
                if d.get("state") == "done"}
        assert sorted(stages.values()) == ["w1", "w2"], stages
        plan = next(e for e in events if e["kind"] == "plan")  # each part's estimated transfer is in the plan
        assert sorted(data_of(plan)["transfer_s"]) == ["w1", "w2"] and "model transfer" in plan["message"], plan
        assert set(done) == {"w1", "w2"}, [e["message"] for e in events]
        for node, d in done.items():
            assert 0 < d["bytes"] < whole, (node, d["bytes"], whole)  # its stage's part, not the whole model
            assert d["stage"] == next(i for i, n in stages.items() if n == node)
            assert STAGED not in scan_models_dir(c.base / f"models-{node}")  # a part is never the model
        single = Engine(ServedModel.load(str(c.base / "coord-models" / STAGED), device="cpu")).start()
        try:
            for prompt in ("What is 2 + 3?", "Reverse abc"):
                ids = single.model.tokenizer(prompt)["input_ids"]
                want = single.generate(ids, SamplingParams(max_tokens=12, temperature=0), timeout=120).text
                r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {c.token}"}, timeout=120,
                               json={"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (prompt, r.text)
        finally:
            single.stop()
    finally:
        client.cancel_job(job_id)


def test_a_pipeline_job_sends_each_rank_only_its_stage_s_part(cluster):
    """A 2-stage pipeline LoRA job (`launch --stages 2`) on the two workers of a model only the coordinator
    holds: before the ranks start each worker receives the config part (config and tokenizer, no tensor),
    and each rank, once it has cut the model, only its stage's part; the whole model reaches neither
    worker, no part is advertised as the model, each worker received fewer bytes than the whole model,
    each rank read no more than its part holds, and the job trains (completed, its loss reported)."""
    from smolforge.cluster.nodes.discovery import scan_models_dir
    from smolforge.cluster.nodes.model_fetch import stage_part_name

    c, client, bounds = cluster, cluster.client(), [0, 2, 4]
    whole = sum(p.stat().st_size for p in (c.base / "coord-models" / PIPED).iterdir())
    spec = {**job_spec(c, PIPED), "stages": 2, "strategy_config": {"bounds": bounds}}
    del spec["num_workers"]
    job_id = client.submit_job(spec)
    st, events = job_end(client, job_id)
    said = [e["message"] for e in events]
    assert st["state"] == "completed", (st.get("error"), said, client.job_logs(job_id)[-30:])
    ranks = {t["rank"]: t["node_name"] for t in st["tasks"] if t["kind"] == "dp_rank"}
    assert sorted(ranks.values()) == ["w1", "w2"], st["tasks"]
    done = [d for d in map(data_of, events) if d.get("state") == "done"]
    config = {d["node"]: d for d in done if d.get("part") == "config"}
    stage = {d["node"]: d for d in done if "stage" in d}
    assert set(config) == set(stage) == {"w1", "w2"} and len(done) == 4, said  # nothing else was sent
    res = st["result"]
    for rank, node in ranks.items():
        assert (stage[node]["stage"], stage[node]["rank"], stage[node]["bounds"]) == (rank, rank, bounds), said
        got = config[node]["bytes"] + stage[node]["bytes"]
        print(f"\n{node} (rank {rank}): config part {config[node]['bytes']:,} + stage part {stage[node]['bytes']:,}"
              f" = {got:,} bytes of the model's {whole:,}; read {res['stage_read_bytes_per_rank'][rank]:,.0f}")
        assert 0 < got < whole, (node, got, whole)  # its stage's part and the config, not the whole model
        models = c.base / f"models-{node}"
        part = models / stage_part_name(PIPED, bounds, rank) / "model.safetensors"
        assert 0 < res["stage_read_bytes_per_rank"][rank] <= part.stat().st_size, (rank, res)
        assert PIPED not in scan_models_dir(models) and not (models / PIPED).exists()  # a part is never the model
    assert res["strategy"] == "pipeline" and res["steps"] == 2 and res["final_loss"] > 0, res


@pytest.mark.soak
def test_a_later_pipeline_job_fetches_only_the_parts_its_nodes_lack(cluster):
    """The second instance, after the test above: another pipeline job on the same model, whose ranks may
    land on the other worker (a re-placed stage): a node gets the config part and a stage's part again
    only if it lacks them; one it holds is a cache hit (nothing sent). Each node still never holds the
    whole model."""
    from smolforge.cluster.nodes.model_fetch import stage_part_name

    c, client, bounds = cluster, cluster.client(), [0, 2, 4]
    had = {(node, i): (c.base / f"models-{node}" / stage_part_name(PIPED, bounds, i)).is_dir()
           for node in ("w1", "w2") for i in (0, 1)}
    assert sum(had.values()) == 2, had  # the test above left each worker its rank's part
    spec = {**job_spec(c, PIPED), "stages": 2, "strategy_config": {"bounds": bounds}}
    del spec["num_workers"]
    job_id = client.submit_job(spec)
    st, events = job_end(client, job_id)
    said = [e["message"] for e in events]
    assert st["state"] == "completed", (st.get("error"), said, client.job_logs(job_id)[-30:])
    ranks = {t["rank"]: t["node_name"] for t in st["tasks"] if t["kind"] == "dp_rank"}
    data = [data_of(e) for e in events]
    config_hits = {d["node"] for d in data if d.get("part") == "config" and d.get("cache_hit") and d.get("node")}
    assert config_hits == {"w1", "w2"} and not [d for d in data if d.get("part") == "config" and d.get("bytes")], said
    for rank, node in ranks.items():
        mine = [d for d in data if d.get("stage") == rank and d.get("node") == node]
        print(f"\n{node} (rank {rank}): stage {rank}'s part {'held: a cache hit' if had[(node, rank)] else 'fetched'}")
        if had[(node, rank)]:
            assert [(d["cache_hit"], d["bytes"]) for d in mine] == [(True, 0)], (node, rank, said)
        else:  # its stage moved to this node: it fetches that part now
            assert [d["state"] for d in mine if d.get("state") == "done"] == ["done"], (node, rank, said)
            assert 0 < next(d["bytes"] for d in mine if d.get("state") == "done"), said
        assert not (c.base / f"models-{node}" / PIPED).exists()


def test_an_export_runs_on_a_worker_that_fetched_the_model(cluster):
    """An export job whose model no worker holds whole (the serve test above left them only stage
    parts): a worker fetches the whole model first, then the task runs there."""
    c, client = cluster, cluster.client()
    job_id = client.submit_job({"kind": "export", "model": STAGED, "to": "hf", "verify": False})
    st, events = job_end(client, job_id)
    assert st["state"] == "completed", (st.get("error"), [e["message"] for e in events])
    done = [data_of(e) for e in events if data_of(e).get("state") == "done"]
    assert len(done) == 1 and done[0]["node"] in ("w1", "w2"), [e["message"] for e in events]
    assert sums(c.base / f"models-{done[0]['node']}" / STAGED) == sums(c.base / "coord-models" / STAGED)


def run_distill(c: LocalCluster, out: Path) -> tuple[dict, list[dict]]:
    """`smolforge distill` against the coordinator (tiny settings: 4 prompts, 1 teacher, 1 student of 2
    steps, no eval, no merge), its teacher TEACHER and its student's base STUDENT; its run summary and
    its model_transfer events."""
    client = c.client()
    before = {j["id"] for j in client.list_jobs()}
    r = c.cli("distill", "--teacher", TEACHER, "--student", STUDENT, "--data", "bundled", "--max-samples", "4",
              "--teacher-backend", "hf", "--num-teachers", "1", "--num-students", "1", "--max-steps", "2",
              "--batch-size", "2", "--max-new-tokens", "4", "--top-k", "4", "--no-eval", "--save-every", "0",
              "--aggregate", "none", "--device", "cpu", "--peft-config", '{"r": 4, "alpha": 8, "dropout": 0.0}',
              "--output-dir", str(out), "--json", timeout=400)
    [job_id] = [j["id"] for j in client.list_jobs() if j["id"] not in before]
    events = [e for e in client.job_events(job_id) if e["kind"] == "model_transfer"]
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:], [e["message"] for e in events])
    return json.loads((out / "distill_summary.json").read_text()), events


def test_a_distill_run_brings_its_teacher_and_student_to_the_workers(cluster, tmp_path):
    """A distill job whose teacher and student only the coordinator's machine holds: before the run
    places anything, both workers fetch both models (one rescan each, after the last), the run waits
    until they joined Ray again advertising them, and the teacher and the student run on a worker; a
    second run sends nothing (cache hits). Cost (the module's cluster up): 26 s at load 4, 34-39 s at load
    6-10 on the 2-core machine: the two runs' teacher and student processes and the workers' re-join."""
    c = cluster
    summary, events = run_distill(c, tmp_path / "first")
    data, said = [data_of(e) for e in events], "\n".join(e["message"] for e in events)
    done = sorted((d["model"], d["node"]) for d in data if d.get("state") == "done")
    assert done == [(STUDENT, "w1"), (STUDENT, "w2"), (TEACHER, "w1"), (TEACHER, "w2")], said
    advertised = [d for d in data if d.get("state") == "advertised"]
    assert [sorted(d["nodes"]) for d in advertised] == [["w1", "w2"]], said
    assert not [d for d in data if d.get("state") == "left_out"], said
    teachers = [(t["state"], t["node"] in ("w1", "w2")) for t in summary["teacher_tasks"]]
    assert teachers == [("completed", True)], summary["teacher_tasks"]  # on a worker that fetched it
    assert [(t["state"], t["node"] in ("w1", "w2")) for t in summary["student_tasks"]] == [("completed", True)]
    for name in ("w1", "w2"):
        for model in (TEACHER, STUDENT):
            assert sums(c.base / f"models-{name}" / model) == sums(c.base / "coord-models" / model)

    summary, events = run_distill(c, tmp_path / "second")
    data = [data_of(e) for e in events]
    assert [d for d in data if d.get("pieces") or d.get("state")] == [], [e["message"] for e in events]
    hits = sorted((d["model"], sorted(d["nodes"])) for d in data if d.get("cache_hit"))
    assert hits == [(STUDENT, ["w1", "w2"]), (TEACHER, ["w1", "w2"])], [e["message"] for e in events]
    assert [t["state"] for t in summary["student_tasks"]] == ["completed"]


# -- the serve job kind, submitted as a user does (was tests/cluster/test_serve_job.py) --------------------------


@pytest.fixture(scope="module")
def world(cluster):
    """The module's cluster for the serve job, and the single-process engine on SERVED (the answer to match)."""
    from smolforge.serve.engine import Engine
    from smolforge.serve.model import ServedModel

    engine = Engine(ServedModel.load(str(cluster.base / "models-w1" / SERVED), device="cpu")).start()
    try:
        yield {"c": cluster, "base": cluster.base, "single": engine}
    finally:
        engine.stop()


def wait_event(client, job_id: str, kind: str, timeout: float, where=lambda e: True) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in client.job_events(job_id):
            if e["kind"] == kind and where(e):
                return e
        st = client.get_job_status(job_id)
        if st["state"] in ("failed", "cancelled", "completed"):
            raise AssertionError(f"job {job_id} {st['state']}: {st.get('error')}\n" + timeline(client, job_id))
        time.sleep(0.3)
    raise AssertionError(f"no {kind} event after {timeout} s\n" + timeline(client, job_id))


def timeline(client, job_id) -> str:
    return "\n".join(f"{e['ts']:.2f} {e['kind']}: {e['message']}" for e in client.job_events(job_id))


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def single_text(world, prompt: str, max_tokens: int) -> str:
    from smolforge.serve.sampling import SamplingParams

    engine = world["single"]
    ids = engine.model.tokenizer(prompt)["input_ids"]
    return engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0), timeout=120).text


@pytest.fixture(scope="module")
def job(world):
    """`smolforge serve --stages 2` against the coordinator ($SMOLFORGE_COORDINATOR): it submits the
    job and returns once the API serves."""
    import openai

    c = world["c"]
    port = free_port()
    r = c.cli("serve", "--model", SERVED, "--stages", "2", "--port", str(port), "--model-name", "tiny",
              timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stderr.split("submitted ", 1)[1].split()[0]
    url = wait_event(c.client(), job_id, "serving", 30)["data"]["url"]
    api = openai.OpenAI(base_url=f"{url}/v1", api_key=c.token, max_retries=0, timeout=60)
    yield {"id": job_id, "url": url, "port": port, "cli": r, "api": api}
    if c.client().get_job_status(job_id)["state"] not in ("cancelled", "failed"):
        c.client().cancel_job(job_id)


def test_two_stages_on_the_workers_answer_as_one_process_through_the_openai_client(world, job):
    import openai

    c, client, api = world["c"], world["c"].client(), job["api"]
    r = job["cli"]
    assert job["url"] == f"http://127.0.0.1:{job['port']}" and f"on {job['url']}" in r.stdout
    assert f"smolforge job cancel {job['id']}" in r.stdout
    assert c.token not in r.stdout + r.stderr
    events = client.job_events(job["id"])
    stages = sorted((e["data"] for e in events if e["kind"] == "stage"), key=lambda s: s["stage"])
    assert sorted(s["node"] for s in stages) == ["w1", "w2"], stages  # one per worker, not the coordinator
    # on two nodes both stages start before either answers: their model loads overlap
    order = [(e["kind"], e["data"]["stage"]) for e in events if e["kind"] in ("stage_start", "stage")]
    assert order == [("stage_start", 0), ("stage_start", 1), ("stage", 0), ("stage", 1)], order
    # the layers as the placement plan cut them (from each worker's measured speed and memory), printed
    plan = next(e for e in events if e["kind"] == "plan")
    bounds = plan["data"]["bounds"]
    assert bounds[0] == 0 and bounds[-1] == 4 and [tuple(s["layers"]) for s in stages] == list(zip(bounds, bounds[1:]))
    assert [s["node"] for s in stages] == plan["data"]["nodes"] and plan["message"] in r.stdout
    assert "plan: 2 stages" in r.stdout and "2 stages as asked" in r.stdout
    # greedy through the stages = the single-process engine, token for token (as text)
    for prompt in PROMPTS:
        got = api.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert got.choices[0].text == single_text(world, prompt, 20), prompt
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                              stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length") and text
    again = api.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert again.choices[0].message.content == text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{job['url']}/v1", api_key="x" * 32, max_retries=0, timeout=30).models.list()
    # what each stage printed is the job's log, with its task and node (the runner polls every 2 s)
    deadline, said = time.time() + 15, ""
    while time.time() < deadline and "stage 1: layers" not in said:
        said = c.cli("job", "logs", job["id"], "--task", "stage1").stdout
        time.sleep(1)
    assert re.search(rf"\[stage1 {stages[1]['node']} INFO\] INFO .*stage 1: layers {bounds[1]}-{bounds[2]} of {SERVED}", said), said


def test_a_killed_stage_fails_its_stream_and_is_placed_again(world, job):
    import openai

    client, api = world["c"].client(), job["api"]
    # a prompt the model answers at length (no EOS early): the kill surely lands mid-generation
    prompt = next((p for p in PROMPTS if len(single_text(world, p, 200)) >= 100), None)
    assert prompt, "no prompt gives a long answer"
    victim = next(e["data"] for e in client.job_events(job["id"]) if e["kind"] == "stage" and e["data"]["stage"] == 1)
    stream = api.completions.create(model="tiny", prompt=prompt, max_tokens=200, temperature=0, stream=True)
    pieces = iter(stream)
    assert next(pieces).choices[0].text is not None  # it is streaming
    os.kill(victim["pid"], signal.SIGKILL)  # the stage actor's process, on w1 or w2
    killed = time.monotonic()
    with pytest.raises(openai.APIError, match="stage 1"):
        for _ in pieces:
            assert time.monotonic() - killed < 120  # a hang guard: the stream ends with the stage's error
    assert time.monotonic() - killed < 120
    # the next request: stage 1 placed again on a live node holding the model, the single-process tokens
    got = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    assert got.choices[0].text == single_text(world, PROMPTS[0], 20)
    again = wait_event(client, job["id"], "stage", 30, where=lambda e: e["data"]["replaced"])
    assert again["data"]["stage"] == 1 and again["data"]["pid"] != victim["pid"], again
    assert again["data"]["node"] in ("w1", "w2") and "re-placed" in again["message"]


def test_job_cancel_stops_the_api_and_every_stage(world, job):
    import psutil

    c, client = world["c"], world["c"].client()
    pids = [e["data"]["pid"] for e in client.job_events(job["id"]) if e["kind"] == "stage"]
    r = c.cli("job", "cancel", job["id"])
    assert r.returncode == 0, r.stdout + r.stderr
    deadline = time.time() + 60
    while time.time() < deadline and (client.get_job_status(job["id"])["state"] != "cancelled"
                                      or port_open(job["port"]) or any(psutil.pid_exists(p) for p in pids)):
        time.sleep(0.3)
    assert client.get_job_status(job["id"])["state"] == "cancelled"
    assert not port_open(job["port"])
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive


def test_stages_auto_keeps_a_model_that_fits_on_one_worker(world, job):
    """After the cancel above (its stages held the workers' CPUs): `--stages auto` measures both
    workers and keeps the model whole on one of them (a split of a model that fits only adds a
    cut's latency to every token), printing why; it answers as the single process does."""
    import openai

    c, client = world["c"], world["c"].client()
    port = free_port()
    r = c.cli("serve", "--model", SERVED, "--stages", "auto", "--port", str(port), "--model-name", "tiny",
              timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stderr.split("submitted ", 1)[1].split()[0]
    try:
        assert "plan: 1 stage," in r.stdout and "kept on w" in r.stdout and "(1 stage, max batch" in r.stdout, r.stdout
        events = client.job_events(job_id)
        plan = next(e["data"] for e in events if e["kind"] == "plan")
        stages = [e["data"] for e in events if e["kind"] == "stage"]
        assert plan["kept_on_one_node"] and plan["bounds"] == [0, 4] and plan["stages_asked"] == "auto"
        assert len(stages) == 1 and stages[0]["node"] == plan["nodes"][0] in ("w1", "w2"), stages
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=c.token, max_retries=0, timeout=60)
        got = api.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0)
        assert got.choices[0].text == single_text(world, PROMPTS[1], 20)
    finally:
        client.cancel_job(job_id)


# -- a model copied in after the worker joined (issue 33 item 5), last: it re-registers w1 once more ------

LATE = "tiny-late"  # no node holds it until the test copies it into w1's models dir


def test_a_model_copied_in_after_join_is_placed_on_without_a_rejoin(cluster):
    """Before: no node holds LATE, a job on it is refused at submit. Copied into w1's models dir,
    `worker rescan` finds it and re-registers w1 (no re-join by hand): w1 advertises it (its Ray resource
    too) and a one-worker job on it runs there. A second rescan finds nothing new."""
    from smolforge.errors import SmolforgeError
    from smolforge.models.tiny import preset_dir

    c, client = cluster, cluster.client()
    spec = {**job_spec(c, LATE), "num_workers": 1}
    with pytest.raises(SmolforgeError, match=f"does not hold model {LATE}"):
        client.submit_job(spec)  # before: no node holds it, refused at once

    shutil.copytree(preset_dir("tiny-llama"), c.base / "models-w1" / LATE)
    r = c.cli("worker", "rescan", "--state-dir", str(c.base / "node-w1"))
    assert r.returncode == 0 and f"found model {LATE}; re-registering" in r.stdout, r.stdout + r.stderr
    wait_listed(c, ["w1"], model=LATE)
    node = next(n for n in client.list_nodes() if n["name"] == "w1")
    assert node["ray_resources"].get(f"model:{LATE}"), node["ray_resources"]
    c.workers["w1"].wait_for(f"found model {LATE}; re-registering", 10)

    job_id = client.submit_job(spec)
    st, _ = job_end(client, job_id)
    assert st["state"] == "completed", (st.get("error"), client.job_logs(job_id)[-30:])
    assert [t["node_name"] for t in st["tasks"] if t["kind"] == "dp_rank"] == ["w1"]

    r = c.cli("worker", "rescan", "--state-dir", str(c.base / "node-w1"))  # nothing new: no re-register
    assert r.returncode == 0 and "no change (" in r.stdout and "re-registering" not in r.stdout, r.stdout + r.stderr


# -- /metrics while a stage is busy or silent (issue 44): a scrape never waits on a step, nor takes a stage down --


def hold_files(c) -> list[Path]:
    """Fault `hold-stage` (train/faults.py) on both workers: whichever runs stage 1 reads it."""
    dirs = [c.base / f"node-{n}" / "node" for n in ("w1", "w2")]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)  # a node's scratch directory is made by the first task that needs it
    return [d / "fault-hold-stage" for d in dirs]


def stage_samples(url: str, token: str) -> dict[str, dict[str, float]]:
    """`/metrics`' per-stage samples: {metric name: {stage label: value}} (the scrape bounded by httpx)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=60)
    assert r.status_code == 200, r.text
    got: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:  # by the family's name (the parser names a counter's samples `_total`)
            if "stage" in sample.labels:
                got.setdefault(family.name, {})[sample.labels["stage"]] = sample.value
    return got


def wait_ended(client, job_id: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and client.get_job_status(job_id)["state"] != "cancelled":
        time.sleep(0.3)
    assert client.get_job_status(job_id)["state"] == "cancelled"


def said(client, job_id: str, text: str, timeout: float = 60) -> bool:
    """Whether a stage's log line with `text` reaches the job's log (shipped every 2 s; a hang guard only)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(text in line["line"] for line in client.task_logs(job_id, task="stage1")):
            return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def held_job(world, job):
    """Last in the module (its stages hold both workers' CPUs until it ends), after the jobs above: `serve --stages 2` with stage 1 armed for fault
    `hold-stage` ("1 forward": its first forward waits until the test says otherwise)."""
    c, client = world["c"], world["c"].client()
    if client.get_job_status(job["id"])["state"] not in ("cancelled", "failed"):  # run alone: free the CPUs
        client.cancel_job(job["id"])
        wait_ended(client, job["id"])
    for f in hold_files(c):
        f.write_text("1 forward")
    port = free_port()
    r = c.cli("serve", "--model", SERVED, "--stages", "2", "--port", str(port), "--model-name", "tiny", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stderr.split("submitted ", 1)[1].split()[0]
    url = wait_event(c.client(), job_id, "serving", 30)["data"]["url"]
    try:
        yield {"id": job_id, "url": url}
    finally:
        for f in hold_files(c):
            f.unlink(missing_ok=True)
        c.client().cancel_job(job_id)


def test_a_scrape_answers_while_a_stage_is_inside_a_forward(world, held_job):
    """Stage 1 held inside its first forward (fault `hold-stage`): `/metrics` answers at once with both
    stages up and their counters (stage 0 computed the prompt, stage 1 nothing yet), the request still
    waiting; released, the request ends with the single process's tokens. A stage answers `info` in a
    concurrency group of its own: with one thread for everything it would answer only after the step."""
    import threading

    import openai

    c, client = world["c"], world["c"].client()
    api = openai.OpenAI(base_url=f"{held_job['url']}/v1", api_key=c.token, max_retries=0, timeout=120)
    answer: list[str] = []
    asking = threading.Thread(target=lambda: answer.append(
        api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0).choices[0].text))
    asking.start()
    try:
        assert said(client, held_job["id"], "stage 1 forward held"), timeline(client, held_job["id"])
        got = stage_samples(held_job["url"], c.token)
        assert not answer and asking.is_alive()  # the step is still held: the scrape did not wait for it
    finally:
        for f in hold_files(c):
            f.unlink(missing_ok=True)  # released
        asking.join(150)
    assert got["smolforge_serve_stage_up"] == {"0": 1.0, "1": 1.0}, got
    tokens = got["smolforge_serve_stage_tokens"]
    assert sorted(tokens) == ["0", "1"] and tokens["0"] > 0 and tokens["1"] == 0, got  # the prompt, on stage 0 only
    assert answer == [single_text(world, PROMPTS[0], 6)]


def test_a_stage_that_does_not_answer_a_scrape_in_time_is_not_up_and_stays(world, held_job):
    """Stage 1's status group held (fault `hold-stage` "1 report": the API's next log read waits there):
    a scrape gives up on it after its bound (`SCRAPE_TIMEOUT_S`), stage 1 `_up 0`, stage 0 up; the stage
    is neither marked broken nor killed (no re-placement, the same process), and once released it is up
    again and serves the single process's tokens."""
    import openai

    c, client = world["c"], world["c"].client()
    for f in hold_files(c):
        f.write_text("1 report")
    up: dict[str, float] = {}
    try:
        deadline = time.time() + 90  # the runner reads the stages' logs every 2 s: the next read holds
        while time.time() < deadline and up.get("1") != 0.0:
            got = stage_samples(held_job["url"], c.token)
            up = got["smolforge_serve_stage_up"]
        assert up == {"0": 1.0, "1": 0.0}, up
        assert sorted(got["smolforge_serve_stage_tokens"]) == ["0"], got  # stage 1's left out, not reported as 0
    finally:
        for f in hold_files(c):
            f.unlink(missing_ok=True)
    deadline = time.time() + 60
    while time.time() < deadline and up.get("1") != 1.0:
        up = stage_samples(held_job["url"], c.token)["smolforge_serve_stage_up"]
    assert up == {"0": 1.0, "1": 1.0}, up  # the same actor answers again: it was not killed
    assert said(client, held_job["id"], "stage 1 report held"), timeline(client, held_job["id"])
    stages = [e["data"] for e in client.job_events(held_job["id"]) if e["kind"] == "stage"]
    assert sorted(s["stage"] for s in stages) == [0, 1] and not any(s["replaced"] for s in stages), stages
    api = openai.OpenAI(base_url=f"{held_job['url']}/v1", api_key=c.token, max_retries=0, timeout=120)
    got_text = api.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0).choices[0].text
    assert got_text == single_text(world, PROMPTS[1], 6)
    stages = [e["data"] for e in client.job_events(held_job["id"]) if e["kind"] == "stage"]
    assert not any(s["replaced"] for s in stages), stages  # the request ran on the same stage 1, not a new one
