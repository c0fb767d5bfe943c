"""The failure policy applies to every kind (issue 29): a serve job whose stages fail to start once, and
an export job whose task's process dies once, are each tried again by the base runner's FailurePolicy
(a `recovering` event with the policy's reason, `attempts` 1) and end as they would have without the
fault. On the session's shared cluster (coordinator + w1, w2, each holding tiny-copy).

The faults are one-shot (`train.faults.fault_once`): each node's directory names one ticket file, and
the one attempt that removes it fails, wherever it lands; the retry finds no ticket.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

NODES = ("coordinator", "w1", "w2")


@pytest.fixture
def fault(module_cluster):
    """fault(name) -> the ticket: one attempt anywhere on the cluster fails (`fault_once`)."""
    written: list[Path] = []

    def arm(name: str) -> Path:
        ticket = module_cluster.base / f"ticket-{name}"
        ticket.write_text("once")
        for node in NODES:  # (the coordinator's node directory is in its state dir)
            where = module_cluster.c.state if node == "coordinator" else module_cluster.base / f"node-{node}"
            setting = where / "node" / f"fault-{name}"
            setting.parent.mkdir(parents=True, exist_ok=True)
            setting.write_text(str(ticket))
            written.append(setting)
        return ticket

    yield arm
    for path in written:
        path.unlink(missing_ok=True)


def wait_for(client, job_id: str, what: str, done, timeout: float = 300) -> dict:
    """Poll the job until `done(status, events)` (a hang guard, not a timing); its timeline if not."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st, events = client.get_job_status(job_id), client.job_events(job_id)
        if done(st, events):
            return st
        time.sleep(0.3)
    raise AssertionError(f"job {job_id}: no {what} within {timeout} s\n" + timeline(client.job_events(job_id)))


def timeline(events: list[dict]) -> str:
    return "\n".join(f"{e['kind']}: {e['message']}" for e in events)


def kinds_of(events: list[dict]) -> list[str]:
    return [e["kind"] for e in events]


def test_a_serve_job_whose_stages_fail_to_start_once_is_started_again(module_cluster, fault):
    client = module_cluster.c.client()
    ticket = fault("serve-start-fail")
    job_id = client.submit_job({"kind": "serve", "model": "tiny-copy", "stages": 1, "port": 0})
    wait_for(client, job_id, "serving", lambda st, ev: "serving" in kinds_of(ev) or st["state"] in ("failed",
                                                                                                     "cancelled"))
    events = client.job_events(job_id)
    kinds, story = kinds_of(events), timeline(events)
    st = client.get_job_status(job_id)
    assert st["state"] == "running" and st["attempts"] == 1, (st, story)
    assert not ticket.exists()  # the fault fired, once
    recovering = [e for e in events if e["kind"] == "recovering"]
    assert len(recovering) == 1, story
    assert "the stages did not start" in recovering[0]["message"] and "fault injection" in recovering[0]["message"]
    assert "retry 1 of 2" in recovering[0]["message"], story
    assert kinds.index("recovering") < kinds.index("serving") <= kinds.index("recovered") - 1, story
    client.cancel_job(job_id)
    st = wait_for(client, job_id, "cancel", lambda st, ev: st["state"] in ("cancelled", "failed", "completed"), 120)
    assert st["state"] == "cancelled", st


def test_an_export_job_whose_task_dies_once_is_run_again_and_completes(module_cluster, fault):
    client = module_cluster.c.client()
    ticket = fault("export-fail")
    job_id = client.submit_job({"kind": "export", "model": "tiny-copy", "to": "hf"})
    st = wait_for(client, job_id, "final state", lambda st, ev: st["state"] in ("completed", "failed", "cancelled"))
    events = client.job_events(job_id)
    kinds, story = kinds_of(events), timeline(events)
    assert st["state"] == "completed" and st["attempts"] == 1, (st, story)
    assert not ticket.exists()
    recovering = [e for e in events if e["kind"] == "recovering"]
    assert len(recovering) == 1 and "the export task failed" in recovering[0]["message"], story
    assert "retry 1 of 2" in recovering[0]["message"], story
    assert kinds.index("recovering") < kinds.index("recovered") < kinds.index("exported"), story
    assert [a["name"] for a in client.list_artifacts(job_id) if a["kind"] == "export"] == ["hf"], story
