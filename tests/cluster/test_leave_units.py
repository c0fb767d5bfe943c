"""`job leave` refused with one message, no cluster needed: the manager's checks (unknown job, a job
not running, a kind that cannot shed a node), the data-parallel runner's (a node not lent, one already
leaving, the group's last member), the API's 4xx and the command's exit 2. What a leave does to a
running job is tested on the real cluster (tests/cluster/test_cluster.py, `test_a_lent_node_leaves_*`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.control.kinds import parse
from smolforge.cluster.control.manager import JobManager
from smolforge.cluster.control.placement import COORDINATOR
from smolforge.cluster.nodes.statedir import StateDir
from smolforge.cluster.workloads.data_parallel.runner import DPRunner
from smolforge.errors import SmolforgeError

SPEC = {"kind": "data_parallel", "num_workers": 2, "train": {"model": "tiny-llama", "data": {"path": "bundled"},
                                                              "max_steps": 4, "batch_size": 3}}


def _manager(root) -> JobManager:
    return JobManager(JobStore(root / "jobs.db"), ArtifactStore(root / "art"))


def _running(mgr: JobManager, lent=(COORDINATOR,)) -> tuple[str, DPRunner]:
    """A running data-parallel job with a runner that never starts (no Ray): its checks are the real ones."""
    spec = parse({**SPEC, "lent_nodes": list(lent)})
    job_id = mgr.store.create_job("data_parallel", spec.model_dump(mode="json"))
    mgr.store.set_state(job_id, "running", "running")
    mgr.specs[job_id] = spec
    runner = mgr.runners[job_id] = DPRunner(mgr.context, job_id, spec, "test")
    return job_id, runner


def test_a_leave_is_refused_for_an_unknown_job_a_job_not_running_and_a_kind_without_lent_nodes(tmp_path):
    mgr = _manager(tmp_path)
    with pytest.raises(SmolforgeError, match="no job"):
        mgr.leave("job-nope")
    paused = mgr.store.create_job("data_parallel", parse(SPEC).model_dump(mode="json"))
    mgr.store.set_state(paused, "paused", "paused", force=True)
    with pytest.raises(SmolforgeError, match="is paused; nodes leave running jobs only") as err:
        mgr.leave(paused)
    assert f"smolforge job resume {paused}" in err.value.fix and f"smolforge job cancel {paused}" in err.value.fix
    for kind, label in (("serve", "serving"), ("export", "export"), ("distill", "distillation")):
        job = mgr.store.create_job(kind, {})
        mgr.store.set_state(job, "running", "running")
        with pytest.raises(SmolforgeError, match=rf"is a {label} job \(kind {kind}\): it cannot shed a node") as err:
            mgr.leave(job)
        assert "smolforge job cancel" in err.value.fix


def test_only_a_lent_node_that_is_not_the_last_member_can_leave(tmp_path):
    mgr = _manager(tmp_path)
    job_id, runner = _running(mgr)
    with pytest.raises(SmolforgeError, match=r"w9 is not a node lent to job .* \(lent: the coordinator\)") as err:
        mgr.leave(job_id, "w9")
    assert err.value.where == "--node" and "job join" in err.value.fix
    # the group is down to the coordinator's rank (its workers were lost): it cannot leave
    runner.training, runner.members = True, {2: COORDINATOR}
    with pytest.raises(SmolforgeError, match="the coordinator runs job .*'s last member") as err:
        mgr.leave(job_id)
    assert f"smolforge job pause {job_id}" in err.value.fix and f"smolforge job cancel {job_id}" in err.value.fix
    assert runner.spec.lent_nodes == [COORDINATOR]  # a refused leave changes nothing
    assert "leave_requested" not in [e["kind"] for e in mgr.store.events(job_id)]


def test_a_leave_before_placement_drops_the_node_from_the_spec_and_a_second_one_is_refused(tmp_path):
    mgr = _manager(tmp_path)
    job_id, runner = _running(mgr, lent=(COORDINATOR, "w3"))
    mgr.leave(job_id, "w3")
    assert runner.spec.lent_nodes == [COORDINATOR] and runner.left == {"w3"}  # kept off this job's placements
    assert mgr.store.get_job(job_id)["spec"]["lent_nodes"] == [COORDINATOR]  # a restart places without it
    with pytest.raises(SmolforgeError, match="w3 is already leaving job"):
        mgr.leave(job_id, "w3")
    with pytest.raises(SmolforgeError, match="w3 is leaving job"):
        mgr.join(job_id, "w3")
    # taken out as the next group is placed: one member_left event saying where
    runner.take_leaves("placement", None, "before the group was placed")
    left = [e["data"] for e in mgr.store.events(job_id) if e["kind"] == "member_left"]
    assert left == [{"node": "w3", "boundary": "placement", "step": None}], left


def test_a_node_still_waiting_to_join_has_its_join_withdrawn(tmp_path):
    mgr = _manager(tmp_path)
    job_id, runner = _running(mgr, lent=())
    runner.pending_joins.append("w3")
    mgr.leave(job_id, "w3")
    assert runner.pending_joins == [] and runner.spec.lent_nodes == []
    left = [e["data"] for e in mgr.store.events(job_id) if e["kind"] == "member_left"]
    assert left == [{"node": "w3", "boundary": "before it joined", "step": None}], left


def test_the_api_answers_a_refused_leave_with_a_4xx_in_the_error_shape(tmp_path):
    from fastapi.testclient import TestClient

    from smolforge.cluster.api import create_app

    mgr = _manager(tmp_path)
    job_id, _ = _running(mgr)
    core = SimpleNamespace(token="t", manager=mgr, store=mgr.store, artifacts=mgr.artifacts)
    http = TestClient(create_app(core))
    auth = {"Authorization": "Bearer t"}
    missing = http.post("/api/v1/jobs/job-nope/leave", headers=auth, json={"node": None})
    assert missing.status_code == 404 and missing.json()["error"].startswith("no job"), missing.text
    stranger = http.post(f"/api/v1/jobs/{job_id}/leave", headers=auth, json={"node": "w9"})
    assert stranger.status_code == 400 and set(stranger.json()) == {"error", "where", "fix"}, stranger.text
    assert "not a node lent" in stranger.json()["error"]
    bad = http.post(f"/api/v1/jobs/{job_id}/leave", headers=auth, json={"node": "no such/node"})
    assert bad.status_code == 400 and "node" in bad.json()["where"], bad.text


def test_the_command_refuses_with_one_message_and_exit_2(tmp_path):
    from smolforge.cli.main import app

    store = JobStore(StateDir.at(tmp_path / "embedded").db_path)  # the embedded cluster's, under $SMOLFORGE_HOME
    serving = store.create_job("serve", {})
    store.close()
    env = {"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None, "SMOLFORGE_HOME": str(tmp_path)}
    for job, needle in (("job-nope", "no job"), (serving, "is a serving job (kind serve)")):
        result = CliRunner().invoke(app, ["job", "leave", job, "--state-dir", str(tmp_path), "--json"], env=env)
        err = result.stderr
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exception, result.output)
        assert err.startswith("error:") and err.count("error:") == 1 and needle in err and "\n  fix:" in err, err
        assert "Traceback" not in result.output
