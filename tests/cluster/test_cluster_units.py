"""Fast tests of the cluster's parts that need no running cluster: job store, artifacts, auth,
placement rules, model discovery, job specs and overrides."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.auth import bearer_of, load_or_create_token, tokens_match
from smolforge.cluster.nodes.discovery import (check_node_name, parse_ollama_list, scan_hf_cache, scan_models_dir,
                                         with_aliases)
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.control.manager import JobManager
from smolforge.cluster.control.placement import requirements_for, slots_on
from smolforge.cluster.control.specs import DataParallelJob
from smolforge.errors import SmolforgeError
from smolforge.parallel.transfer import pack_dir, unpack_dir


# -- job store ------------------------------------------------------------------------------------

def test_jobstore_transitions_events_and_persistence(tmp_path):
    db = tmp_path / "jobs.db"
    store = JobStore(db)
    jid = store.create_job("data_parallel", {"x": 1}, name="run-a")
    assert store.get_job(jid)["state"] == "pending"
    store.set_state(jid, "running")
    store.set_state(jid, "paused")
    store.set_state(jid, "running")
    store.set_state(jid, "completed")
    with pytest.raises(SmolforgeError, match="cannot become pending"):
        store.set_state(jid, "pending")
    store.update_job(jid, step=5, max_steps=10, samples_done=20, samples_total=40, loss=1.5, nodes=["w1"])
    store.add_metrics(jid, [(5, "loss", 1.5), (5, "lr", 0.1)])
    store.close()
    again = JobStore(db)  # a restart: everything is still there
    job = again.get_job(jid)
    assert job["state"] == "completed" and job["finished"] and job["progress"] == 0.5
    assert job["nodes"] == ["w1"] and again.get_job("run-a")["id"] == jid and again.get_job(jid[:8])["id"] == jid
    kinds = [(e["kind"], (e["data"] or {}).get("to")) for e in again.events(jid)]
    assert kinds == [("submitted", None), ("state", "running"), ("state", "paused"), ("state", "running"),
                     ("state", "completed")]
    assert [m["name"] for m in again.metrics(jid)] == ["loss", "lr"]
    with pytest.raises(SmolforgeError, match="no job"):
        again.get_job("job-missing")
    mode = again._db().execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_jobstore_tasks_upsert(tmp_path):
    store = JobStore(tmp_path / "j.db")
    jid = store.create_job("data_parallel", {})
    store.upsert_task(f"{jid}-g1-r0", jid, "dp_rank", "running", rank=0, node_name="w1", pid=123,
                      requirements={"cpus": 1})
    store.upsert_task(f"{jid}-g1-r0", jid, "dp_rank", "released")
    [t] = store.tasks(jid)
    assert t["state"] == "released" and t["pid"] == 123 and t["requirements"] == {"cpus": 1}


# -- artifacts ------------------------------------------------------------------------------------

def test_artifacts_roundtrip_checksums_and_latest(tmp_path):
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"\x00" * 1000)
    (src / "sub" / "b.json").write_text('{"x": 1}')
    store = ArtifactStore(tmp_path / "art")
    for step in (5, 10, 15):
        store.put("job-1", "checkpoints", f"step-{step}", pack_dir(src), keep_last=2)
    assert store.list("job-1", "checkpoints") == ["step-10", "step-15"]
    assert store.latest_checkpoint("job-1") == "step-15"
    # corruption on disk is caught, and the newest *valid* checkpoint wins
    (store.path("job-1", "checkpoints", "step-15") / "a.bin").write_bytes(b"\x01" * 1000)
    assert not store.verify("job-1", "checkpoints", "step-15")
    assert store.latest_checkpoint("job-1") == "step-10"
    with pytest.raises(SmolforgeError, match="missing or corrupt"):
        store.get("job-1", "checkpoints", "step-15")
    out = unpack_dir(store.get("job-1", "checkpoints", "step-10"), tmp_path / "restored")
    assert (out / "sub" / "b.json").read_text() == '{"x": 1}'


def _stream_into(store, src, name: str, chunk: int, keep_last=None, corrupt: bool = False) -> dict:
    """What a rank's upload does, without Ray: send_dir's pieces into the store's receiver, then commit."""
    from smolforge.parallel.transfer import send_dir

    receiver = store.begin("job-1", "checkpoints", name)
    sent: list[tuple[str, int, int]] = []

    def put(rel, offset, data):
        sent.append((rel, offset, len(data)))
        receiver.write(rel, offset, (b"\xff" + data[1:]) if corrupt and data else data)

    sums = send_dir(src, put, chunk_bytes=chunk)
    meta = store.commit("job-1", "checkpoints", name, receiver, sums, keep_last=keep_last)
    return {"meta": meta, "sent": sent}


def test_artifacts_stream_in_pieces_and_back(tmp_path):
    """A checkpoint moves in pieces of at most `chunk` bytes each way (never whole in memory): stored,
    verified, pruned like a payload; fetched back piece by piece into a verified directory."""
    from smolforge.parallel.transfer import DirReceiver

    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    big = bytes(range(256)) * 41  # 10 496 bytes: three pieces of 4096 and a short one
    (src / "big.bin").write_bytes(big)
    (src / "empty").write_bytes(b"")
    (src / "sub" / "s.json").write_text('{"x": 1}')
    store = ArtifactStore(tmp_path / "art")
    for step in (5, 10, 15):
        out = _stream_into(store, src, f"step-{step}", 4096, keep_last=2)
    assert [o for r, o, n in out["sent"] if r == "big.bin"] == [0, 4096, 8192]
    assert ("empty", 0, 0) in out["sent"] and all(n <= 4096 for _, _, n in out["sent"])
    assert out["meta"]["bytes"] == len(big) + 8
    assert store.list("job-1", "checkpoints") == ["step-10", "step-15"] and store.verify("job-1", "checkpoints", "step-15")
    files = store.manifest("job-1", "checkpoints", "step-15")
    assert files["big.bin"]["bytes"] == len(big) and files["empty"]["bytes"] == 0
    back = DirReceiver(tmp_path / "restored")
    for rel, info in files.items():
        offset = 0
        while True:
            data = store.piece("job-1", "checkpoints", "step-15", rel, offset, 4096)
            back.write(rel, offset, data)
            offset += len(data)
            if not data or offset >= info["bytes"]:
                break
    back.commit({rel: info["sha256"] for rel, info in files.items()})
    assert (tmp_path / "restored" / "big.bin").read_bytes() == big
    assert (tmp_path / "restored" / "empty").read_bytes() == b""
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".restored")]  # no temp dir left


def test_a_streamed_artifact_that_fails_its_checksum_or_escapes_changes_nothing(tmp_path):
    from smolforge.parallel.transfer import DirReceiver

    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "a.bin").write_bytes(b"\x00" * 5000)
    store = ArtifactStore(tmp_path / "art")
    _stream_into(store, src, "step-5", 4096)
    (src / "a.bin").write_bytes(b"\x07" * 5000)
    with pytest.raises(SmolforgeError, match="checksum"):
        _stream_into(store, src, "step-5", 4096, corrupt=True)
    stored = store.path("job-1", "checkpoints", "step-5")
    assert (stored / "a.bin").read_bytes() == b"\x00" * 5000 and store.verify("job-1", "checkpoints", "step-5")
    assert [p.name for p in stored.parent.iterdir() if p.name.startswith(".")] == []  # temp dir gone
    receiver = store.begin("job-1", "checkpoints", "step-6")
    with pytest.raises(SmolforgeError, match="escapes"):
        receiver.write("../escape", 0, b"x")
    with pytest.raises(SmolforgeError, match="expected 0"):
        receiver.write("a.bin", 10, b"x")  # a piece out of order
    receiver.abort()
    assert not (tmp_path / "art" / "job-1" / "checkpoints" / "escape").exists()
    assert not store.path("job-1", "checkpoints", "step-6").exists()
    leftover = DirReceiver(store.path("job-1", "checkpoints", "step-7"))  # an upload cut off by a crash
    leftover.write("a.bin", 0, b"x")
    store.begin("job-1", "checkpoints", "step-7").abort()
    assert [p.name for p in stored.parent.iterdir() if p.name.startswith(".")] == []  # cleared by the next


def test_payload_with_bad_checksum_or_escaping_path_is_refused(tmp_path):
    payload = {"files": {"a": b"hello"}, "sha256": {"a": "0" * 64}}
    with pytest.raises(SmolforgeError, match="checksum"):
        unpack_dir(payload, tmp_path / "x")
    import hashlib

    evil = {"files": {"../escape": b"x"}, "sha256": {"../escape": hashlib.sha256(b"x").hexdigest()}}
    with pytest.raises(SmolforgeError, match="escapes"):
        unpack_dir(evil, tmp_path / "y")
    assert not (tmp_path / "escape").exists()
    with pytest.raises(SmolforgeError, match="bad artifact"):
        ArtifactStore(tmp_path / "s").path("job-1", "..", "x")


# -- auth -----------------------------------------------------------------------------------------

def test_token_created_once_with_owner_only_permissions(tmp_path):
    p = tmp_path / "state" / "token"
    t1 = load_or_create_token(p)
    assert len(t1) == 64 and stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert load_or_create_token(p) == t1
    assert tokens_match(t1, t1) and not tokens_match("x" + t1[1:], t1) and not tokens_match(None, t1)
    assert bearer_of(f"Bearer {t1}") == t1 and bearer_of("Basic abc") is None and bearer_of(None) is None


# -- placement ------------------------------------------------------------------------------------

def _node(name, role="worker", cpus=2, gpus=0, ram=8.0, models=(), alive=True):
    res = {"CPU": float(cpus), "memory": ram * 1e9}
    if gpus:
        res["GPU"] = float(gpus)
    if role == "worker":
        res[ray_glue.WORKER_RESOURCE] = float(cpus)
    if role == "coordinator":
        res[ray_glue.HEAD_RESOURCE] = 1000.0
    for m in models:
        res[ray_glue.model_resource(m)] = 1000.0
    return ray_glue.NodeInfo(node_id=name * 8, name=name, address="127.0.0.1", alive=alive, role=role, cpus=cpus,
                             gpus=gpus, ram_gb=ram, gpu_type="A100" if gpus else None, models=sorted(models),
                             resources=res, available=dict(res),
                             labels={ray_glue.NAME_LABEL: name, ray_glue.ROLE_LABEL: role})


NODES = [_node("coord", role="coordinator", cpus=4, models=("qwen2.5:7b",)),
         _node("cpu1", models=("tiny-copy",)), _node("cpu2", ram=2.0, models=("tiny-copy",)),
         _node("gpu1", gpus=1, ram=32.0, models=("tiny-copy", "qwen2.5:7b"))]


def test_requirements_pick_nodes_and_never_the_coordinator():
    names = lambda req: [n.name for n in req.candidates(NODES)]  # noqa: E731
    assert names(ray_glue.Requirements(model="tiny-copy")) == ["cpu1", "cpu2", "gpu1"]
    assert names(ray_glue.Requirements(model="qwen2.5:7b")) == ["gpu1"]  # coord holds it but takes no work
    assert names(ray_glue.Requirements(model="tiny-copy", gpu="preferred")) == ["gpu1"]
    assert names(ray_glue.Requirements(model="tiny-copy", min_ram_gb=4)) == ["cpu1", "gpu1"]
    assert names(ray_glue.Requirements(allowed_nodes=["cpu2"])) == ["cpu2"]
    assert names(ray_glue.Requirements(on_coordinator=True, model="qwen2.5:7b")) == ["coord"]
    opts = ray_glue.Requirements(model="tiny-copy", min_ram_gb=4).ray_options(NODES)
    assert opts["resources"] == {ray_glue.WORKER_RESOURCE: 1.0, "model:tiny-copy": ray_glue.MODEL_REQUEST}
    assert opts["label_selector"] == {ray_glue.NAME_LABEL: "in(cpu1,gpu1)"} and opts["num_gpus"] == 0
    gpu = ray_glue.Requirements(model="tiny-copy", gpu="required").ray_options(NODES)
    assert gpu["num_gpus"] == 1.0 and "label_selector" not in gpu
    bundle, sel = ray_glue.Requirements(cpus=2).bundle(NODES)
    assert bundle == {"CPU": 2.0, ray_glue.WORKER_RESOURCE: 2.0} and sel == {}


def test_unsatisfiable_requirement_lists_every_node():
    with pytest.raises(SmolforgeError) as err:
        ray_glue.check_placeable(ray_glue.Requirements(model="nobody/has-this"), NODES)
    text = err.value.render()
    assert "no node can run this task" in text and "model nobody/has-this" in text
    for name in ("coord", "cpu1", "cpu2", "gpu1"):
        assert f"  - {name} [" in text
    assert "does not hold model nobody/has-this" in text and "takes no training work" in text
    with pytest.raises(SmolforgeError, match="has no GPU"):
        ray_glue.check_placeable(ray_glue.Requirements(gpu="required", allowed_nodes=["cpu1"]), NODES)
    with pytest.raises(SmolforgeError, match="must be required, preferred or no"):
        ray_glue.Requirements(gpu="maybe")


def test_capacity_check_fails_at_submit(tmp_path):
    mgr = JobManager(JobStore(tmp_path / "j.db"), ArtifactStore(tmp_path / "a"))
    job = DataParallelJob.model_validate({"num_workers": 8, "train": {"model": "tiny-copy", "data": {"path": "bundled"}}})
    with pytest.raises(SmolforgeError, match="needs 8 workers .* room for 6"):
        mgr.check_capacity(job, NODES)
    ok = DataParallelJob.model_validate({"num_workers": 3, "train": {"model": "tiny-copy", "data": {"path": "bundled"}}})
    assert mgr.check_capacity(ok, NODES) == 6
    assert requirements_for(ok).model == "tiny-copy"
    preset = DataParallelJob.model_validate({"train": {"model": "tiny-llama", "data": {"path": "bundled"}}})
    assert requirements_for(preset).model is None  # presets are built offline on any node
    assert slots_on(NODES[1], requirements_for(ok), use_available=True) == 2
    with pytest.raises(SmolforgeError, match="path on the submitting machine"):
        mgr.check_uploads(DataParallelJob.model_validate({"train": {"model": "m", "data": {"path": "/tmp/x.jsonl"}}}))
    with pytest.raises(SmolforgeError, match="unknown job kind"):
        mgr.parse({"kind": "teleport", "train": {}})


def test_distill_job_specs_are_checked_at_submit(tmp_path):
    """kind: distill is validated in full (field names, types, KD and PEFT settings) before anything runs."""
    from smolforge.cluster.control.kinds import apply_job_overrides, stage_spec
    from smolforge.cluster.control.specs import DistillJob

    mgr = JobManager(JobStore(tmp_path / "j.db"), ArtifactStore(tmp_path / "a"))
    base = {"kind": "distill", "mode": "hybrid",
            "distill": {"teacher": "small-llama", "students": ["tiny-llama"], "data": "bundled", "max_steps": 5}}
    job = mgr.parse(base)
    assert isinstance(job, DistillJob)
    assert job.mode == "hybrid" and job.distill.students == ["tiny-llama"] and job.distill.max_steps == 5
    mgr.check_uploads(job)  # 'bundled' needs no upload
    cases = [({"wat": 1}, "unknown distill setting"), ({"max_steps": "many"}, "distill.max_steps"),
             ({"kd_loss": "kl"}, "unknown KD loss"), ({"peft_config": {"r": 0}}, "r: Input should be greater"),
             ({"output_dir": "/elsewhere"}, "unknown distill setting")]
    for extra, message in cases:
        with pytest.raises(SmolforgeError, match=message):
            mgr.parse({**base, "distill": {**base["distill"], **extra}})
    with pytest.raises(SmolforgeError, match="distill.students is required"):
        mgr.parse({"kind": "distill", "distill": {"teacher": "t", "data": "bundled"}})
    with pytest.raises(SmolforgeError, match="path on the submitting machine"):
        mgr.check_uploads(mgr.parse({**base, "distill": {**base["distill"], "data": "/tmp/x.jsonl"}}))
    # --set routes to distill.*; a local data file is uploaded, a missing one named
    spec = apply_job_overrides({**base, "distill": dict(base["distill"])}, ["max_steps=9", "mode=teacher_student"])
    assert spec["distill"]["max_steps"] == 9 and spec["mode"] == "teacher_student"
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1?", "completion": "2"}\n')
    staged = stage_spec({**base, "distill": {**base["distill"], "data": str(data)}}, lambda path: "upload:abc")
    assert staged["distill"]["data"] == "upload:abc"
    with pytest.raises(SmolforgeError, match="does not exist"):
        stage_spec({**base, "distill": {**base["distill"], "data": str(tmp_path / "no.jsonl")}}, lambda path: "x")


# -- discovery ------------------------------------------------------------------------------------

def test_model_discovery(tmp_path):
    cache = tmp_path / "hub"
    snap = cache / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--org--incomplete" / "snapshots").mkdir(parents=True)
    assert scan_hf_cache(cache) == {"Qwen/Qwen2.5-0.5B-Instruct": str(snap)}
    md = tmp_path / "models"
    (md / "tiny-copy").mkdir(parents=True)
    (md / "tiny-copy" / "config.json").write_text("{}")
    (md / "org" / "thing").mkdir(parents=True)
    (md / "org" / "thing" / "config.json").write_text("{}")
    (md / "not-a-model").mkdir()
    assert sorted(scan_models_dir(md)) == ["org/thing", "tiny-copy"]
    aliased = with_aliases(scan_hf_cache(cache))
    assert aliased["qwen2.5:0.5b"] == "alias:Qwen/Qwen2.5-0.5B-Instruct"
    assert parse_ollama_list("NAME ID SIZE MODIFIED\nqwen2.5:0.5b a 1GB now\nllama3.2:latest b 2GB now\n") == \
        ["qwen2.5:0.5b", "llama3.2"]
    assert check_node_name("student-cpu-01") == "student-cpu-01"
    with pytest.raises(SmolforgeError, match="not usable as a label"):
        check_node_name("bad name!")


# -- specs and overrides --------------------------------------------------------------------------

def test_job_overrides_route_to_train_section(tmp_path):
    from smolforge.cluster.control.kinds import apply_job_overrides, stage_spec

    spec = {"kind": "data_parallel", "train": {"model": "m", "data": {"path": "bundled"}}}
    apply_job_overrides(spec, ["num_workers=3", "training.batch_size=16", "lr=0.01", "train.data.max_length=64"])
    assert spec["num_workers"] == 3 and spec["train"]["batch_size"] == 16 and spec["train"]["lr"] == 0.01
    assert spec["train"]["data"]["max_length"] == 64
    with pytest.raises(SmolforgeError, match="key=value"):
        apply_job_overrides(spec, ["oops"])
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    spec["train"]["data"]["path"] = str(f)
    staged = stage_spec(spec, lambda p: "upload:" + "f" * 64)
    assert staged["train"]["data"]["path"] == "upload:" + "f" * 64
    spec["train"]["data"]["path"] = str(tmp_path / "missing.jsonl")
    with pytest.raises(SmolforgeError, match="does not exist"):
        stage_spec(spec, lambda p: "")


def test_node_state_from_heartbeats():
    from smolforge.cluster.nodes.node_agent import node_state

    now = time.time()
    assert node_state(False, now, now - 100, now) == "dead"
    assert node_state(True, now - 1, now - 100, now) == "online"
    assert node_state(True, now - 60, now - 100, now) == "stale"
    assert node_state(True, None, now - 1, now) == "joining"


def test_head_ports_are_distinct_and_never_the_gcs_port():
    """`ray start --head` refuses two components on one port; CI once got the GCS port (picked by
    the caller, free but not yet bound) back as the client-server port."""
    from smolforge.cluster.nodes.ray_process import head_command
    from smolforge.cluster.nodes.statedir import free_port, free_ports

    promised = free_port()
    ports = free_ports(30, exclude={promised})
    assert len(set(ports)) == 30 and promised not in ports
    for _ in range(20):
        cmd = head_command(promised, cpus=1, node_ip=None, name="h", resources={}, labels={})
        chosen = [int(cmd[i + 1]) for i, a in enumerate(cmd) if a.endswith("-port") and a != "--port"]
        assert len(chosen) == 6 and len(set(chosen)) == 6 and promised not in chosen, cmd


# -- distill task status ----------------------------------------------------------------------------

def test_a_student_that_ends_before_its_progress_is_drained_still_reports_its_last_step():
    """Progress is taken only while a student runs; a quick one ends first (seen in CI: its TensorBoard
    series never written). Its result carries the last step and loss, and the status shows them."""
    from smolforge.cluster.workloads.distill.state import DistillTask

    task = DistillTask(task_id="student-1", kind="student", store="s", state="completed", max_steps=3)
    task.take_last_step({"steps": 3, "final_loss": 2.5})
    assert (task.status()["step"], task.status()["loss"]) == (3, 2.5)
    task.take_last_step({"steps": 1, "final_loss": 9.0})  # never back to an earlier step
    assert (task.step, task.loss) == (3, 2.5)


def test_a_refusal_does_not_tell_whether_a_path_exists_on_the_coordinator(tmp_path, monkeypatch):
    """A model a client names gets the same refusal whether or not a directory of that name exists where
    the coordinator runs (issue 43: it was an existence oracle): the fix is chosen from the name's shape
    (a path: `/`, `.`, `~`), never from the coordinator's filesystem."""
    def fix(model: str) -> str:
        with pytest.raises(SmolforgeError) as err:
            ray_glue.check_placeable(ray_glue.Requirements(model=model), NODES)
        return err.value.fix

    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret-model").mkdir()
    assert fix("secret-model").replace("secret-model", "M") == fix("other-model").replace("other-model", "M")
    assert "directory on this machine" not in fix("secret-model")
    assert "directory on this machine" in fix(str(tmp_path / "no-such-model"))


def test_wait_for_a_running_job_waits_on_its_runners_end_not_in_a_sleep_loop(tmp_path, monkeypatch):
    """The embedded CLI's wait (`smolforge distill`, `train` without a coordinator) is one wait on the
    job's runner's `finished` event while the runner runs (issue 42: no polling loop left there); it
    looks at the job once before and once after."""
    import threading

    store = JobStore(tmp_path / "j.db")
    mgr = JobManager(store, ArtifactStore(tmp_path / "a"))
    job_id = store.create_job("data-parallel", {"kind": "data-parallel"})
    store.set_state(job_id, "running", force=True)
    waits: list[float | None] = []

    class Finished(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            if len(waits) == 1:  # the runner ends while the caller waits on it
                store.set_state(job_id, "completed", force=True)
                self.set()
            return super().wait(timeout)

    class Runner:  # what `wait` reads of a JobRunner
        def __init__(self) -> None:
            self.finished = Finished()

        def is_alive(self) -> bool:
            return not self.finished.is_set()

    mgr.runners[job_id] = Runner()
    looks: list[str] = []
    real_job = mgr._job
    monkeypatch.setattr(mgr, "_job", lambda jid: looks.append(jid) or real_job(jid))
    job = mgr.wait(job_id, timeout=5.0)
    assert job["state"] == "completed"
    assert len(waits) == 1 and waits[0] > 0 and looks == [job_id, job_id]
    # with a progress callback: woken every WAIT_LOOK_S for it, and at once by the runner's end
    progress: list[str] = []
    job_id = store.create_job("data-parallel", {"kind": "data-parallel"})
    store.set_state(job_id, "running", force=True)
    mgr.runners[job_id] = Runner()
    waits.clear()
    mgr.wait(job_id, timeout=5.0, on_update=lambda j: progress.append(j["state"]))
    assert waits == [0.5] and progress == ["running", "completed"]


@pytest.mark.parametrize("code,body,needle", [
    (404, "", "answered HTTP 404 to the coordinator's token check: no smolforge coordinator is there"),
    (503, "busy\n  try later", "answered HTTP 503 (busy try later) to the coordinator's token check"),
], ids=["404 nothing there", "503 busy"])
def test_an_address_that_answers_but_not_as_a_coordinator_is_named_with_the_fix(monkeypatch, code, body, needle):
    """`worker join --sollol-host 192.168.1.100` where something else answers HTTP (a sandbox's network, another
    service on the port): one message with what answered and where the coordinator's address comes from."""
    import httpx

    from smolforge.cluster.nodes import worker

    monkeypatch.setattr(httpx, "get", lambda url, **_: httpx.Response(code, text=body))
    with pytest.raises(SmolforgeError) as info:
        worker.check_coordinator("192.168.1.100", 5000, "t0ken")
    assert info.value.where == "http://192.168.1.100:5000" and info.value.what == needle, info.value.what
    assert "smolforge coordinator start" in info.value.fix and "--port" in info.value.fix
    assert ("no smolforge coordinator" in info.value.what) == (code == 404)  # a busy coordinator is not "none"


def test_an_embedded_ray_that_does_not_start_is_one_message_exit_1(tmp_path):
    """Ray gives its node a fixed 30 s to register (a loaded 2-core box missed it in a seed line's run) and
    raises a bare Exception: the CLI says so once, naming Ray's logs, exit 1 (ours, not the caller's)."""
    asked: list[dict] = []

    def init(**kwargs):
        asked.append(kwargs)
        raise Exception("The current node timed out during startup. This could happen because some of the "
                        "raylet failed to startup or the GCS has become overloaded.")

    with pytest.raises(ray_glue.RayStartFailed) as info:
        ray_glue.start_embedded(init, {"num_cpus": 2, "_temp_dir": str(tmp_path)})
    assert asked == [{"num_cpus": 2, "_temp_dir": str(tmp_path)}] and info.value.exit_code == 1
    assert info.value.what.startswith("the embedded Ray cluster did not start: Exception: The current node timed out")
    assert str(tmp_path / "session_latest" / "logs") in info.value.fix
