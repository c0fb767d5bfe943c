"""The coordinator's API under a fuzzer. schemathesis generates requests from the OpenAPI schema
FastAPI builds for it, valid ones and invalid ones (numbers out of range, wrong types, odd strings,
bodies that are not the model), sends them with the token to the app in this process over a real job
store (jobs, events, logs, metrics and an artifact in it), and holds every answer to the schema: no
5xx, a status the schema lists, a body of the documented shape (our `{"error", "where", "fix"}` on
every refusal), and invalid input refused with a 4xx. Ray stays off: the node table is one fake node
that takes no work, so no generated spec can start a job.

The CI tier runs a fixed seed and a bounded number of examples per route; the soak tier many more."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

TOKEN = "fuzz-token-of-issue-28"
SEED = 2828
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "negative_data_rejection"]


def _seeded_core(root):
    """A CoordinatorCore over a real store, artifacts and job manager, with jobs in several states."""
    from smolforge.cluster.control.artifacts import ArtifactStore
    from smolforge.cluster.coordinator import CoordinatorCore
    from smolforge.cluster.control.kinds import parse
    from smolforge.cluster.control.jobstore import JobStore
    from smolforge.cluster.control.manager import JobManager
    from smolforge.cluster.nodes.node_agent import NodeMonitor
    from smolforge.cluster.nodes.statedir import StateDir

    state = StateDir.at(root / "state")
    store, artifacts = JobStore(state.db_path), ArtifactStore(state.artifacts)
    spec = parse({"kind": "data_parallel", "num_workers": 1, "train": {"model": "tiny-llama", "data": {"path": "bundled"},
                                                                        "max_steps": 4}}).model_dump(mode="json")
    for name, st in (("fuzz-paused", "paused"), ("fuzz-done", "completed"), ("fuzz-running", "running")):
        job = store.create_job("data_parallel", spec, name=name)
        if st != "pending":
            store.set_state(job, st, st, force=True)
        store.add_event(job, "note", f"{name} seeded", {"k": 1})
        store.add_logs(job, [{"task": "r0", "node": "n1", "line": "step 1 loss 2.0"}])
        store.add_metrics(job, [(1, "loss", 2.0)])
        store.upsert_task(f"{job}-g0-r0", job, "dp_rank", "running", rank=0, node_name="n1")
    adapter = root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    artifacts.put_dir(job, "adapter", "lora_adapter", adapter)
    monitor = NodeMonitor("http://127.0.0.1:9", TOKEN, store)  # never started: heartbeats only
    # ray_tls: the certificate route signs what it is sent (this cluster's CA is made on first use)
    info = {"name": "fuzz", "api": "http://127.0.0.1:9", "version": "test", "node_id": "n1", "ray_tls": True}
    return CoordinatorCore(state, TOKEN, store, artifacts, JobManager(store, artifacts), monitor, info)


def _fake_nodes(include_dead: bool = False):
    from smolforge.cluster.nodes.ray_glue import NodeInfo

    return [NodeInfo(node_id="n1", name="coordinator", address="127.0.0.1", alive=True, role="coordinator", cpus=2,
                     gpus=0, ram_gb=4.0, gpu_type=None, models=[], resources={"CPU": 2.0}, available={"CPU": 2.0})]


def _no_ray(*args, **kwargs):
    raise AssertionError("the fuzzed coordinator must not start Ray")


def _schema():
    """The schema of the coordinator's routes, from an app whose core is never touched (the routes are
    the same for every core); the fixture below points it at a real one. Built at import: the lazy
    `schemathesis.pytest.from_fixture` does not run under pytest 9."""
    from smolforge.cluster.api import create_app

    loaded = schemathesis.openapi.from_dict(create_app(None).openapi())
    loaded.config.seed = SEED
    loaded.config.update(headers={"Authorization": f"Bearer {TOKEN}"})
    loaded.config.checks.update(included_check_names=CHECKS)
    loaded.config.generation.update(database="none")
    return loaded


schema = _schema()
FUZZ = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    """An in-process client of the coordinator's app over a seeded store, with Ray replaced by one
    node that takes no work."""
    from schemathesis.python.asgi import get_client

    from smolforge.cluster.nodes import ray_glue
    from smolforge.cluster.api import create_app

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray_glue, "nodes", _fake_nodes)
        mp.setattr(ray_glue, "connect", _no_ray)
        app = create_app(_seeded_core(tmp_path_factory.mktemp("coordinator")))
        with get_client(app) as client:
            yield client


@schema.parametrize()
@settings(max_examples=40, **FUZZ)
def test_every_route_answers_fuzzed_requests_within_its_schema(case, coordinator):
    case.call_and_validate(session=coordinator, headers={"Authorization": f"Bearer {TOKEN}"})


@pytest.mark.soak
@schema.parametrize()
@settings(max_examples=400, **FUZZ)
def test_every_route_answers_many_fuzzed_requests_within_its_schema(case, coordinator):
    case.call_and_validate(session=coordinator, headers={"Authorization": f"Bearer {TOKEN}"})


HOSTILE = [  # (method, path, body bytes or None, what the 400 says): the review's findings, one each
    ("GET", "/api/v1/jobs?limit=-1", None, "greater than or equal to 1"),
    ("GET", f"/api/v1/jobs?limit={2**70}", None, "less than or equal to 5000"),
    ("GET", f"/api/v1/events?since={2**64}", None, "less than or equal to"),
    ("GET", "/api/v1/jobs?state=runing", None, "unknown job state 'runing'"),
    ("GET", "/api/v1/jobs/fuzz-done/logs?task=r0%27%3B", None, "should match pattern"),
    ("POST", "/api/v1/jobs", b'{"kind": "data_parallel",', "the body is not valid JSON"),
    ("POST", "/api/v1/jobs", b'{"train": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper than 32 levels"),
    ("POST", "/api/v1/jobs", b'{"a": ' + b"[" * 500 + b"]" * 500 + b"}", "nests deeper than 32 levels"),
    ("POST", "/api/v1/nodes/n1/heartbeat", b'{"ts": NaN}', "finite number"),
    ("POST", "/api/v1/jobs/fuzz-running/join", b'{"node": ["a"]}', "valid string"),
    ("GET", "/api/v1/logs?grep=a%7B100000000%7D&regex=true", None, "too large to search with"),
]


NAMES = ["limit -1", "limit 2**70", "since 2**64", "an unknown state", "a task name with a quote", "invalid JSON",
         "JSON 100 000 deep", "JSON 500 deep", "NaN in a heartbeat", "a node name that is a list",
         "a log pattern whose compile never ends"]


@pytest.mark.parametrize("method,path,body,needle", HOSTILE, ids=NAMES)
def test_hostile_requests_get_our_400(coordinator, method, path, body, needle):
    """Each finding of the review as one request: a 400 in our shape (never a 5xx, FastAPI's 422 or a
    list of every job), and the service answers normally afterwards."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    r = coordinator.request(method, f"http://testserver{path}", data=body, headers=headers)
    assert r.status_code == 400, (path, r.status_code, r.text[:300])
    assert set(r.json()) == {"error", "where", "fix"} and needle in r.json()["error"], r.json()
    assert coordinator.get("http://testserver/api/v1/jobs", headers=headers).status_code == 200


def test_the_schema_is_served_with_the_token_and_lists_our_errors(coordinator):
    r = coordinator.get("http://testserver/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    responses = r.json()["paths"]["/api/v1/jobs"]["get"]["responses"]
    assert r.status_code == 200 and "400" in responses and "422" not in responses
    assert coordinator.get("http://testserver/openapi.json").status_code == 401
