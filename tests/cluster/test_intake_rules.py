"""Input checked where it enters, by kind (issue 43, item 2): a lone surrogate, a NUL byte and an
over-long string at every intake of the coordinator's API are a 400 in the error shape that names the
field, nothing is stored, and the listings stay 200; a row already stored that cannot be shown (written
before the rules, or by hand) is listed as damaged, and `job delete` (CLI and route) removes it.

The app runs in this process over the fuzz test's seeded store, with Ray replaced by one fake node
(tests/cluster/test_coordinator_fuzz.py): no job can start."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
from typer.testing import CliRunner

from test_coordinator_fuzz import TOKEN, _fake_nodes, _no_ray, _seeded_core

H = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
BAD = {"a lone surrogate": ("\\ud800", "not UTF-8 text"), "a NUL byte": ("\\u0000", "holds a NUL byte"),
       "an over-long string": ("x" * 5000, "characters long (at most")}
# every route that takes a body, with a string the spec or model keeps: (method, path, JSON template, where)
INTAKES = [
    ("POST", "/api/v1/jobs", '{"kind": "data_parallel", "num_workers": 1, "train": {"model": "tiny-llama%s", '
                             '"data": {"path": "bundled"}, "max_steps": 2}}', "body.train.model"),
    ("POST", "/api/v1/jobs", '{"kind": "export", "model": "tiny-llama%s"}', "body.model"),
    ("POST", "/api/v1/jobs", '{"kind": "serve", "model": "tiny-llama", "model_name": "m%s"}', "body.model_name"),
    ("POST", "/api/v1/jobs", '{"kind": "export", "model": "tiny-llama", "name": "n%s"}', "body.name"),
    ("POST", "/api/v1/jobs", '{"kind": "export", "model": "tiny-llama", "k%s": 1}', "body"),
    ("POST", "/api/v1/nodes/n1/heartbeat", '{"ts": 1.0, "hostname": "h%s"}', "body.hostname"),
    ("POST", "/api/v1/jobs/fuzz-running/join", '{"node": "w%s"}', "body.node"),
    ("POST", "/api/v1/jobs/fuzz-running/leave", '{"node": "w%s"}', "body.node"),
    ("POST", "/api/v1/ray-tls/certificate", '{"csr": "c%s"}', "body.csr"),
]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from fastapi.testclient import TestClient

    from smolforge.cluster.api import create_app
    from smolforge.cluster.nodes import ray_glue

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray_glue, "nodes", _fake_nodes)
        mp.setattr(ray_glue, "connect", _no_ray)
        core = _seeded_core(tmp_path_factory.mktemp("intake"))
        with TestClient(create_app(core), raise_server_exceptions=False) as client:
            client.core = core
            yield client


def _listings_answer(http) -> None:
    for path in ("/api/v1/jobs", "/api/v1/status", "/api/v1/events"):
        r = http.get(path, headers=H)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_text_at_every_intake_is_400_naming_the_field_and_nothing_is_stored(http, bad):
    value, needle = BAD[bad]
    before = len(http.core.store.list_jobs())
    for method, path, template, where in INTAKES:
        r = http.request(method, path, content=(template % value).encode(), headers=H)
        assert r.status_code == 400, (bad, path, r.status_code, r.text[:300])
        body = r.json()
        assert set(body) == {"error", "where", "fix"} and needle in body["error"], (bad, path, body)
        assert body["where"] == where or (where == "body" and "the key" in body["error"]), (bad, path, body)
    for path in ("/api/v1/jobs?state=running%00", "/api/v1/jobs/fuzz-done/logs?task=r0%00",
                 "/api/v1/jobs/fuzz-done/artifacts/adapter/lora_adapter/a%00b"):  # query and path values
        if bad == "a NUL byte":
            r = http.get(path, headers=H)
            assert r.status_code == 400 and "NUL" in r.json()["error"], (path, r.text[:300])
    assert len(http.core.store.list_jobs()) == before
    _listings_answer(http)


def test_a_model_name_no_file_system_takes_is_400_without_the_path(http):
    """256 characters pass the text rule but no file system takes the name: a 400 in the error shape (it
    was a plain-text 500 from the capacity check's OSError)."""
    spec = {"kind": "data_parallel", "num_workers": 1, "train": {"model": "a" * 256, "data": {"path": "bundled"}}}
    r = http.post("/api/v1/jobs", json=spec, headers=H)
    assert r.status_code == 400 and set(r.json()) == {"error", "where", "fix"}, r.text[:300]
    # placement reads the name as a name (never asks the file system whether such a path exists: that was
    # an existence oracle), so no node holding it is the refusal
    assert "no node can run this task" in r.json()["error"], r.text[:300]
    for bad in ({"model": "m", "data": {"path": "bundled"}, "epochs": "Infinity"},
                {"model": "m", "data": {"path": "bundled"}, "seed": 2**80}):
        r = http.post("/api/v1/jobs", json={"kind": "data_parallel", "train": bad}, headers=H)
        assert r.status_code == 400 and "train." in f"{r.json()['where']} {r.json()['error']}", r.text[:300]
    _listings_answer(http)


def _damage(db_path, job_id: str, name: bytes, spec: str) -> None:
    """A row as an older coordinator (or a hand) wrote it: not UTF-8, or JSON holding a lone surrogate."""
    db = sqlite3.connect(db_path)
    db.execute("INSERT INTO jobs (id, name, kind, state, spec, created, updated) VALUES (?, CAST(? AS TEXT), "
               "'export', 'completed', ?, ?, ?)", (job_id, name, spec, time.time(), time.time()))
    db.execute("INSERT INTO events (job_id, ts, kind, message, data) VALUES (?, ?, 'submitted', 'x', ?)",
               (job_id, time.time(), json.dumps({"name": "tiny-llama\ud800"})))
    db.commit()
    db.close()


def test_a_damaged_row_is_listed_as_damaged_and_the_route_deletes_it(http):
    _damage(http.core.store.path, "job-damaged001", b"caf\xe9", json.dumps({"model": "tiny-llama\ud800"}))
    _listings_answer(http)
    listed = {j["id"]: j for j in http.get("/api/v1/jobs", headers=H).json()}
    assert "name is not UTF-8" in listed["job-damaged001"]["damaged"], listed["job-damaged001"]
    assert http.get("/api/v1/jobs/job-damaged001", headers=H).status_code == 200
    running = http.delete("/api/v1/jobs/fuzz-running", headers=H)
    assert running.status_code == 400 and "smolforge job cancel" in running.json()["fix"], running.text
    assert http.delete("/api/v1/jobs/job-damaged001").status_code == 401  # the token, like every route
    gone = http.delete("/api/v1/jobs/job-damaged001", headers=H)
    assert gone.status_code == 200 and gone.json() == {"job_id": "job-damaged001", "deleted": True}, gone.text
    assert "job-damaged001" not in {j["id"] for j in http.get("/api/v1/jobs", headers=H).json()}
    assert not http.core.store.events("job-damaged001")


def test_the_commands_list_a_damaged_job_and_job_delete_removes_it(tmp_path):
    from smolforge.cli.main import app
    from smolforge.cluster.control.jobstore import JobStore
    from smolforge.cluster.nodes.statedir import StateDir

    store = JobStore(StateDir.at(tmp_path / "embedded").db_path)  # the embedded cluster's, under $SMOLFORGE_HOME
    running = store.create_job("export", {"kind": "export", "model": "tiny-llama"})
    store.set_state(running, "running", "running")
    store.close()
    _damage(StateDir.at(tmp_path / "embedded").db_path, "job-damaged002", b"n", '{"model": "tiny-llama\\ud800"}')
    env = {"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None, "SMOLFORGE_HOME": str(tmp_path)}

    def cli(*argv):
        return CliRunner().invoke(app, [*argv, "--state-dir", str(tmp_path)], env=env)

    listed = cli("jobs")
    assert listed.exit_code == 0 and "damaged" in listed.stdout and "job-damaged002" in listed.stdout, listed.output
    refused = cli("job", "delete", running)
    assert refused.exit_code == 2 and refused.stderr.startswith("error:") and "cancel it first" in refused.stderr
    deleted = cli("job", "delete", "job-damaged002")
    assert deleted.exit_code == 0 and "deleted" in deleted.stdout, deleted.output
    assert "job-damaged002" not in cli("jobs", "--json").stdout


def test_a_spec_value_the_coordinator_refuses_comes_back_at_its_file_line(http, tmp_path, monkeypatch):
    """A value only the coordinator checks (the kind's `check`: distill's KD loss) is a 400 that names the
    field as the spec's key path (`field`); `smolforge submit FILE --coordinator ...` prints that key's
    `FILE:LINE` (`config.placed`, on the client), where the coordinator only knew the parsed JSON; one
    across settings names each (`fields`). The CLI's Client talks to this module's in-process app (its HTTP
    client swapped for the TestClient)."""
    text = "kind: distill\ndistill:\n  teacher: tiny-llama\n  students: [tiny-llama]\n  data: bundled\n  kd_loss: kl\n"
    job = {"kind": "distill", "distill": {"teacher": "tiny-llama", "students": ["tiny-llama"], "data": "bundled",
                                          "kd_loss": "kl"}}
    before = len(http.core.store.list_jobs())
    r = http.post("/api/v1/jobs", json=job, headers=H)
    assert r.status_code == 400 and r.json()["field"] == ["distill", "kd_loss"], r.text[:300]
    assert "unknown KD loss 'kl'" in r.json()["error"]
    import httpx

    from smolforge.cli.main import app

    def request(method, path, **kw):  # the Client's own token header is this module's
        return http.request(method, path, **{**kw, "headers": {**H, **(kw.get("headers") or {})}})

    monkeypatch.setattr(httpx, "Client", lambda *a, **k: type("Shared", (), {"request": staticmethod(request),
                                                                            "close": lambda self: None})())
    spec = tmp_path / "job.yaml"
    spec.write_text(text)
    res = CliRunner().invoke(app, ["submit", str(spec), "--coordinator", "127.0.0.1:5999", "--token", TOKEN],
                             env={"SMOLFORGE_COORDINATOR": ""})
    assert res.exit_code == 2, (res.exit_code, res.output[-2000:], res.exception)
    assert res.stderr.startswith(f"error: {spec}:6: unknown KD loss 'kl'") and "fix:" in res.stderr, res.stderr
    # A refusal across two settings names both (`fields`, the one to change first leading): at the line of
    # the first the file wrote; here `eval` came from --set, so the file's `eval_data` line.
    r = http.post("/api/v1/jobs", json={**job, "distill": {**job["distill"], "kd_loss": "forward_kl", "eval": False,
                                                            "eval_data": "bundled"}}, headers=H)
    assert r.status_code == 400 and r.json()["fields"] == [["distill", "eval"], ["distill", "eval_data"]], r.text[:300]
    spec.write_text(text.replace("kd_loss: kl", "eval_data: bundled"))
    res = CliRunner().invoke(app, ["submit", str(spec), "--set", "eval=false", "--coordinator", "127.0.0.1:5999",
                                   "--token", TOKEN], env={"SMOLFORGE_COORDINATOR": ""})
    assert res.exit_code == 2, (res.exit_code, res.output[-2000:], res.exception)
    assert res.stderr.startswith(f"error: {spec}:6: --eval-data names a held-out file, but --no-eval"), res.stderr
    assert len(http.core.store.list_jobs()) == before
